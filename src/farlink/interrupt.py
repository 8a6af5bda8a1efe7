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


#: how often a long wait says what it is waiting for
WAIT_LOG_EVERY = 30.0


def wait_future(future, timeout: float, waiting_for, log, poll: float = 0.5,
                every: float = WAIT_LOG_EVERY):
    """``future.result(timeout)`` that a stop request ends: the result is waited for in slices
    of ``poll`` seconds, the stop flag checked between them, so Ctrl-C or SIGTERM end the wait
    within a slice (a worker only sets the flag, and a plain ``result(3600)`` would sleep
    through it). Every ``every`` seconds ``log`` gets a line saying what is awaited
    (``waiting_for()``: "a group of >= 4 peers for run X (2 in the swarm)"), so a wait that
    lasts is never silent.

    Raises KeyboardInterrupt, naming what was awaited, on a stop request, and TimeoutError
    when ``timeout`` passes; the caller cancels the future either way."""
    import time

    start = time.monotonic()
    said = start
    while True:
        if STOP.is_set():
            raise KeyboardInterrupt(f"interrupted while waiting for {waiting_for()}")
        now = time.monotonic()
        left = timeout - (now - start)
        if left <= 0:
            raise TimeoutError(f"no {waiting_for()} within {timeout:.0f} s")
        if now - said >= every:
            said = now
            log.warning("waiting for %s (%.0f s so far; Ctrl-C leaves)", waiting_for(),
                        now - start)
        try:
            return future.result(timeout=min(poll, left))
        except TimeoutError:
            if future.done():  # it failed with a TimeoutError of its own (or just finished)
                return future.result()
