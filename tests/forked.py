"""Real child processes without an interpreter's imports each: they fork from one server process
that has already imported torch and farlink's heavy modules.

For tests whose subject is a process (a signal it receives, a socket between processes) but not
a fresh interpreter: ``python -c`` pays torch's import (~2.5 s of CPU) for every child; a child
forked from the server pays it once per test process. What the child has to say comes back over
a pipe (``run_child``): its stdout is the server's, not the test's.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any

# imported once, in the server; every child starts with them loaded
PRELOAD = ["torch", "farlink.codecs.envelope", "farlink.robust.auth",
           "farlink.comm.hivemind_backend"]


def context() -> Any:
    """The forkserver context whose server preloads :data:`PRELOAD` (the server starts with the
    first child of this test process; a server already running keeps what it loaded)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(target: Callable[..., Any], send: Any, args: tuple) -> None:
    try:
        target(send, *args)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - said to the test, which fails with it
        send.send(("error", traceback.format_exc()))
        raise


def start_child(target: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """Start ``target(send, *args)`` in a forked child; ``(process, receiving end)``. The child
    sends what it has to say with ``send.send(...)``; an exception in it is sent as
    ``("error", traceback)``."""
    ctx = context()
    receive, send = ctx.Pipe(duplex=False)
    # not a daemon: a daemonic process may not start children (a hivemind DHT is one)
    process = ctx.Process(target=_child, args=(target, send, args))
    process.start()
    send.close()  # the child holds its own copy: the pipe ends when the child does
    return process, receive
