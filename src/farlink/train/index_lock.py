"""One live process per worker index of a run dir.

Two processes training as the same worker index would share its metrics file, its checkpoint
directory (each removing the other's temporary files and pruning its checkpoints) and its
replica id at the Lighthouse, which takes them for one replica: the run's record and its
checkpoints would turn wrong without an error. So a worker holds an exclusive ``flock`` on
``RUN_DIR/locks/wI.lock`` for its whole life. The kernel drops the lock when the process ends,
however it ends (SIGKILL, an OOM kill, a power cut), so the index of a crashed worker is free at
once for ``--resume``, and there is never a stale lock to remove by hand.

``farlink join`` asks first (:func:`check_joinable`) so that it can refuse with the fix (a free
index, or ``--resume``) before it starts anything.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class IndexInUse(ValueError):
    """Another live process trains as this worker index in this run dir, or (for a joiner
    without ``--resume``) an earlier worker of this index left its files there."""


def lock_path(run_dir: Path, index: int) -> Path:
    return run_dir / "locks" / f"w{index}.lock"


def earlier_files(run_dir: Path, index: int) -> list[Path]:
    """What a worker of this index left in the run dir: its metrics and checkpoints."""
    found = [run_dir / "metrics" / f"w{index}.jsonl", run_dir / "checkpoints" / f"w{index}"]
    return [p for p in found if p.exists()]


def holder(run_dir: Path, index: int) -> int | None:
    """The pid of the live process that holds ``index`` (0 if it wrote none yet), or None."""
    path = lock_path(run_dir, index)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.read(fd, 32).decode(errors="replace").strip()
        return int(text) if text.isdigit() else 0
    else:
        return None  # the lock is not held; closing the descriptor below releases ours
    finally:
        os.close(fd)


def free_index(run_dir: Path) -> int:
    """The lowest index no live process holds and no earlier worker left files for."""
    index = 0
    while holder(run_dir, index) is not None or earlier_files(run_dir, index):
        index += 1
    return index


def in_use_message(run_dir: Path, index: int, pid: int) -> str:
    who = f"pid {pid}" if pid else "a process"
    return (f"worker index {index} of the run in {run_dir} is in use by a live worker ({who}); "
            f"join as a new worker with --index {free_index(run_dir)}, or stop that worker "
            f"before continuing it (--resume)")


def check_joinable(run_dir: Path, index: int, resume: bool) -> None:
    """What ``farlink join --index INDEX`` may take: not an index a live worker holds, and an
    index an earlier worker left metrics or checkpoints for only as that worker (``--resume``),
    so that a new worker never mixes its record and checkpoints into another one's."""
    if (pid := holder(run_dir, index)) is not None:
        raise IndexInUse(in_use_message(run_dir, index, pid))
    if not resume and (files := earlier_files(run_dir, index)):
        listed = ", ".join(str(p) for p in files)
        raise IndexInUse(
            f"worker index {index} of the run in {run_dir} has an earlier worker's files "
            f"({listed}); continue that worker with --resume, or join as a new worker with "
            f"--index {free_index(run_dir)}")


class IndexLock:
    """Holds worker ``index`` of ``run_dir`` until :meth:`release` (or the process ends).

    ``wait_s``: how long to wait for a holder to go away (a previous life of this worker that
    was just killed may still be exiting); then :class:`IndexInUse` says who holds it."""

    def __init__(self, run_dir: Path, index: int, wait_s: float = 0.0) -> None:
        path = lock_path(run_dir, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                os.close(self._fd)
                self._fd = None
                raise IndexInUse(in_use_message(run_dir, index, holder(run_dir, index) or 0))
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)  # named in a refusal

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
