"""The frontier at a second size (issue 33, item 5): the ``small`` preset (6 layers, 256 wide,
vocabulary 4096; about 16x nano's parameters) for DDP, DiLoCo fp32 and int8, SparseLoCo (the
paper's variant, the better one on the nano bench, 64 per 4096), DiLoCo with Muon inside
(MuLoCo) at H=10 and DiLoCo int4 with Muon inside at H=20, every method at equal tokens over
three seeds: whether the gap to DDP shrinks with size, as the DiLoCo scaling-law study
(arXiv 2503.09799) reports. What produced docs/results/frontier-small.json::

    python examples/frontier_small.py OUT_DIR [SEEDS [LABEL,LABEL,...]]

Settings (what two shared CPU cores allow in about an hour): 4 workers as threads, 60 steps of
batch 4 x 64 tokens (warmup 10, 16 held-out batches), H=10 (6 outer rounds; 3 at H=20). No lr
sweep at this size (``sweep_steps=0``): every family runs at the lrs the nano sweep chose
(docs/results/frontier-variants.json: DDP 3e-3; DiLoCo lr 0.01, outer lr 0.3; SparseLoCo lr
0.01, SparseLoCo lr 1.5), Muon rows included. Seeds are trained in stages, seed 0 of every
row first, then seed 1 of every row, and so on (``reuse`` reads the finished ones back), so an
interrupted run leaves every row with the same number of seeds. The JSON adds each row's loss
against DiLoCo fp32's, nano's rows of docs/results/frontier-targets.json beside them (other
token budget: 120 steps of batch 8) and the machine's load (``uptime``) before and after.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

from farlink.bench.frontier import Family, Method, grid, run
from farlink.bench.report import pyplot, save_figure

out = Path(sys.argv[1])
seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
H = 10
fams = [  # the nano sweep's lrs, one point each (not swept here)
    Family("ddp", {"algorithm": "ddp"}, grid(lr=[3e-3])),
    Family("diloco", {"algorithm": "diloco", "inner_steps": H}, grid(lr=[1e-2], outer_lr=[0.3])),
    Family("sparseloco", {"algorithm": "sparseloco", "inner_steps": H},
           grid(lr=[1e-2], sparseloco_lr=[1.5])),
]
rows = [
    Method("ddp", "ddp"),
    Method("diloco-fp32", "diloco"),
    Method("diloco-int8", "diloco", {"codec": "int8+ef"}),
    Method("sparseloco-k64", "sparseloco", {"sparseloco_topk": 64}),
    Method("diloco-muon", "diloco", {"inner": "muon"}),
    Method("diloco-muon-int4-H20", "diloco",
           {"inner": "muon", "codec": "int4+ef", "inner_steps": 20}),
]
base = {"model": "small", "workers": 4, "steps": 60, "batch_size": 4, "seq_len": 64,
        "warmup_steps": 10, "eval_batches": 16}
nano_path = Path(__file__).resolve().parent.parent / "docs/results/frontier-targets.json"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


load_log = out / "load.json"  # every stage of every invocation, kept across invocations
loads = json.loads(load_log.read_text()) if load_log.is_file() else []
for n in range(1, seeds + 1):  # seed 0 of every row, then seed 1 of every row, ...
    up0, t0 = uptime(), time.time()
    run(out, base, 0, H, family_list=fams, method_list=rows, only=only, reuse=True, seeds=n)
    loads.append({"seeds": n, "uptime_before": up0, "wall_s": time.time() - t0,
                  "uptime_after": uptime()})
    load_log.write_text(json.dumps(loads, indent=1))
doc = json.loads((out / "frontier.json").read_text())
fp32 = next((r for r in doc["rows"] if r["label"] == "diloco-fp32"), None)
for r in doc["rows"]:  # each row's loss against DiLoCo fp32's too
    if fp32 is not None:
        r["loss_vs_diloco_fp32"] = r["final_heldout_loss"] / fp32["final_heldout_loss"] - 1
# seeds past the last complete stage that some rows already have (an interrupted stage, or
# seeds trained by another process into the same run store): each row's every seed, their
# mean and the mean's gap to DDP's mean over its own seeds, beside the stage's uniform table
every_seed = {r["label"]: dict(enumerate(r.get("heldout_loss_seeds",
                                                [r["final_heldout_loss"]])))
              for r in doc["rows"]}
for r in doc["rows"]:
    for s in range(len(every_seed[r["label"]]), 3):
        path = out / "frontier" / "final" / f"{r['label']}-seed{s}.json"
        if path.is_file() and json.loads(path.read_text())["config"].get("seed") == s:
            every_seed[r["label"]][s] = json.loads(path.read_text())["final_heldout_loss"]


def mean(values) -> float:  # noqa: ANN001
    return sum(values) / len(values)


for r in doc["rows"]:
    losses = every_seed[r["label"]]
    r["seeds_every_run"], r["heldout_loss_every_seed_run"] = list(losses), list(losses.values())
    r["heldout_loss_mean_every_seed_run"] = mean(losses.values())
    if "ddp" in every_seed:
        r["loss_vs_ddp_every_seed_run"] = (r["heldout_loss_mean_every_seed_run"]
                                           / mean(every_seed["ddp"].values()) - 1)
    if "diloco-fp32" in every_seed:
        r["loss_vs_diloco_fp32_every_seed_run"] = (r["heldout_loss_mean_every_seed_run"]
                                                   / mean(every_seed["diloco-fp32"].values()) - 1)
if nano_path.is_file():
    nano = json.loads(nano_path.read_text())
    by_label = {r["label"]: r for r in nano["rows"]}
    doc["nano"] = {"source": "docs/results/frontier-targets.json", "settings": nano["settings"],
                   "rows": {m.label: {k: by_label[m.label].get(k) for k in (
                       "final_heldout_loss", "heldout_loss_seeds", "bytes_per_token",
                       "bytes_per_token_reduction_vs_ddp", "loss_vs_ddp")}
                            for m in rows if m.label in by_label}}
doc["load"] = {"invocations": loads, "cores": 2,
               "note": "one stage per seed count (runs of earlier stages or invocations read "
                       "back; each run file's wall_s is its own); 2 cores shared with other jobs, "
                       "training under nice -n 10"}
(out / "frontier.json").write_text(json.dumps(doc, indent=1, default=str))

# the gap to DDP at both sizes, method by method: loss vs DDP against bytes fewer than DDP
if "nano" in doc:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in doc["rows"]:
        if r["label"] == "ddp" or r["label"] not in doc["nano"]["rows"]:
            continue
        n = doc["nano"]["rows"][r["label"]]
        xs = [n["bytes_per_token_reduction_vs_ddp"], r["bytes_per_token_reduction_vs_ddp"]]
        ys = [100 * n["loss_vs_ddp"], 100 * r["loss_vs_ddp_every_seed_run"]]
        line, = ax.plot(xs, ys, linewidth=0.8, alpha=0.6)
        ax.scatter(xs[0], ys[0], marker="o", color=line.get_color(), s=30)
        ax.scatter(xs[1], ys[1], marker="s", color=line.get_color(), s=40, label=r["label"])
        ax.annotate(r["label"], (xs[1], ys[1]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axhline(2, color="grey", linestyle="--", linewidth=0.8, label="DDP + 2%")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per token, fewer than DDP (x)")
    ax.set_ylabel("held-out loss vs DDP (%)")
    counts = sorted({len(r["seeds_every_run"]) for r in doc["rows"]})
    ax.set_title(f"gap to DDP: nano (circles, 3 seeds) -> small (squares, "
                 f"{'-'.join(map(str, (counts[0], counts[-1])[:len(counts)]))} seeds per row)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    save_figure(fig, out / "frontier-vs-nano.png")
for r in doc["rows"]:
    print(r["label"], round(r["final_heldout_loss"], 4),
          [round(x, 4) for x in r.get("heldout_loss_seeds", [])], round(r["bytes_per_token"], 3),
          round(r.get("bytes_per_token_reduction_vs_ddp", 0), 1), round(r.get("loss_vs_ddp", 0), 4))
