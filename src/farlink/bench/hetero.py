"""``farlink bench hetero``: workers of different (emulated) speeds, fixed H vs time-budgeted.

Device speed is emulated: worker i sleeps (f_i - 1) times its own step time after every step
(slowdown factors, default 1:1:2:4), so a worker with f=4 runs at a quarter of the speed. With a
fixed H every round waits for the slowest worker; with time-budgeted rounds every worker runs as
many inner steps as fit in the round and the outer step weights each pseudo-gradient by the
tokens it was computed on. The time budget is derived from the fixed-H run itself (the time a
full-speed worker needed for H steps), and the budgeted run gets the same wall-clock.
"""

from __future__ import annotations

from pathlib import Path

from farlink.bench.report import plot_curves, write_json
from farlink.bench.runner import run_variant


def wall_to_loss(evals: list[dict], target: float) -> float | None:
    for e in sorted(evals, key=lambda e: e["wall_s"]):
        if e["loss"] <= target:
            return e["wall_s"]
    return None


def run(out: Path, slowdown: str, steps: int, inner_steps: int) -> dict:
    workers = len(slowdown.split(","))
    base = {"workers": workers, "slowdown": slowdown, "eval_batches": 8, "inner_steps": inner_steps}
    fixed = run_variant(f"fixed-H{inner_steps}", base, out, steps=steps)
    per_worker = fixed["per_worker"]
    fast = min(per_worker.values(), key=lambda w: w["compute_s"] / max(w["tokens"], 1))
    step_s = fast["compute_s"] / (fast["tokens"] / fixed["tokens_per_step"])
    budget = step_s * inner_steps
    rounds = max(1, int(fixed["wall_s"] / (budget * 1.15)))
    timed = run_variant(f"time-budget-{budget:.1f}s", base, out,
                        steps=rounds * inner_steps, round_seconds=budget)
    rows = []
    target = fixed["final_heldout_loss"]
    for r in (fixed, timed):
        row = {k: v for k, v in r.items() if k not in ("evals", "per_worker")}
        row["utilization_per_worker"] = {w: round(v["compute_utilization"], 3)
                                         for w, v in r["per_worker"].items()}
        row["wall_to_fixed_final_loss"] = wall_to_loss(r["evals"], target)
        rows.append(row)
    if rows[0]["wall_to_fixed_final_loss"] and rows[1]["wall_to_fixed_final_loss"]:
        rows[1]["speedup_to_target"] = (rows[0]["wall_to_fixed_final_loss"]
                                        / rows[1]["wall_to_fixed_final_loss"])
    write_json(out / "hetero.json", "hetero", rows,
               {"slowdown": slowdown, "emulation": "per-step sleep (device speed)",
                "round_seconds": budget, "target_loss": target})
    plot_curves(out / "hetero_loss_vs_wall.png",
                {r["label"]: [(e["wall_s"], e["loss"]) for e in r["evals"]] for r in (fixed, timed)},
                "wall-clock (s)", "held-out loss", f"speeds 1/{slowdown.replace(',', ':1/')}")
    return {"rows": rows}
