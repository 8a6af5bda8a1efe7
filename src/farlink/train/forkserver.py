"""Local workers forked from a process that has already imported torch, torchft and farlink.

A worker started as ``python -m farlink.worker ...`` spends 1-4 CPU-seconds importing before
it does any work; ``farlink train`` with 4 workers pays that 4 times over, on the cores the
workers are about to train on. Instead the launcher starts one fork server (the standard
library's ``multiprocessing`` "forkserver": a fresh interpreter that only imports
:mod:`farlink.train.worker_imports`, so no CUDA, no OpenMP thread pool and no process group
exists in it) and each worker is a fork of it that runs ``farlink.worker`` with the argv it
would have had (``runpy``, as ``python -m`` runs it). In a process that launches several runs (a
benchmark, a test session) the one fork server serves them all.

What a started worker sees is what ``subprocess.Popen`` gave it: its own session (Ctrl-C
reaches the launcher only), stdout and stderr appended to its log, the launcher's environment
plus the worker's entries, the launcher's working directory, and ``farlink.worker`` in its
command line (``ps``, ``pgrep -f farlink.worker``). The launcher holds a :class:`ForkedWorker`,
which answers as a ``Popen`` does (a negative return code names the signal that killed it).
One difference: what a library reads from the environment when it is imported comes from the
launcher's environment when the fork server started (numpy's OpenBLAS sizes its thread pool from
``OMP_NUM_THREADS`` then); torch's threads are the worker's own (it sets them from its config).

The fork server ends when the launcher does: it exits when its pipe from the launcher closes,
SIGKILL included; workers already started watch the launcher themselves (:mod:`farlink.lifeline`).
``FARLINK_WORKER_START=spawn`` starts every worker as its own interpreter, as before.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

START_ENV = "FARLINK_WORKER_START"
MODES = ("forkserver", "spawn")
PRELOAD = ["farlink.train.worker_imports"]  # named so: not "farlink.worker" in the server's argv


def worker_start() -> str:
    """How local workers start: ``forkserver`` (the default on Linux) or ``spawn``."""
    mode = os.environ.get(START_ENV, "forkserver" if sys.platform == "linux" else "spawn")
    if mode not in MODES:
        raise ValueError(f"{START_ENV}={mode!r}: set it to 'forkserver' (start workers from a "
                         "preloaded fork server, the default) or 'spawn' (a fresh interpreter "
                         "per worker)")
    return mode


_context: multiprocessing.context.BaseContext | None = None


def _forkserver() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _context = context
    return _context


class ForkedWorker:
    """A worker forked from the fork server, with the part of ``subprocess.Popen``'s interface
    the launcher and its callers use. The fork server, its parent, reaps it and passes on its
    exit status."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._process = process
        self.args = args
        self.pid: int = process.pid  # type: ignore[assignment]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_worker(command: list[str], env: dict[str, str], log: Path) -> ForkedWorker:
    """Fork the worker that ``command`` (``python -m farlink.worker ARGS``) would start, with
    exactly ``env`` as its environment, stdout and stderr appended to ``log``."""
    process = _forkserver().Process(target=_run_worker, args=(command, env, str(log)),
                                    name=" ".join(command[1:5]))
    process.start()
    return ForkedWorker(process, command)


def _run_worker(command: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: become what ``Popen(command, start_new_session=True)`` would have
    started, then run the worker; the interpreter's exit handlers run as at a normal exit."""
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    module = command.index("-m") + 1  # as ``python -m MODULE ARGS`` runs it
    sys.argv = [command[module], *command[module + 1:]]  # run_module puts the file first
    _set_command_line(command)
    try:
        runpy.run_module(command[module], run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()


def _set_command_line(words: list[str]) -> None:
    """Write ``words`` over this process's command line as ``/proc/PID/cmdline`` shows it (the
    fork server's, which is long enough for a worker's): ``ps`` then names the worker. The
    bytes that do not fit are cut; a failure leaves the fork server's command line."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        text = "\0".join(words).encode()[: end - start - 1]
        ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)
    except (OSError, ValueError, IndexError):
        pass
