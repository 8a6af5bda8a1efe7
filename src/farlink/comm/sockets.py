"""Plain TCP plumbing every socket speaker in farlink shares (gates, tunnels, link probes,
pipeline stages, the emulator's probes): addresses in, URLs out, exact reads. Standard library
only, so a probe started inside an emulated namespace stays light."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

CHUNK = 1 << 20  # the most one recv asks for


def parse_address(address: str) -> tuple[str, int]:
    """``http://host:port``, ``host:port`` or ``[v6]:port`` -> (host, port)."""
    parts = urlsplit(address if "//" in address else f"//{address}")
    if not parts.hostname or parts.port is None:
        raise ValueError(f"address {address!r} has no host:port")
    return parts.hostname, parts.port


def url_of(host: str, port: int) -> str:
    """The ``http://`` URL of ``host:port`` (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def recv_exact(sock: socket.socket, n: int, closed: str = "peer closed the connection mid-message",
               error: type[Exception] = ConnectionError, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from ``sock``; ``error(closed)`` when the other end closes first.
    With ``deadline`` (``time.monotonic()``), all of them must arrive before it (else
    TimeoutError), so a peer that sends a byte at a time cannot hold the reader either."""
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("message not received in time")
            sock.settimeout(left)
        chunk = sock.recv(min(CHUNK, n - len(data)))
        if not chunk:
            raise error(closed)
        data += chunk
    return bytes(data)
