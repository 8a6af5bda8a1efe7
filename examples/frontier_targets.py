"""The frontier's two byte/loss targets (issue 33) over three seeds: SparseLoCo and DiLoCo int4
with Muon inside at longer H (fewer rounds at the same tokens, so fewer bytes), SparseLoCo at the
bench's other density (32 per 4096) and the authors' variant with Muon inside, DiLoCo + Muon at
H=20 with a top-k error-feedback codec at densities past 1000x, ~500x and ~130x fewer bytes than
DDP (and, off the frontier, denser top-k and dense fp16), beside the rows of
docs/results/frontier-seeds.json. What produced docs/results/frontier-targets.json::

    python examples/frontier_targets.py OUT_DIR [SEEDS_RUN_DIR [LABEL,LABEL,...]]

Same settings as frontier-seeds (nano, 4 workers as threads, 120 steps of batch 8 x 64 tokens,
warmup 20, 16 held-out batches, seeds 0, 1, 2). Every method runs at its family's lrs from the
sweep of docs/results/frontier-variants.json (DiLoCo lr 0.01, outer lr 0.3; SparseLoCo lr 0.01,
SparseLoCo lr 1.5; the authors' variant 0.01, 0.5), swept at H=10 with AdamW inside, Muon rows
included (the top-k DiLoCo rows too: DiLoCo's lrs, none tuned per row); the ``-swept`` rows
instead use a sweep of SparseLoCo's family at their own H, the grid and edge extension of
``farlink bench frontier`` (60 steps, AdamW inside). With ``SEEDS_RUN_DIR`` (the ``frontier``
run directory of examples/frontier_seeds.py) the H=10 rows and sweep points that table trained
are read back from its run files, marked so; the rest are trained here (the run files of OUT_DIR
from an earlier invocation are read back too, so new rows train alone). The JSON records the
machine's load (``uptime``) before and after.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

from farlink.bench.frontier import Family, Method, grid, run

out = Path(sys.argv[1])
seeds_runs = Path(sys.argv[2]) if len(sys.argv) > 2 else None
H = 10
fams = [
    Family("ddp", {"algorithm": "ddp"}, grid(lr=[3e-3])),
    Family("diloco", {"algorithm": "diloco", "inner_steps": H}, grid(lr=[1e-2], outer_lr=[0.3])),
    Family("sparseloco", {"algorithm": "sparseloco", "inner_steps": H},
           grid(lr=[1e-2], sparseloco_lr=[1.5])),
    Family("sparseloco-authors",
           {"algorithm": "sparseloco", "sparseloco_variant": "authors", "inner_steps": H},
           grid(lr=[1e-2], sparseloco_lr=[0.5])),
    # SparseLoCo at longer H, swept as `farlink bench frontier` sweeps its family (the grid of
    # farlink.bench.frontier.families, AdamW inside, extended while the best is on an edge)
    *[Family(f"sparseloco-H{h}", {"algorithm": "sparseloco", "inner_steps": h},
             grid(lr=[1e-2, 3e-2], sparseloco_lr=[1.0, 1.5, 2.0])) for h in (20, 30)],
]
# the H=10 rows of frontier-seeds (SparseLoCo: the paper's variant, below the authors' there)
seeds_rows = [
    Method("ddp", "ddp"),
    Method("diloco-fp32", "diloco"),
    Method("diloco-int8", "diloco", {"codec": "int8+ef"}),
    Method("diloco-muon", "diloco", {"inner": "muon"}),
    Method("sparseloco-k64", "sparseloco", {"sparseloco_topk": 64}),
    Method("sparseloco-muon-k64", "sparseloco", {"sparseloco_topk": 64, "inner": "muon"}),
]
# longer H at the same tokens: bytes per token fall as 1/H (SparseLoCo at H=20 and 30 sends
# about 1260x and 1890x fewer than DDP), the loss is what is measured
longer = [
    Method("sparseloco-muon-k64-H20", "sparseloco",
           {"sparseloco_topk": 64, "inner": "muon", "inner_steps": 20}),
    Method("sparseloco-muon-k64-H30", "sparseloco",
           {"sparseloco_topk": 64, "inner": "muon", "inner_steps": 30}),
    Method("diloco-muon-int4-H20", "diloco",
           {"inner": "muon", "codec": "int4+ef", "inner_steps": 20}),
    Method("diloco-muon-int4-H30", "diloco",
           {"inner": "muon", "codec": "int4+ef", "inner_steps": 30}),
]
# which SparseLoCo variant is the better with Muon inside; the bench's other density (32 per
# 4096: half the bytes, about 1260x fewer than DDP at H=10)
more = [
    Method("sparseloco-authors-muon-k64", "sparseloco-authors",
           {"sparseloco_topk": 64, "inner": "muon"}),
    Method("sparseloco-k32", "sparseloco", {"sparseloco_topk": 32}),
    Method("sparseloco-muon-k32", "sparseloco", {"sparseloco_topk": 32, "inner": "muon"}),
]
# DiLoCo + Muon at H=20 with top-k error feedback instead of int4 (int4+ef there: 150x fewer
# bytes than DDP at -1.4%). A sparse payload takes the exchange's gathered path, (n-1) x payload
# per worker per round, indices included (per tensor the smaller of uint16 and varint gaps), so
# the densities below were set from the bytes one round of each codec measured on this model:
# 1% of entries as fp16 values ~1120x fewer than DDP, 0.64% as fp32 ~1060x, 2.5% as fp16 ~500x;
# and 10% as fp16 (~130x), about int4's bytes, to compare the two codecs at one budget. (The
# top-k codec has no int4 values.)
sparse_codec = [
    Method(f"diloco-muon-topk{label}-H{h}", "diloco",
           {"inner": "muon", "codec": f"topk:{spec}+ef", "inner_steps": h})
    for h, label, spec in ((20, "0.01-fp16", "0.01:fp16"), (20, "0.0064", "0.0064"),
                           (20, "0.025-fp16", "0.025:fp16"), (20, "0.1-fp16", "0.1:fp16"))
]
# where the loss goes between dense and 10%: the same row at denser top-k, off the frontier (the
# JSON's ``ablations``); at 100% top-k sends every entry, so it must match a dense fp16 exchange
density_scan = [
    Method(f"diloco-muon-topk{f:g}-fp16-H20", "diloco",
           {"inner": "muon", "codec": f"topk:{f:g}:fp16+ef", "inner_steps": 20})
    for f in (1.0, 0.5, 0.25, 0.05)
] + [Method("diloco-muon-fp16-H20", "diloco",
             {"inner": "muon", "codec": "fp16", "inner_steps": 20})]
# whether DiLoCo's outer lr is what holds the 1% row back: larger outer lrs, and plain averaging
# of the sparse deltas (outer lr 1, no momentum), also off the frontier
density_scan += [
    Method(f"diloco-muon-topk0.01-fp16-H20-{tag}", "diloco",
           {"inner": "muon", "codec": "topk:0.01:fp16+ef", "inner_steps": 20, **outer})
    for tag, outer in (("olr0.7", {"outer_lr": 0.7}), ("olr1", {"outer_lr": 1.0}),
                       ("olr1-nomom", {"outer_lr": 1.0, "outer_momentum": 0.0}))
]
# the longer-H rows at lrs swept at their own H (the swept families above)
swept = [Method(f"sparseloco-muon-k64-H{h}-swept", f"sparseloco-H{h}",
                {"sparseloco_topk": 64, "inner": "muon"}) for h in (20, 30)]
only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
base = {"model": "nano", "workers": 4, "steps": 120, "batch_size": 8, "seq_len": 64,
        "warmup_steps": 20, "eval_batches": 16}
sweep_steps = 60
if seeds_runs is not None:  # read back what frontier-seeds trained (same configs)
    source = "read back from the runs of docs/results/frontier-seeds.json"
    for phase in ("sweep", "final"):
        for path in sorted((seeds_runs / phase).glob("*.json")):
            target = out / "frontier" / phase / path.name
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            row = json.loads(path.read_text())
            row.setdefault("source", source)
            target.write_text(json.dumps(row, indent=1))
earlier = (json.loads((out / "frontier.json").read_text()).get("load")
           if (out / "frontier.json").is_file() else None)
up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
t0 = time.time()
result = run(out, base, sweep_steps, H, family_list=fams,
             method_list=seeds_rows + longer + more + swept + sparse_codec, only=only, reuse=True,
             max_extensions=3, seeds=3, ablation_list=density_scan)
up1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
doc = json.loads((out / "frontier.json").read_text())
fp32 = next(r for r in doc["rows"] if r["label"] == "diloco-fp32")["final_heldout_loss"]
for r in doc["rows"]:  # each row's loss against DiLoCo fp32's too (target b)
    r["loss_vs_diloco_fp32"] = r["final_heldout_loss"] / fp32 - 1
doc["load"] = {"uptime_before": up0, "uptime_after": up1, "wall_s": time.time() - t0,
               "cores": 2, "note": "runs trained by earlier invocations were read back (each "
               "run file's wall_s is its own); 2 cores shared with other jobs"}
if earlier is not None:  # the invocations before this one, as they recorded their load
    doc["load"]["earlier_invocations"] = earlier
(out / "frontier.json").write_text(json.dumps(doc, indent=1, default=str))
for r in result["rows"]:
    print(r["label"], round(r["final_heldout_loss"], 4), [round(x, 4) for x in
          r.get("heldout_loss_seeds", [])], round(r["bytes_per_token"], 3),
          round(r.get("bytes_per_token_reduction_vs_ddp", 0), 1),
          round(r.get("loss_vs_ddp", 0), 4))
print(up0)
print(up1)
