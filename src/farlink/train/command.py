"""``farlink train`` and ``farlink join`` (every RunConfig field becomes a flag), and the commands
that read a run directory: ``report``, ``export``, ``generate``.

The flags are generated from the pydantic model (:mod:`farlink.flags`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer

from farlink.config import ConfigError
from farlink.flags import config_from, config_options


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @app.command(context_settings={"help_option_names": ["-h", "--help"]})
    @config_options
    def train(**values: Any) -> None:
        """Train with N local workers (torchft Lighthouse + one replica group per worker)."""
        from farlink.data import CorpusError
        from farlink.train.launcher import console, launch

        cfg = config_from(values)
        try:
            result = launch(cfg)
        except (CorpusError, ConfigError) as exc:  # refused before anything was written
            typer.secho(f"error: {exc}", fg="red", err=True)
            raise typer.Exit(2) from None
        s = result.summary
        if s.get("final_heldout_loss") is not None:
            console.print(
                f"held-out loss {s['final_heldout_loss']:.4f} (ppl {s['final_heldout_ppl']:.1f}) "
                f"after {s['total_tokens']:,} tokens; summary in {result.run_dir / 'summary.json'}"
            )
        if result.interrupted:
            raise typer.Exit(130)
        if any(result.returncodes) or result.problem is not None:
            raise typer.Exit(1)

    @app.command(context_settings={"help_option_names": ["-h", "--help"]})
    @config_options
    def join(
        index: int = typer.Option(..., "--index", help="this worker's index (its data shard)"),
        **values: Any,
    ) -> None:
        """Start one worker that joins a running job through its Lighthouse (--lighthouse ADDR).

        It downloads the current parameters and outer-optimizer state from a live peer during its
        first quorum and contributes from the next round on. It writes only its own files (its
        metrics, checkpoints, final model); a run dir that already holds a run's config keeps it as
        it is, and its own run dir gets its config, tokenizer and model shape. An index a live
        worker holds is refused (naming a free one); one an earlier worker left files for is
        continued only with --resume (after a crash: the same command with --resume). With
        --ranks-per-worker K (outside torchrun) it starts a replica group of K ranks on this
        machine, each rank running this command; each heals its own shard from the same rank of a
        live replica group.
        """
        from farlink.loggers import require_sinks
        from farlink.robust.auth import run_secret
        from farlink.train.index_lock import check_joinable
        from farlink.train.rundir import check_resume, check_writable
        from farlink.train.worker import run_worker
        from farlink.worker import exit_process

        cfg = config_from(values)
        if cfg.lighthouse is None:
            typer.secho("error: --lighthouse ADDR is required to join", fg="red", err=True)
            raise typer.Exit(2)
        try:
            check_writable(cfg.run_dir)
            # a replica group's rank 0 takes the index lock for the whole replica group
            if os.environ.get("RANK", "0") == "0":
                check_joinable(cfg.run_dir, index, cfg.resume)
            run_secret(cfg)  # a missing or exposed secret fails here, not in the first round
            require_sinks(cfg.log_to)  # --log-to's packages (farlink[metrics]), before joining
            if cfg.resume:
                check_resume(cfg)
        except ValueError as exc:
            typer.secho(f"error: {exc}", fg="red", err=True)
            raise typer.Exit(2) from None
        from farlink.worker import prepare_run_dir

        if cfg.ranks_per_worker > 1 and "WORLD_SIZE" not in os.environ:
            # a replica group of K ranks on this machine: this same command, once per rank, by
            # torchrun
            from farlink.parallel.replica_group_agent import run_as_replica_group

            raise typer.Exit(run_as_replica_group(cfg.host, cfg.ranks_per_worker,
                                                  ["-m", "farlink.cli", *sys.argv[1:]]))
        # a joiner's own run dir gets the run's files; under torchrun only the replica group's
        # rank 0 writes them
        prepare_run_dir(cfg, rank=int(os.environ.get("RANK", "0")))
        exit_process(run_worker(cfg, index, cfg.lighthouse, joining=True))

    register_model_commands(app)

    @app.command("report")
    def report_cmd(run_dir: Path = typer.Argument(..., help="a run directory")) -> None:
        """Per-worker tokens, bytes, utilization, held-out loss and replica agreement of a run."""
        from farlink.train.report import report

        try:
            report(run_dir)
        except FileNotFoundError as exc:
            typer.secho(f"error: {exc}", fg="red", err=True)
            raise typer.Exit(2) from None


def register_model_commands(app: typer.Typer) -> None:
    """``farlink export`` and ``farlink generate``: what a finished run's model is for."""

    @app.command("export")
    def export_cmd(
        run_dir: Path = typer.Argument(..., help="a finished run directory"),
        hf: Path = typer.Option(..., "--hf", help="write a Hugging Face model directory here "
                                "(AutoModelForCausalLM / AutoTokenizer load it)"),
    ) -> None:
        """Export a run's final model and tokenizer (farlink's GPT becomes a LlamaForCausalLM)."""
        from farlink.train.export import export_hf

        try:
            out = export_hf(run_dir, hf)
        except (FileNotFoundError, FileExistsError) as exc:
            typer.secho(f"error: {exc}", fg="red", err=True)
            raise typer.Exit(2) from None
        except OSError as exc:  # a read-only or full disk: nothing was published at --hf
            typer.secho(f"error: cannot export to {hf}: {exc.strerror or exc}; nothing was "
                        "written there", fg="red", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"wrote {out}")

    @app.command("generate")
    def generate_cmd(
        run_dir: Path = typer.Argument(..., help="a finished run directory"),
        prompt: str = typer.Option("", help="text to continue (empty: start a new document)"),
        max_new_tokens: int = typer.Option(200, min=1, help="tokens to sample at most"),
        temperature: float = typer.Option(0.8, min=0.0, help="0 = always the likeliest token"),
        top_k: int = typer.Option(200, min=0, help="sample among the k likeliest (0 = all)"),
        seed: int = typer.Option(1337, help="seed of the sampling generator"),
        num_samples: int = typer.Option(1, min=1, help="independent samples to print"),
    ) -> None:
        """Sample text from a run's final model."""
        from farlink.train.generate import generate

        for k in range(num_samples):
            try:
                text = generate(run_dir, prompt, max_new_tokens, temperature, top_k or None,
                                seed + k)
            except FileNotFoundError as exc:
                typer.secho(f"error: {exc}", fg="red", err=True)
                raise typer.Exit(2) from None
            typer.echo(text)
            if k + 1 < num_samples:
                typer.echo("---------------")
