"""``farlink report RUN_DIR``: a finished (or interrupted) run's figures, table and plots."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from farlink.config import RunConfig
from farlink.train.audit import audit_run
from farlink.train.launcher import summarize


def report(run_dir: Path, plot: bool = True) -> dict:
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a farlink run directory (no config.json)")
    cfg = RunConfig.model_validate_json(config_path.read_text())
    summary = summarize(cfg)
    audit = audit_run(run_dir)
    table = Table(title=f"{run_dir}: {cfg.algorithm} ({cfg.codec}), {cfg.workers} workers")
    for column in ("worker", "tokens", "bytes sent", "bytes/token", "utilization", "wall s"):
        table.add_column(column)
    for name, w in summary["per_worker"].items():
        table.add_row(name, f"{w['tokens']:,}", f"{w['bytes_sent']:,}",
                      f"{w['bytes_per_token']:.1f}", f"{w['compute_utilization']:.1%}",
                      f"{w['wall_s']:.1f}")
    console = Console()
    console.print(table)
    console.print(f"held-out loss {summary['final_heldout_loss']} (ppl "
                  f"{summary['final_heldout_ppl']}); outer steps {audit['outer_steps']}, "
                  f"replicas consistent: {audit['consistent']}, restarts {audit['restarts']}")
    if audit["redone_committed_steps"]:
        console.print(f"rounds computed again to the same state after their checkpoint was lost: "
                      f"{audit['redone_steps']}")
    if plot and summary["evals"]:
        from farlink.bench.report import plot_curves

        path = plot_curves(run_dir / "loss_vs_tokens.png",
                           {cfg.algorithm: [(e["tokens"], e["loss"]) for e in summary["evals"]]},
                           "tokens (evaluating worker)", "held-out loss", str(run_dir))
        console.print(f"plot: {path}")
    return {"summary": summary, "audit": audit}
