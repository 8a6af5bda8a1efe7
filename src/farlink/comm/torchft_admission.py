"""torchft's healing transfer behind the admission gate: state goes to members only.

torchft heals a replica that is behind by having it GET the live peer's state from that peer's
checkpoint HTTP server (``HTTPTransport``), which answers anyone who reaches it (without
``--auth`` farlink binds it to ``--host``: :mod:`farlink.comm.torchft_listeners`). With
``--auth`` farlink replaces it with :class:`GatedHTTPTransport`: the same server and request
handler, bound to loopback, behind a :class:`~farlink.robust.gate.Gate` on the advertised host;
the healing side fetches through a :class:`~farlink.robust.gate.Tunnel`, so it must prove
membership before a byte of state is sent. Knowing the address (torchft's ManagerServer tells it
to anyone who asks) is therefore of no use to a non-member.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from farlink.comm.torchft_listeners import HostHTTPTransport
from farlink.robust.auth import Authenticator
from farlink.comm.sockets import parse_address
from farlink.robust.gate import Gate, open_tunnel

log = logging.getLogger(__name__)


class GatedHTTPTransport(HostHTTPTransport):
    """torchft's checkpoint transport, reachable only through a membership-proving gate: its
    server listens on loopback only (from the start), the gate on the advertised host."""

    def __init__(self, auth: Authenticator, host: str, timeout: timedelta,
                 num_chunks: int = 0) -> None:
        super().__init__("127.0.0.1", timeout, num_chunks)
        self._auth = auth
        self._fetch_timeout = timeout.total_seconds()
        self._gate = Gate(auth, ("127.0.0.1", self._server.server_address[1]), host,
                          name="checkpoint server").start()

    def address(self) -> str:
        gate: Gate | None = getattr(self, "_gate", None)
        if gate is None:  # torchft's constructor logs its address before the gate exists
            return super().address()
        return f"{gate.url}/checkpoint/"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> Any:
        """Fetch through a tunnel that proves membership to the source's gate first."""
        base = metadata.split("/checkpoint/", 1)[0]
        parse_address(base)  # a malformed address fails here, with its text in the message
        with open_tunnel(base, self._auth, name="checkpoint server",
                         timeout=min(self._fetch_timeout, 30.0)) as tunnel:
            return super().recv_checkpoint(src_rank, f"{tunnel.url}/checkpoint/", step, timeout)

    def shutdown(self, wait: bool = True) -> None:
        self._gate.close()
        super().shutdown(wait=wait)
