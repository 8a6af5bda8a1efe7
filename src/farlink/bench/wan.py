"""``farlink bench wan --profile NAME``: DDP, DiLoCo, Streaming DiLoCo and DeMo on one emulated
wide-area link, same token budget, side by side.

The link is emulated in-process (every collective is held for ``hops x latency + bytes /
bandwidth`` of the named profile on top of the real loopback transfer); the report says so. It
reports per worker: compute utilization (inner compute / wall-clock, evaluation and checkpoints
set aside), bytes sent per token, wall-clock, held-out loss, and the peak bytes a single round put
on the wire (Streaming DiLoCo's point: about 1/P of DiLoCo's).
"""

from __future__ import annotations

from pathlib import Path

from farlink.bench.report import plot_curves, write_json
from farlink.bench.runner import run_variant
from farlink.train.metrics import read_metrics


def peak_round_bytes(run_dir: Path) -> int:
    """Largest number of bytes one worker sent in a single round."""
    records = [r for r in read_metrics(run_dir / "metrics" / "w0.jsonl")
               if r["kind"] in ("step", "sync")]
    peak, previous = 0, 0
    for r in records:
        if r["kind"] == "sync":
            peak = max(peak, r["bytes_sent"] - previous)
        previous = r["bytes_sent"]
    return peak


def variants(inner_steps: int, fragments: int) -> list[tuple[str, dict]]:
    return [
        ("ddp", {"algorithm": "ddp", "log_every": 1}),
        (f"diloco-H{inner_steps}", {"algorithm": "diloco"}),
        (f"diloco-H{inner_steps}-int8", {"algorithm": "diloco", "codec": "int8"}),
        (f"streaming-H{inner_steps}-P{fragments}-int4",
         {"algorithm": "streaming_diloco", "codec": "int4+ef", "fragments": fragments,
          "overlap_steps": max(1, inner_steps // (2 * fragments) - 1)}),
        ("demo", {"algorithm": "demo", "log_every": 1}),
    ]


def run(out: Path, profile: str, steps: int, inner_steps: int, workers: int, fragments: int,
        only: list[str] | None = None) -> dict:
    base = {"workers": workers, "steps": steps, "inner_steps": inner_steps,
            "emulate_link": profile, "eval_batches": 8}
    rows = []
    for label, overrides in variants(inner_steps, fragments):
        if only and not any(o in label for o in only):
            continue
        row = run_variant(f"{profile}-{label}", base, out, **overrides)
        row["profile"] = profile
        row["peak_round_bytes"] = peak_round_bytes(out / "runs" / f"{profile}-{label}")
        row["utilization_per_worker"] = {w: round(v["compute_utilization"], 3)
                                         for w, v in row["per_worker"].items()}
        rows.append(row)
    write_json(out / f"wan-{profile}.json", "wan",
               [{k: v for k, v in r.items() if k != "per_worker"} for r in rows],
               {"profile": profile, "emulation": "in-process: collectives held for "
                "latency + bytes/bandwidth of the profile (network namespaces not used)"})
    plot_curves(out / f"wan-{profile}-loss_vs_wall.png",
                {r["label"]: [(e["wall_s"], e["loss"]) for e in r["evals"]] for r in rows},
                "wall-clock (s)", "held-out loss", f"{profile} (in-process emulation)")
    return {"rows": rows}
