"""Runs one training variant through the real launcher and condenses its metrics into a row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from farlink.config import RunConfig, load_config
from farlink.sync import algorithm_class, capabilities
from farlink.train.launcher import launch, result_evals


def _finished_summary(cfg: RunConfig) -> dict | None:
    """A finished run's summary under the same configuration, if there is one (for --reuse)."""
    import json

    path, saved = cfg.run_dir / "summary.json", cfg.run_dir / "config.json"
    if not (path.is_file() and saved.is_file()):
        return None
    if RunConfig.model_validate_json(saved.read_text()).model_dump() != cfg.model_dump():
        return None  # compared as saved: a secret and per-invocation flags are never saved
    summary = json.loads(path.read_text())
    done = len(summary.get("per_worker", {})) == cfg.workers and summary.get("returncodes") == [
        0] * cfg.workers
    return summary if done else None


def set_aside_earlier_runs(out: Path) -> Path | None:
    """Start a benchmark whose runs are never read back from an empty ``out/runs``: an earlier
    invocation's runs move aside to ``out/runs.old-<time>`` (nothing is deleted). Without this,
    running a benchmark again into the same directory failed at its first run dir, after the
    measurements before it had already been spent. Returns where they went, if anywhere."""
    from farlink.train.rundir import move_aside

    runs = out / "runs"
    if not runs.exists():
        return None
    moved = move_aside(runs)
    print(f"an earlier run of this benchmark was moved aside to {moved}")
    return moved


def run_variant(label: str, base: dict[str, Any], out: Path, reuse: bool = False,
                network: Any = None, **overrides: Any) -> dict:
    """Train one variant in ``out/runs/<label>`` and return its summary row; with ``reuse``, a
    finished run of the identical configuration is read back instead of trained again; with
    ``network`` (a started emulate.Topology), the workers run inside its namespaces."""
    # a variant run again replaces its previous run, which stays next to it as label.old-<time>
    values = {**base, **overrides, "run_dir": out / "runs" / label, "overwrite": True}
    cfg: RunConfig = load_config(None, values)
    s = _finished_summary(cfg) if reuse else None
    if s is None:
        result = launch(cfg, show_progress=True, network=network)
        if result.interrupted:  # Ctrl-C/kill stops the whole benchmark, not one variant
            raise KeyboardInterrupt(f"interrupted during {label}")
        s, codes = result.summary, result.returncodes
    else:
        codes = s["returncodes"]
    workers = list(s["per_worker"].values())
    fragmented = capabilities(cfg.algorithm).fragments
    row = {
        "label": label,
        "algorithm": cfg.algorithm,
        "codec": cfg.codec,
        # what went on the wire, as the planner reads specs (DeMo's, SparseLoCo's own codec)
        "wire_spec": algorithm_class(cfg.algorithm).wire_spec(cfg),
        "inner_steps": cfg.inner_steps,
        "workers": cfg.workers,
        "tokens": s["total_tokens"],
        "final_heldout_loss": s["final_heldout_loss"],
        "final_heldout_ppl": s["final_heldout_ppl"],
        "bytes_per_worker": max((w["bytes_sent"] for w in workers), default=0),
        "bytes_per_token": max((w["bytes_per_token"] for w in workers), default=0.0),
        "compute_utilization": min((w["compute_utilization"] for w in workers), default=0.0),
        "wall_s": max((w["wall_s"] for w in workers), default=0.0),
        "returncodes": codes,
        "tokens_per_step": cfg.tokens_per_step,
        "fragments": cfg.fragments if fragmented else 1,
        "overlap_steps": cfg.overlap_steps if fragmented else None,
        "per_worker": s["per_worker"],
        "evals": result_evals(s["evals"], s.get("final_replicas", {}).get("holders")),
    }
    return row
