"""One replica group of a farlink run under a standard launcher: ``torchrun -m farlink.worker``.

torchft's own examples start a replica group as ``torchrun --nproc-per-node K train.py`` with
``TORCHFT_LIGHTHOUSE`` and ``REPLICA_GROUP_ID`` in the environment; SLURM, Kubernetes and torchx
start jobs the same way. This entry point reads exactly that::

    export TORCHFT_LIGHTHOUSE=http://lighthouse-host:29510 REPLICA_GROUP_ID=0
    torchrun --standalone --nproc-per-node 2 -m farlink.worker \\
        --run-dir runs/site0 --workers 2 --steps 500 --inner-steps 50 --host NODE_ADDRESS

* RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT (torchrun's): this rank's place in its replica
  group; ``--ranks-per-worker`` defaults to WORLD_SIZE, so it is never said twice.
* REPLICA_GROUP_ID (torchft's): which worker of the run this replica group is (its data shard, its
  name ``wI``); ``--index`` says the same on the command line, and the two must agree.
* TORCHFT_LIGHTHOUSE (torchft's): the Lighthouse; ``--lighthouse`` overrides it.

Every other setting is a ``farlink train`` flag (or ``--config run.toml``; a run dir that already
holds a run's ``config.toml`` starts from it). Only the replica group's rank 0 writes the run dir's
shared files (config, tokenizer, model shape); every rank writes only its own checkpoints and
ledger. ``farlink worker`` is the same command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from farlink.config import INVOCATION_FIELDS, ConfigError, RunConfig, load_config
from farlink.flags import config_options


class LaunchError(ValueError):
    """The environment or the flags do not say which replica group this is, or say it twice,
    differently."""


def replica_group_index(given: int | None, environ: dict[str, str]) -> int:
    """Which worker of the run this replica group is: ``--index`` or REPLICA_GROUP_ID, agreeing."""
    from_env = environ.get("REPLICA_GROUP_ID")
    if from_env is not None and not from_env.strip().isdigit():
        raise LaunchError(f"REPLICA_GROUP_ID={from_env!r} is not a worker index (0, 1, ...)")
    if given is None and from_env is None:
        raise LaunchError("which worker is this replica group? set REPLICA_GROUP_ID (as torchft's "
                          "examples do) or give --index")
    if given is not None and from_env is not None and int(from_env) != given:
        raise LaunchError(f"--index {given} but REPLICA_GROUP_ID={from_env}: give one of them, "
                          "or the same number in both")
    return given if given is not None else int(from_env)


def replica_group_config(values: dict[str, Any], environ: dict[str, str]) -> RunConfig:
    """The run's config for this rank: flags over ``--config`` (or the run dir's saved
    ``config.toml``), with the Lighthouse and the replica group's size taken from the environment
    when the flags leave them out."""
    values = dict(values)
    config_path = values.pop("config", None)
    ignore: frozenset[str] = frozenset()
    if values.get("lighthouse") is None:
        values["lighthouse"] = environ.get("TORCHFT_LIGHTHOUSE")
    if values.get("lighthouse") is None and (values.get("backend") or "torchft") == "torchft":
        raise LaunchError("no Lighthouse: set TORCHFT_LIGHTHOUSE (as torchft's examples do) or "
                          "give --lighthouse http://HOST:PORT")
    world = int(environ.get("WORLD_SIZE", "1"))
    if values.get("ranks_per_worker") is None:
        values["ranks_per_worker"] = world
    elif values["ranks_per_worker"] != world:
        raise LaunchError(f"--ranks-per-worker {values['ranks_per_worker']} but this process is "
                          f"one of WORLD_SIZE={world}: start the replica group with torchrun "
                          f"--nproc-per-node {values['ranks_per_worker']}, or drop the flag")
    if config_path is None and values.get("run_dir") is not None:
        saved = Path(values["run_dir"]) / "config.toml"
        # a run dir prepared by `farlink train` or by this replica group's rank 0
        if saved.is_file():
            config_path, ignore = saved, INVOCATION_FIELDS
    return load_config(config_path, values, ignore=ignore)


def prepare_run_dir(cfg: RunConfig, rank: int) -> None:
    """Rank 0 writes the run dir's shared files once (config, tokenizer, model shape, so that
    ``farlink export`` reads the result); the other ranks write nothing shared."""
    from farlink.train.rundir import check_resume, write_run_config

    if cfg.resume:
        check_resume(cfg)
    if rank != 0 or (cfg.run_dir / "config.json").is_file():
        return
    from farlink.data import prepare_data
    from farlink.train.launcher import write_model_files

    write_run_config(cfg)
    data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir, tokenizer=cfg.given_tokenizer)
    write_model_files(cfg, data)


@config_options
def worker(
    index: Optional[int] = typer.Option(None, "--index", help="this replica group's worker index "
                                        "(its data shard); default: REPLICA_GROUP_ID"),
    join: bool = typer.Option(False, "--join", help="heal from live peers in a first "
                              "zero-weight round (a replica group joining a run under way)"),
    **values: Any,
) -> None:
    """Run one replica group of a run under torchrun, SLURM, Kubernetes or torchx."""
    from farlink.robust.auth import run_secret
    from farlink.train.worker import run_worker

    environ = dict(os.environ)
    rank = int(environ.get("RANK", "0"))
    try:
        index = replica_group_index(index, environ)
        cfg = replica_group_config(values, environ)
        run_secret(cfg)  # a missing or exposed secret fails here, not in the first round
        prepare_run_dir(cfg, rank)
    except (ConfigError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    exit_process(run_worker(cfg, index, cfg.lighthouse or "", joining=join))


def launched(argv: list[str]) -> int:
    """A worker the launcher started (``farlink train``): ``RUN_DIR INDEX --lighthouse ADDR``,
    its config read from the run dir's ``config.json``; the exit code."""
    from farlink.train.worker import run_worker

    parser = argparse.ArgumentParser(description="one farlink worker (started by the launcher)")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("index", type=int)
    parser.add_argument("--lighthouse", "--coordinator", dest="lighthouse",
                        default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                        required="TORCHFT_LIGHTHOUSE" not in os.environ,
                        help="torchft Lighthouse address, or hivemind initial peers (comma list); "
                        "default: TORCHFT_LIGHTHOUSE")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--join", action="store_true",
                        help="heal from live peers in a first zero-weight round")
    parser.add_argument("--stop-at-step", type=int, default=None,
                        help="stop after this inner step (this invocation only)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("FARLINK_LOG", "WARNING"),
                        format=f"%(asctime)s w{args.index} %(name)s %(levelname)s %(message)s")
    cfg = RunConfig.model_validate_json((args.run_dir / "config.json").read_text())
    cfg = cfg.model_copy(update={"run_dir": args.run_dir, "resume": args.resume,
                                 "stop_at_step": args.stop_at_step})
    return run_worker(cfg, args.index, args.lighthouse, joining=args.join)


def exit_process(code: int) -> None:
    """End this process with ``code``. A rank of a replica group (torchrun's WORLD_SIZE > 1) leaves
    without the interpreter's teardown once everything is written and closed: destructors of
    its process groups' threads can call std::terminate at exit, which would turn a finished
    run into SIGABRT."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:  # noqa: ARG001
    app.command("worker", context_settings={"help_option_names": ["-h", "--help"]})(worker)


def main(argv: list[str] | None = None) -> None:
    """``python -m farlink.worker``: a launcher's worker names its run dir and index first
    (:func:`launched`); a replica group under torchrun gives only flags (:func:`worker`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-"):
        exit_process(launched(argv))
    logging.basicConfig(level=os.environ.get("FARLINK_LOG", "WARNING"),
                        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(name)s "
                        "%(levelname)s %(message)s")
    app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)
    app.command(context_settings={"help_option_names": ["-h", "--help"]})(worker)
    app(argv)


if __name__ == "__main__":
    main()
