"""torchft's real Lighthouse, served by the calling process (``LighthouseServer``), as torchft's
own integration tests run it: no binary to start, no port to wait for; and replicas as threads
against it over real Gloo."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["lighthouse_server", "torchft_replicas"]

T = TypeVar("T")


@contextmanager
def lighthouse_server(min_replicas: int, join_timeout_s: float = 10.0,
                      heartbeat_timeout_s: float = 5.0) -> Iterator[str]:
    """A Lighthouse on a free loopback port for the ``with`` block; yields its address."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas,
                              join_timeout_ms=int(join_timeout_s * 1000),
                              heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    try:
        yield server.address()
    finally:
        server.shutdown()


def torchft_replicas(count: int, body: Callable[[int, object], T], min_replicas: int | None = None,
                     timeout: float = 180.0, **options: object) -> dict[int, T]:
    """``body(index, collective)`` for ``count`` replicas at once, each a thread with its own
    :class:`~farlink.comm.torchft_backend.TorchftCollective` (named ``r<index>``, an empty
    state registered, ``options`` passed on) against one in-process Lighthouse; their results
    by index. Every replica heartbeats before any asks for a quorum (the launcher's start
    line: otherwise the first one up commits its first rounds alone). A collective is closed
    when its body returns or raises; the first error is re-raised here."""
    import threading

    import torch

    from farlink.comm.torchft_backend import TorchftCollective
    from farlink.testing.threads import in_threads

    quorum = min_replicas or count
    options = {"round_timeout": 15.0, "join_timeout": 5.0, **options}
    started = threading.Barrier(count)

    with lighthouse_server(quorum, join_timeout_s=5.0, heartbeat_timeout_s=2.0) as address:
        def replica(index: int, _member: object) -> T:
            try:
                coll = TorchftCollective(f"r{index}", address, min_replicas=quorum, **options)
            except BaseException:
                started.abort()  # the others stop waiting for a replica that will not come
                raise
            coll.register_state(lambda: {"x": torch.zeros(1)}, lambda s: None)
            try:
                started.wait(60)
                return body(index, coll)
            finally:
                coll.close()

        return in_threads(replica, dict.fromkeys(range(count)), timeout=timeout)
