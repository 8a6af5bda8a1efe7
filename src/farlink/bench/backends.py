"""``farlink bench backends``: the same scenario on torchft (organizational) and hivemind
(community): wall-clock per outer round, bytes per worker, compute utilization, held-out loss.

A round as one worker sees it is the backend's own cost plus the wait for the slowest peer of
the round (its straggler spread, which on a shared machine is mostly noise). Three means are
reported: worker 0's rounds (``mean_round_s``), every worker's (``mean_round_s_all``), and each
round as the last peer to arrive saw it (``mean_last_arrival_round_s``): that peer waits for
nobody, so what it pays is the backend's quorum / matchmaking, exchange and commit alone.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from farlink.bench.report import plot_curves, write_json
from farlink.bench.runner import run_variant
from farlink.train.metrics import read_metrics


def round_seconds(run_dir: Path, worker: str = "w0") -> list[float]:
    """Seconds each committed round blocked ``worker`` (quorum/matchmaking + exchange +
    commit), by round."""
    return [r["round_s"] for r in read_metrics(run_dir / "metrics" / f"{worker}.jsonl")
            if r["kind"] == "sync" and r["committed"]]


def round_means(run_dir: Path) -> dict[str, float | int | None]:
    """Worker 0's mean round, every worker's, and the last arrival's (see the module
    docstring); rounds are matched by their order in each worker's metrics."""
    per_worker = {path.stem: round_seconds(run_dir, path.stem)
                  for path in sorted((run_dir / "metrics").glob("w*.jsonl"))}
    w0 = per_worker.get("w0", [])
    everyone = [s for rounds in per_worker.values() for s in rounds]
    matched = min((len(r) for r in per_worker.values()), default=0)
    last = [min(rounds[i] for rounds in per_worker.values()) for i in range(matched)]
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {"mean_round_s": mean(w0), "mean_round_s_all": mean(everyone),
            "mean_last_arrival_round_s": mean(last), "rounds": len(w0)}


def run(out: Path, steps: int, inner_steps: int, workers: int, codec: str) -> dict:
    base = {"workers": workers, "steps": steps, "inner_steps": inner_steps, "codec": codec,
            "min_replicas": workers, "eval_batches": 8}
    rows = []
    load_before = os.getloadavg()[0]
    for backend in ("torchft", "hivemind"):
        label = f"{backend}-diloco-H{inner_steps}-{codec}"
        row = run_variant(label, base, out, backend=backend)
        row["backend"] = backend
        row.update(round_means(out / "runs" / label))
        rows.append(row)
    by = {r["backend"]: r for r in rows}
    ratios = {key: round(by["hivemind"][key] / by["torchft"][key], 2)
              for key in ("mean_round_s", "mean_round_s_all", "mean_last_arrival_round_s")
              if by["hivemind"][key] and by["torchft"][key]}
    write_json(out / "backends.json", "backends",
               [{k: v for k, v in r.items() if k != "per_worker"} for r in rows],
               {"hivemind_over_torchft": ratios,
                "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]})
    plot_curves(out / "backends_loss_vs_wall.png",
                {r["label"]: [(e["wall_s"], e["loss"]) for e in r["evals"]] for r in rows},
                "wall-clock (s)", "held-out loss", "torchft vs hivemind, same scenario")
    return {"rows": rows, "ratios": ratios}
