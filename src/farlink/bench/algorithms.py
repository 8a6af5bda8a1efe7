"""``farlink bench algorithms``: every outer algorithm, and DiLoCo with every codec, for one token
budget on the default model and corpus. Reports held-out loss at equal tokens and bytes sent per
worker against DDP."""

from __future__ import annotations

from pathlib import Path

from farlink.bench.report import plot_curves, write_json
from farlink.bench.runner import run_variant

CODECS = ["fp16", "int8", "int4", "int4+ef", "topk:0.05+ef"]


def variants(inner_steps: int) -> list[tuple[str, dict]]:
    out = [
        ("ddp", {"algorithm": "ddp"}),
        (f"local_sgd-H{inner_steps}", {"algorithm": "local_sgd", "inner_steps": inner_steps}),
        (f"diloco-H{inner_steps}", {"algorithm": "diloco", "inner_steps": inner_steps}),
        (f"streaming-H{inner_steps}-int4",
         {"algorithm": "streaming_diloco", "inner_steps": inner_steps, "codec": "int4+ef"}),
        ("demo", {"algorithm": "demo"}),
        (f"sparseloco-H{inner_steps}", {"algorithm": "sparseloco", "inner_steps": inner_steps}),
    ]
    out += [(f"diloco-H{inner_steps}-{c.replace(':', '')}",
             {"algorithm": "diloco", "inner_steps": inner_steps, "codec": c}) for c in CODECS]
    return out


def run(out: Path, steps: int, inner_steps: int, workers: int, only: list[str] | None,
        reuse: bool = False) -> dict:
    base = {"steps": steps, "workers": workers, "eval_every": 1}
    rows = []
    for label, overrides in variants(inner_steps):
        if only and not any(label == o[1:] if o.startswith("=") else o in label for o in only):
            continue
        # DDP and DeMo sync every step: evaluate them at the same token points as the others
        rows.append(run_variant(label, base, out, reuse=reuse,
                                **{"inner_steps": inner_steps, **overrides}))
    ddp = next((r for r in rows if r["algorithm"] == "ddp"), None)
    for r in rows:
        if ddp and ddp["bytes_per_worker"] and r["bytes_per_worker"]:
            r["bytes_reduction_vs_ddp"] = ddp["bytes_per_worker"] / r["bytes_per_worker"]
        if ddp and ddp["final_heldout_loss"] and r["final_heldout_loss"]:
            r["loss_vs_ddp"] = r["final_heldout_loss"] / ddp["final_heldout_loss"] - 1
    write_json(out / "algorithms.json", "algorithms", rows,
               {"steps_per_worker": steps, "inner_steps": inner_steps, "workers": workers})
    plot_curves(out / "loss_vs_tokens.png",
                {r["label"]: [(e["tokens"] * workers, e["loss"]) for e in r["evals"]] for r in rows},
                "tokens (all workers)", "held-out loss", "held-out loss vs tokens")
    plot_curves(out / "loss_vs_bytes.png",
                {r["label"]: [(max(e["bytes_sent"], 1), e["loss"]) for e in r["evals"]]
                 for r in rows},
                "bytes sent per worker", "held-out loss", "held-out loss vs bytes sent", logx=True)
    return {"rows": rows}


def probe_variants(inner_steps: int) -> list[tuple[str, dict]]:
    """The frontier candidates, for runs with the workers as threads of one process."""
    h = inner_steps
    return [
        ("ddp", {"algorithm": "ddp"}),
        (f"diloco-H{h}", {"algorithm": "diloco", "inner_steps": h}),
        (f"diloco-H{h}-int8", {"algorithm": "diloco", "inner_steps": h, "codec": "int8+ef"}),
        (f"sparseloco-H{h}", {"algorithm": "sparseloco", "inner_steps": h}),
        ("demo", {"algorithm": "demo"}),
    ]


def _read_by(algorithm: str, extra: dict | None) -> dict:
    """The options of ``extra`` that ``algorithm`` reads: an algorithm's own option (``outer_lr``)
    goes to the variants that have it, since the config refuses an option its algorithm ignores."""
    from farlink.sync import ALGORITHMS, algorithm_class

    foreign = {f for name in ALGORITHMS for f in algorithm_class(name).Options.model_fields}
    own = algorithm_class(algorithm).Options.model_fields
    return {k: v for k, v in (extra or {}).items() if k not in foreign or k in own}


def probe(out: Path, steps: int, inner_steps: int, workers: int, only: list[str] | None,
          extra: dict | None = None, tag: str = "") -> dict:
    """Train the selected :func:`probe_variants` in-process (see :mod:`farlink.bench.inprocess`),
    one JSON row per variant under ``out/probe/`` (kept: a later call only adds), then the table
    of every row there against DDP: ``out/probe.json`` and ``out/probe_loss_vs_bytes.png``.
    ``extra`` overrides options of the selected variants; ``tag`` is appended to their labels."""
    import json

    from farlink.bench.inprocess import train_in_process

    rows_dir = out / "probe"
    rows_dir.mkdir(parents=True, exist_ok=True)
    base = {"steps": steps, "workers": workers, "inner_steps": inner_steps}
    for label, overrides in probe_variants(inner_steps):
        if only and label not in only:
            continue
        row = train_in_process(label + tag, {**base, **_read_by(overrides["algorithm"], extra),
                                             **overrides})
        (rows_dir / f"{label}{tag}.json").write_text(json.dumps(row, indent=1))
    rows = [json.loads(p.read_text()) for p in sorted(rows_dir.glob("*.json"))]
    ddp = next((r for r in rows if r["config"]["algorithm"] == "ddp"), None)
    for r in rows:
        if ddp is not None:
            r["bytes_per_token_reduction_vs_ddp"] = ddp["bytes_per_token"] / r["bytes_per_token"]
            r["loss_vs_ddp"] = r["final_heldout_loss"] / ddp["final_heldout_loss"] - 1
    write_json(out / "probe.json", "algorithms-probe", rows,
               {"steps_per_worker": steps, "inner_steps": inner_steps, "workers": workers,
                "workers_as": "threads of one process (InProcessGroup)"})
    plot_curves(out / "probe_loss_vs_bytes.png",
                {r["label"]: [(max(e["bytes_sent"], 1) / (e["tokens"] / workers), e["loss"])
                              for e in r["evals"]] for r in rows},
                "bytes sent per worker per token", "held-out loss",
                "held-out loss vs bytes per token", logx=True)
    return {"rows": rows}
