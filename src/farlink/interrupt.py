"""Ctrl-C and ``kill`` as a flag that long-running loops poll, not only an exception.

Python raises KeyboardInterrupt wherever the main thread happens to be; if that is a destructor
or a library's cleanup callback, the exception is printed and dropped and the loop runs on, so a
stop request can be lost. The handler here also sets a flag, which the loops check at safe points.
"""

from __future__ import annotations

import signal
import threading

STOP = threading.Event()


def _handler(signum: int, frame: object) -> None:
    STOP.set()
    raise KeyboardInterrupt(f"signal {signum}")


def install() -> None:
    """SIGINT and SIGTERM both stop the process in order (workers between steps, checkpoints
    kept, namespaces deleted). Call from the main thread."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)


def check() -> None:
    """Raise KeyboardInterrupt if a stop was requested (even if its exception was lost)."""
    if STOP.is_set():
        raise KeyboardInterrupt("stop requested")
