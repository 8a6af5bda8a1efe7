"""Every port a torchft worker listens on, bound to the run's ``--host``, not to all interfaces.

Left to itself torchft opens four listeners per worker, three of them on every interface: the
ManagerServer (gRPC, ``[::]``), the checkpoint HTTP server (``::``, advertised under the machine's
hostname), the TCPStore of its replica group (``::``), and Gloo's pair listener (the address of
the machine's hostname, or ``GLOO_SOCKET_IFNAME``). A run on loopback (the default ``--host``)
would so be reachable from the whole network. Here each is bound to ``host``: a public run asks
for it by passing a public ``--host`` (the address its peers reach it at). docs/trust.md lists
every socket of a run and what guards it.

torchft builds the ManagerServer and the checkpoint server inside its own constructors from
module-level names, so those names are swapped (under a lock) for versions bound to ``host``
while the constructor runs; the servers never listen anywhere else, not even for an instant.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any

from torchft.checkpointing import HTTPTransport, http_transport

from farlink.comm.sockets import url_of

_SIOCGIFADDR = 0x8915
# torchft's module globals are swapped one caller at a time
_manager_lock, _http_lock = threading.Lock(), threading.Lock()


def _family(host: str) -> socket.AddressFamily:
    return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]


def _resolve(host: str) -> str:
    return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][4][0]


def interface_of(host: str) -> str | None:
    """The network interface whose (IPv4) address is ``host``, e.g. ``lo`` for 127.0.0.1."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
        if ipaddress.ip_address(raw[20:24]) == address:
            return name
    return None


def bind_gloo_to(host: str) -> None:
    """Gloo listens on the interface of ``GLOO_SOCKET_IFNAME``; point it at ``host``'s, unless
    the caller chose one already (an emulated WAN namespace names its veth)."""
    if "GLOO_SOCKET_IFNAME" not in os.environ and (name := interface_of(host)) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def store_listener(host: str, port: int = 0) -> int:
    """A listening socket on ``host`` (``port``; 0: a free one) for a master TCPStore
    (``master_listen_fd``): given a host alone, the store listens on every interface. The
    store owns the descriptor."""
    sock = socket.create_server((host, port), family=_family(host), backlog=128)
    return sock.detach()


@contextlib.contextmanager
def manager_bound_to(host: str) -> Iterator[None]:
    """While torchft's ``Manager`` is constructed, its ManagerServer binds ``host`` (same port
    choice: torchft's own, from ``TORCHFT_MANAGER_PORT`` or any free one)."""
    import torchft.manager as manager_module

    original = manager_module.ManagerServer

    address = _resolve(host)  # the gRPC server takes an IP address, not a host name

    def bound_server(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        where = f"[{address}]" if ":" in address else address
        return original(*args, bind=f"{where}:{port}", **kwargs)

    with _manager_lock:
        manager_module.ManagerServer = bound_server
        try:
            yield
        finally:
            manager_module.ManagerServer = original


def _http_server_on(host: str) -> type[ThreadingHTTPServer]:
    family = _family(host)

    class BoundHTTPServer(ThreadingHTTPServer):
        address_family = family

        def __init__(self, server_address: Any, handler: Any) -> None:
            super().__init__((host, 0), handler)

    return BoundHTTPServer


class HostHTTPTransport(HTTPTransport):
    """torchft's checkpoint transport with its server on ``bind_host`` only, advertised under
    that address (torchft advertises the machine's hostname, which peers may not resolve)."""

    def __init__(self, bind_host: str, timeout: timedelta, num_chunks: int = 0) -> None:
        self._bind_host = bind_host
        with _http_lock:
            saved = http_transport._IPv6HTTPServer
            http_transport._IPv6HTTPServer = _http_server_on(bind_host)
            try:
                super().__init__(timeout=timeout, num_chunks=num_chunks)
            finally:
                http_transport._IPv6HTTPServer = saved

    def address(self) -> str:
        return f"{url_of(self._bind_host, self._server.server_address[1])}/checkpoint/"

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        """A peer's checkpoint, unpickled with ``weights_only=True``: tensors, numbers, strings
        and containers only. torchft loads with ``weights_only=False`` (for lr schedulers'
        state), which runs whatever code the serving peer pickled; farlink's healing state is
        tensors and torchft's step counters, so nothing a peer serves ever runs here."""
        import urllib.request

        from torchft.checkpointing._serialization import _streaming_load

        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(f, weights_only=True)
