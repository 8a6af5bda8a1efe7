"""Child processes that do not outlive the ``farlink train`` that started them.

A launcher killed with SIGKILL (a closed terminal, the OOM killer) runs no cleanup, so the
Lighthouse and the workers must notice on their own that it is gone, or they run forever: the
workers waiting for quorums, the Lighthouse holding its port.

* The Lighthouse is a Rust binary, so the kernel tells it: :func:`popen_tied` starts it with
  ``PR_SET_PDEATHSIG`` (SIGTERM), which survives ``execve``. The kernel sends that signal when
  the *thread* that forked the child exits, not the process, so a child started from a
  short-lived thread (a restart helper, a test's thread) would be killed with that thread.
  :func:`popen_tied` therefore forks from the main thread or from one spawner thread that lives
  as long as the process. A parent that died between ``fork`` and ``prctl`` would never send
  the signal, so the child checks its parent is still the one that forked it.
* The hivemind bootstrap peer that ``farlink train`` starts is a DHT process *forked* from the
  launcher (no ``exec``): :func:`tie_forked_child` sets the same signal from inside it, and on
  that signal it stops its own children (hivemind's p2pd) before it exits, as nothing else will.
* A worker watches for itself (:func:`watch_parent`): a thread waits on a pidfd of the
  launcher, whose pid the launcher passes in ``FARLINK_PARENT_PID``; a pidfd becomes readable
  only when the whole process has exited, so the thread pitfall does not apply. On its death
  the worker asks its loop to stop at the next step boundary, as on SIGTERM: its last
  checkpoint (written after every committed round) is what ``--resume`` continues from. A
  worker stuck where it cannot stop (waiting for a quorum from the Lighthouse that died with
  the launcher) exits hard after a short grace; it loses only uncommitted inner steps.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from farlink import interrupt

log = logging.getLogger(__name__)

PARENT_ENV = "FARLINK_PARENT_PID"
ORPHANED_EXIT = 75  # a worker whose launcher died: stopped, resumable (EX_TEMPFAIL)
_PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _die_with(parent: int) -> None:
    """In the forked child, before ``exec``: SIGTERM when the forking thread dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def popen_tied(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **kwargs)`` whose child gets SIGTERM when this process dies."""
    if sys.platform != "linux":  # PR_SET_PDEATHSIG is Linux's
        return subprocess.Popen(argv, **kwargs)
    parent = os.getpid()

    def start() -> subprocess.Popen:
        return subprocess.Popen(argv, preexec_fn=lambda: _die_with(parent), **kwargs)

    if threading.current_thread() is threading.main_thread():
        return start()
    global _spawner
    with _spawner_lock:  # one long-lived forking thread: see the module docstring
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="farlink-spawner")
    return _spawner.submit(start).result()


def tie_forked_child(parent: int) -> None:
    """Call first thing in a child forked (not exec'd) by ``parent`` from its main thread: on
    the parent's death, end its whole subtree (a DHT process's p2pd too), then exit."""
    if sys.platform != "linux":
        return

    def stop(signum: int, frame: object) -> None:
        end_descendants(wait_s=1.0)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    _die_with(parent)


def end_descendants(wait_s: float = 2.0) -> None:
    """SIGTERM every process below this one (children first found, then theirs), and SIGKILL
    those still there after ``wait_s``: what a process about to ``os._exit`` owes its subtree."""
    found, frontier = [], [os.getpid()]
    while frontier:
        children = [c for pid in frontier for c in _children(pid)]
        found += children
        frontier = children
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(process_running(pid) for pid in found):
        time.sleep(0.05)
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def process_running(pid: int) -> bool:
    """Exists and is not a zombie (an orphan's exit is reaped by init, maybe later)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return found


def child_env() -> dict[str, str]:
    """Environment entries that let a worker started now watch this process."""
    return {PARENT_ENV: str(os.getpid())}


def watch_parent(grace: float = 10.0) -> threading.Thread | None:
    """Stop this worker when the launcher named in ``FARLINK_PARENT_PID`` dies (see above).

    Nothing to watch without that variable (a worker started by hand or by ``farlink join``).
    """
    raw = os.environ.get(PARENT_ENV)
    if not raw:
        return None
    parent = int(raw)

    def watch() -> None:
        _wait_for_exit(parent)
        print(f"farlink train (pid {parent}) is gone: stopping at the next step boundary; "
              "continue with `farlink train --resume`", file=sys.stderr, flush=True)
        interrupt.STOP.set()
        time.sleep(grace)
        print(f"still running {grace:g} s after the launcher died (blocked in a round?): "
              "exiting; the last checkpoint is kept", file=sys.stderr, flush=True)
        end_descendants()  # os._exit runs no cleanup: a DHT process and its p2pd would stay
        os._exit(ORPHANED_EXIT)

    thread = threading.Thread(target=watch, name="farlink-lifeline", daemon=True)
    thread.start()
    return thread


def _wait_for_exit(pid: int, interval: float = 0.5) -> None:
    """Block until process ``pid`` has exited.

    A pidfd names the process itself, so neither a reused pid nor a process in between (``ip
    netns exec``, ``sudo``) confuses it; where there is none, poll the parent pid instead.
    """
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone before this process looked
    except (AttributeError, OSError):  # no pidfd (old kernel, not Linux)
        while os.getppid() == pid:
            time.sleep(interval)
        return
    try:
        select.select([handle], [], [])  # readable once the process has exited
    finally:
        os.close(handle)
