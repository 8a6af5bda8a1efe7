"""The run directory: where a run's files go, and the rules that keep a user's runs safe.

Why: a run dir holds checkpoints that may have cost hours of compute, so nothing here deletes
one. A fresh run in a dir that already holds a run is refused with a message that names the
ways on (``--resume``, a new ``--run-dir``, ``--overwrite``); ``--overwrite`` moves the old run
aside to ``DIR.old-<time>``. The default, ``runs/latest``, is a link: every fresh run gets its
own ``runs/<time>`` dir and the link moves to it, so ``--resume --run-dir runs/latest`` continues
the newest run. ``--resume`` refuses a config that differs from the saved one in a field that
changes the model, the data or the layout of the saved state (:data:`FIXED_ON_RESUME`).

Everything that can refuse runs in :func:`plan_run_dir`, which writes nothing; the launcher
validates the rest of the run and only then calls :func:`open_run_dir`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import tomli_w

from farlink.config import LATEST_RUN, ConfigError, RunConfig, to_toml_dict

# what a run leaves in its dir: any of them means the dir holds a run
RUN_FILES = ("config.json", "config.toml", "metrics", "checkpoints", "final", "summary.json",
             "model.safetensors")

# A resumed run keeps these as saved: they define the model (model, vocab_size, seq_len), the
# tokens each worker reads and their order (corpus, seed, batch_size, grad_accum, workers: the
# shards and the batch of a step), and the layout and meaning of the checkpointed state (algorithm,
# its period inner_steps and island_steps, streaming fragments, the codec's error feedback, DeMo's
# DCT chunking). Anything else (steps, learning rates, timeouts, links, evaluation, device,
# precision, the ranks of a replica group) may change between invocations: a replica group's
# checkpoint is cut again for another --ranks-per-worker (farlink.parallel.reshard), but not for
# another --sharding, whose ranks hold other tensors.
FIXED_ON_RESUME = ("model", "vocab_size", "seq_len", "corpus", "seed", "batch_size", "grad_accum",
                   "workers", "algorithm", "inner_steps", "island_steps", "fragments", "codec",
                   "demo_chunk", "demo_topk", "sharding", "pipeline_stages",
                   "pipeline_micro_batches")


class RunDirError(ConfigError):
    """A run dir that this invocation must not use as asked; the message says what to do."""


def holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in RUN_FILES)


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... whichever does not exist yet."""
    candidate, n = path, 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _is_latest_link(run_dir: Path) -> bool:
    """The default ``runs/latest``, as a link (or not there yet); a real directory of that
    name (an older layout) is an ordinary run dir."""
    return run_dir == LATEST_RUN and (run_dir.is_symlink() or not run_dir.exists())


def plan_run_dir(cfg: RunConfig) -> tuple[RunConfig, Path | None]:
    """``cfg`` with its run dir resolved, and the ``latest`` link to point at it (or None).

    Raises :class:`RunDirError` when the invocation would mix with, lose or change a saved run.
    Writes nothing.
    """
    run_dir, link = cfg.run_dir, None
    if _is_latest_link(run_dir):
        if cfg.resume:
            if not run_dir.is_symlink():
                raise RunDirError(f"no run to resume: {run_dir} does not exist yet; start one "
                                  "without --resume")
            run_dir = run_dir.parent / os.readlink(run_dir)
        else:
            run_dir, link = _unused(run_dir.parent / _stamp()), run_dir
        cfg = cfg.model_copy(update={"run_dir": run_dir})
    if cfg.resume:
        check_resume(cfg)
    elif holds_run(run_dir) and not cfg.overwrite:
        raise RunDirError(
            f"{run_dir} already holds a run; nothing was changed. Continue it with --resume, "
            f"start a new one elsewhere with --run-dir NEW_DIR, or pass --overwrite to move it "
            f"aside (to {run_dir}.old-<time>) and start afresh here")
    check_writable(run_dir)
    if cfg.overwrite and not cfg.resume and holds_run(run_dir):
        check_writable(run_dir.parent)  # where the old run is moved aside
    return cfg, link


def check_writable(path: Path) -> None:
    """Refuse a run dir this process cannot write (a read-only mount, another user's
    directory): the launcher and every worker write config, logs, metrics and checkpoints
    there, and would each fail with a traceback. A path not made yet needs its nearest
    existing parent writable."""
    where = path
    while not where.exists() and where.parent != where:
        where = where.parent
    if where.exists() and not where.is_dir():
        raise RunDirError(f"{where} is a file, so {path} cannot be a run dir; nothing was "
                          "changed. Give --run-dir a directory")
    if os.access(where, os.W_OK | os.X_OK):
        return
    readonly = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    why = "is on a read-only file system" if readonly else "is not writable by this user"
    raise RunDirError(f"{where} {why}, so the run cannot write to {path}; nothing was changed. "
                      "Give --run-dir a directory you can write to" +
                      ("" if readonly else f", or make {where} writable (chmod u+w)"))


def check_resume(cfg: RunConfig) -> None:
    """Refuse to resume the run in ``cfg.run_dir`` under a config that changes what it trains."""
    saved_path = cfg.run_dir / "config.json"
    if not saved_path.is_file():
        raise RunDirError(f"no run to resume in {cfg.run_dir} (no config.json); drop --resume "
                          "to start a new run there")
    saved = json.loads(saved_path.read_text())
    given = cfg.model_dump(mode="json")
    changed = [name for name in FIXED_ON_RESUME if name in saved and saved[name] != given[name]]
    if changed:
        what = ", ".join(f"{name} (saved {saved[name]!r}, given {given[name]!r})"
                         for name in changed)
        raise RunDirError(
            f"--resume would change what the run in {cfg.run_dir} trains: {what}. Resume with "
            f"the saved values (drop the flag{'s' if len(changed) > 1 else ''}), or start a new "
            "run with --run-dir NEW_DIR")


def write_run_config(cfg: RunConfig) -> None:
    """Save the run's settings (never its secret or this invocation's own flags)."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
    (cfg.run_dir / "config.toml").write_text(tomli_w.dumps({"train": to_toml_dict(cfg)}))


def move_aside(run_dir: Path) -> Path:
    """Rename ``run_dir`` to an unused ``run_dir.old-<time>`` next to it; returns the new path."""
    target = _unused(run_dir.with_name(f"{run_dir.name}.old-{_stamp()}"))
    run_dir.rename(target)
    return target


def point_link(link: Path, run_dir: Path) -> None:
    """Make ``link`` name ``run_dir`` (a relative link when they share a parent), atomically."""
    target = run_dir.name if run_dir.parent == link.parent else os.path.abspath(run_dir)
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)


def open_run_dir(cfg: RunConfig, link: Path | None) -> Path | None:
    """Create the run dir planned by :func:`plan_run_dir` and save the config; with
    ``--overwrite``, first move the previous run aside (returned, else None)."""
    moved = None
    if not cfg.resume and cfg.overwrite and holds_run(cfg.run_dir):
        moved = move_aside(cfg.run_dir)
    write_run_config(cfg)
    if link is not None:
        point_link(link, cfg.run_dir)
    return moved
