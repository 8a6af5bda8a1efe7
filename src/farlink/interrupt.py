"""Ctrl-C and ``kill`` as a flag that long-running loops poll, and optionally an exception.

Python raises KeyboardInterrupt wherever the main thread happens to be; if that is a destructor
or a library's cleanup callback, the exception is printed and dropped and the loop runs on, so a
stop request can be lost. The handler here always sets a flag, which the loops check at safe
points. The CLI also raises at once (a user waiting on a command wants it back now); a training
worker only sets the flag, so it is never interrupted mid-update and stops between steps.
"""

from __future__ import annotations

import signal
import threading

STOP = threading.Event()


def _flag(signum: int, frame: object) -> None:
    STOP.set()


def _flag_and_raise(signum: int, frame: object) -> None:
    STOP.set()
    raise KeyboardInterrupt(f"signal {signum}")


def install(raise_now: bool = True) -> None:
    """SIGINT and SIGTERM both stop the process in order (workers between steps, checkpoints
    kept, namespaces deleted). Call from the main thread."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _flag_and_raise if raise_now else _flag)


def requested() -> bool:
    return STOP.is_set()


def check() -> None:
    """Raise KeyboardInterrupt if a stop was requested (even if its exception was lost)."""
    if STOP.is_set():
        raise KeyboardInterrupt("stop requested")
