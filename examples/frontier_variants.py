"""A short side-by-side frontier: SparseLoCo in the paper's and its authors' variant, and Muon
inside DiLoCo and SparseLoCo, at the lrs the full ``farlink bench frontier`` swept (the authors'
variant gets its own small sweep). What produced docs/results/frontier-variants.json::

    python examples/frontier_variants.py OUT_DIR 120 60    # final steps, sweep steps

Finished runs in OUT_DIR are read back (an interrupted run continues); the JSON records the
machine's load (``uptime``) before and after.
"""
import json
import subprocess
import sys
import time
from pathlib import Path
from farlink.bench.frontier import Family, Method, grid, run

out = Path(sys.argv[1])
H = 10
local = {"inner_steps": H}
fams = [
    Family("ddp", {"algorithm": "ddp"}, grid(lr=[3e-3])),
    Family("diloco", {"algorithm": "diloco", **local}, grid(lr=[1e-2], outer_lr=[0.3])),
    Family("sparseloco", {"algorithm": "sparseloco", **local}, grid(lr=[1e-2], sparseloco_lr=[1.5])),
    Family("sparseloco-authors", {"algorithm": "sparseloco", "sparseloco_variant": "authors", **local},
           grid(lr=[1e-2], sparseloco_lr=[0.5, 1.0])),
]
meths = [
    Method("ddp", "ddp"),
    Method("diloco-fp32", "diloco"),
    Method("diloco-int8", "diloco", {"codec": "int8+ef"}),
    Method("sparseloco-k64", "sparseloco", {"sparseloco_topk": 64}),
    Method("sparseloco-authors-k64", "sparseloco-authors", {"sparseloco_topk": 64}),
    Method("diloco-muon", "diloco", {"inner": "muon"}),
    Method("sparseloco-muon-k64", "sparseloco", {"sparseloco_topk": 64, "inner": "muon"}),
    # the outer step off the critical path: one fragment whose averaged update lands 9 of the
    # 10 inner steps later, mixed half-and-half into the local model (Streaming DiLoCo, P = 1)
    Method("diloco-delayed-9", "diloco",
           {"algorithm": "streaming_diloco", "fragments": 1, "overlap_steps": 9}),
]
base = {"model": "nano", "workers": 4, "steps": int(sys.argv[2]), "batch_size": 8, "seq_len": 64,
        "warmup_steps": 20, "eval_batches": 16}
up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
t0 = time.time()
result = run(out, base, int(sys.argv[3]), H, family_list=fams, method_list=meths, reuse=True,
             max_extensions=1)
up1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
doc = json.loads((out / "frontier.json").read_text())
doc["load"] = {"uptime_before": up0, "uptime_after": up1, "wall_s": time.time() - t0,
               "cores": 2}
(out / "frontier.json").write_text(json.dumps(doc, indent=1, default=str))
for r in result["rows"]:
    print(r["label"], round(r["final_heldout_loss"], 4), round(r["bytes_per_token"], 3),
          round(r.get("bytes_per_token_reduction_vs_ddp", 0), 1), round(r.get("loss_vs_ddp", 0), 4))
print(up0); print(up1)
