"""``farlink report RUN_DIR``: a finished (or interrupted) run's figures, table and plots."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from farlink.config import load_stored_config
from farlink.train.audit import audit_run
from farlink.train.launcher import summarize


def report(run_dir: Path, plot: bool = True) -> dict:
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a farlink run directory (no config.json)")
    cfg = load_stored_config(run_dir)
    # the stored run_dir is as the run was started (often relative to another directory): the
    # directory asked about is the one to read
    cfg = cfg.model_copy(update={"run_dir": run_dir})
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
        from farlink.extras import MissingExtra

        try:
            points = [(e["tokens"], e["loss"]) for e in summary["evals"]]
            path = plot_curves(run_dir / "loss_vs_tokens.png", {cfg.algorithm: points},
                               "tokens (evaluating worker)", "held-out loss", str(run_dir))
        except MissingExtra as exc:
            console.print(f"no plot: {exc}", markup=False)  # keep "farlink[plots]" literal
        else:
            console.print(f"plot: {path}")
    return {"summary": summary, "audit": audit}
