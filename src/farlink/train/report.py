"""``farlink report RUN_DIR``: a finished (or interrupted) run's figures, table and plots."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from farlink.config import load_stored_config
from farlink.train.audit import audit_run
from farlink.train.launcher import summarize
from farlink.train.metrics import read_metrics


def report(run_dir: Path, plot: bool = True) -> dict:
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a farlink run directory (no config.json)")
    cfg = load_stored_config(run_dir)
    # the stored run_dir is as the run was started (often relative to another directory): the
    # directory asked about is the one to read
    cfg = cfg.model_copy(update={"run_dir": run_dir})
    if cfg.pipeline_stages > 1:  # no worker processes: the pipeline trainer wrote the figures
        return report_pipeline(run_dir, cfg.algorithm, plot)
    summary = summarize(cfg)
    audit = audit_run(run_dir)
    workers = worker_rows(run_dir, summary["per_worker"])
    table = Table(title=f"{run_dir}: {cfg.algorithm} ({cfg.codec}), {cfg.workers} workers")
    for column in ("worker", "tokens", "bytes sent", "bytes/token", "utilization", "wall s",
                   "status"):
        table.add_column(column)
    for name, w in workers.items():
        table.add_row(name, f"{w['tokens']:,}", f"{w['bytes_sent']:,}",
                      f"{w['bytes_per_token']:.1f}", f"{w['compute_utilization']:.1%}",
                      f"{w['wall_s']:.1f}", w["status"])
    console = Console()
    console.print(table)
    console.print(f"held-out loss {summary['final_heldout_loss']} (ppl "
                  f"{summary['final_heldout_ppl']}); outer steps {audit['outer_steps']}, "
                  f"replicas consistent: {audit['consistent']}, restarts {audit['restarts']}")
    contributions(console, run_dir)
    if audit["redone_committed_steps"]:
        console.print(f"rounds computed again to the same state after their checkpoint was lost: "
                      f"{audit['redone_steps']}")
    if plot and summary["evals"]:
        _plot(console, run_dir, cfg.algorithm, summary["evals"], "tokens (evaluating worker)")
    return {"summary": summary, "audit": audit, "workers": workers}


def contributions(console: Console, run_dir: Path) -> None:
    """The first worker's ledger (every member judges every peer alike): tokens claimed,
    accepted and credited per peer, its score and rating in a loss-scored run, and why a peer
    was discounted, rejected or credited nothing."""
    from farlink.robust.ledger import ContributionLedger

    ledgers = sorted((run_dir / "ledger").glob("w*.json"))
    if not ledgers:
        return
    try:
        ledger = ContributionLedger.load(ledgers[0])
    except ValueError as exc:
        console.print(f"contributions: {exc}")
        return
    table = ledger.summary()
    table.title = f"Contributions (as {ledgers[0].stem} judged them)"
    console.print(table)


def worker_rows(run_dir: Path, ended: dict[str, dict]) -> dict[str, dict]:
    """One row per worker that wrote any metrics, by name. ``ended`` holds the figures of the
    workers that wrote an ``end`` record (:func:`summarize`); a worker without one (killed,
    crashed) is shown too, from its last record with a token count, as "did not finish": after a
    crash the workers that trained are the ones worth seeing."""
    rows = {}
    for path in sorted((run_dir / "metrics").glob("w*.jsonl")):
        name, records = path.stem, read_metrics(path)
        if name in ended:
            end = [r for r in records if r["kind"] == "end"][-1]
            status = "finished" if end.get("finished", True) else \
                f"stopped at step {end.get('inner_steps', '?')}"
            rows[name] = {**ended[name], "status": status}
            continue
        if not records:
            continue
        last = next((r for r in reversed(records) if "tokens" in r), {})
        tokens, sent = last.get("tokens", 0), last.get("bytes_sent", 0)
        wall = last.get("wall_s", 0.0)
        rows[name] = {"tokens": tokens, "bytes_sent": sent,
                      "bytes_per_token": sent / max(tokens, 1),
                      "compute_utilization": last.get("compute_s", 0.0) / max(wall, 1e-9),
                      "wall_s": wall, "step": last.get("step", 0),
                      "status": f"did not finish (last step {last.get('step', 0)})"}
    return rows


def report_pipeline(run_dir: Path, algorithm: str, plot: bool = True) -> dict:
    """A pipeline run's figures (``train/pipeline_run.py``): its ``summary.json``, written when
    the run ends, is stopped or fails; peers and bytes by what they carried."""
    path = run_dir / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no summary.json: the pipeline run has not ended "
                                f"(it is running, or was killed: farlink train --resume "
                                f"--run-dir {run_dir} finishes it)")
    summary = json.loads(path.read_text())
    console = Console()
    table = Table(title=f"{run_dir}: {summary['pipeline_stages']} stages x "
                        f"{summary['peers_per_stage']} peers, {algorithm} within a stage "
                        f"({summary['activation_codec']} activations)")
    for column in ("carried", "bytes", "bytes/token"):
        table.add_column(column)
    tokens = max(summary["total_tokens"], 1)
    for kind, moved in summary["bytes_by_kind"].items():
        table.add_row(kind, f"{moved:,}", f"{moved / tokens:.1f}")
    console.print(table)
    dead = [name for name, live in summary["live_peers"].items() if not live]
    console.print(f"held-out loss {summary['final_heldout_loss']} (ppl "
                  f"{summary['final_heldout_ppl']}); steps {summary['steps_done']} of "
                  f"{summary['steps']}, outer steps {summary['outer_steps']}, tokens "
                  f"{summary['total_tokens']:,}, {summary['wall_s']:.1f} s; peers lost: "
                  f"{', '.join(dead) or 'none'}")
    if summary.get("problem"):
        console.print(f"problem: {summary['problem']}", markup=False)
    if plot and summary["evals"]:
        _plot(console, run_dir, algorithm, summary["evals"], "tokens (all pipelines)")
    return {"summary": summary}


def _plot(console: Console, run_dir: Path, label: str, evals: list[dict], xlabel: str) -> None:
    from farlink.bench.report import plot_curves
    from farlink.extras import MissingExtra

    try:
        points = [(e["tokens"], e["loss"]) for e in evals]
        path = plot_curves(run_dir / "loss_vs_tokens.png", {label: points}, xlabel,
                           "held-out loss", str(run_dir))
    except MissingExtra as exc:
        console.print(f"no plot: {exc}", markup=False)  # keep "farlink[plots]" literal
    else:
        console.print(f"plot: {path}")
