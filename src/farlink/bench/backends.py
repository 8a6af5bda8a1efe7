"""``farlink bench backends``: the same scenario on torchft (organizational) and hivemind
(community): wall-clock per outer round, bytes per worker, compute utilization, held-out loss."""

from __future__ import annotations

from pathlib import Path

from farlink.bench.report import plot_curves, write_json
from farlink.bench.runner import run_variant
from farlink.train.metrics import read_metrics


def round_seconds(run_dir: Path) -> list[float]:
    """Seconds each committed round blocked worker 0 (quorum/matchmaking + exchange + commit)."""
    return [r["round_s"] for r in read_metrics(run_dir / "metrics" / "w0.jsonl")
            if r["kind"] == "sync" and r["committed"]]


def run(out: Path, steps: int, inner_steps: int, workers: int, codec: str) -> dict:
    base = {"workers": workers, "steps": steps, "inner_steps": inner_steps, "codec": codec,
            "min_replicas": workers, "eval_batches": 8}
    rows = []
    for backend in ("torchft", "hivemind"):
        label = f"{backend}-diloco-H{inner_steps}-{codec}"
        row = run_variant(label, base, out, backend=backend)
        rounds = round_seconds(out / "runs" / label)
        row["backend"] = backend
        row["mean_round_s"] = sum(rounds) / len(rounds) if rounds else None
        row["rounds"] = len(rounds)
        rows.append(row)
    write_json(out / "backends.json", "backends",
               [{k: v for k, v in r.items() if k != "per_worker"} for r in rows])
    plot_curves(out / "backends_loss_vs_wall.png",
                {r["label"]: [(e["wall_s"], e["loss"]) for e in r["evals"]] for r in rows},
                "wall-clock (s)", "held-out loss", "torchft vs hivemind, same scenario")
    return {"rows": rows}
