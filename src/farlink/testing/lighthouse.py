"""torchft's real Lighthouse, served by the calling process (``LighthouseServer``), as torchft's
own integration tests run it: no binary to start, no port to wait for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["lighthouse_server"]


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
