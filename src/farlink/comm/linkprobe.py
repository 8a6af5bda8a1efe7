"""Measure the links between peers with real TCP: round-trip time and throughput both ways.

Why: islands are formed from what the network delivers (:mod:`farlink.comm.islands`), so each pair
of peers is probed before training. One connection per pair:

* RTT: the median of small ping-pongs (TCP_NODELAY, after two warm-up exchanges);
* throughput: a bulk transfer of ``bulk_bytes`` each way, timed at the *receiver* from the first
  to the last byte (so neither the connection set-up nor the one-way delay counts against the
  rate), giving the up (client -> server) and down (server -> client) rates of the pair.

A :class:`ProbeServer` answers probes on one port; :func:`measure_links` probes every pair, in
rounds of disjoint pairs (a round-robin schedule) so that no peer's link carries two probes at once.
Only the standard library: it runs wherever a peer runs. On one machine the links are emulated by
:mod:`farlink.emulate.pairwise` (relays that shape each pair's traffic); the probe does not know.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from farlink.comm.sockets import recv_exact

PING, UPLOAD, DOWNLOAD, QUIT = b"p", b"U", b"D", b"q"
_LEN = struct.Struct("!Q")
_RATE = struct.Struct("!Qd")  # bytes counted after the first chunk, seconds first -> last
_CHUNK = 1 << 16

Address = tuple[str, int]


class ProbeError(RuntimeError):
    """A probe could not complete (peer unreachable, closed early, or timed out)."""


@dataclass(frozen=True)
class PairSample:
    """What one probe of a pair measured."""

    rtt_ms: float
    up_mbit: float  # client -> server
    down_mbit: float  # server -> client
    rtt_samples_ms: tuple[float, ...]


@dataclass
class LinkMatrix:
    """Measured links: ``[i][j]`` is the link from peer i to peer j (diagonal unused)."""

    bandwidth_mbit: list[list[float | None]]
    rtt_ms: list[list[float | None]]

    @classmethod
    def empty(cls, n: int) -> LinkMatrix:
        return cls([[None] * n for _ in range(n)], [[None] * n for _ in range(n)])

    def to_json(self) -> dict:
        def rounded(m: list[list[float | None]]) -> list[list[float | None]]:
            return [[None if v is None else round(v, 3) for v in row] for row in m]

        return {"bandwidth_mbit": rounded(self.bandwidth_mbit), "rtt_ms": rounded(self.rtt_ms)}

    @classmethod
    def from_json(cls, data: dict) -> LinkMatrix:
        """The form :meth:`to_json` writes (``bandwidth_mbit`` and ``rtt_ms``, n x n, null for
        an unmeasured pair); ``latency_ms`` (one way) may stand in for ``rtt_ms``. Any other
        key (``peers``: names in matrix order) is left to the caller."""
        if "rtt_ms" not in data and "latency_ms" in data:
            data = {**data, "rtt_ms": [[None if v is None else 2 * v for v in row]
                                       for row in data["latency_ms"]]}
        try:
            bandwidth, rtt = data["bandwidth_mbit"], data["rtt_ms"]
        except (KeyError, TypeError):
            raise ValueError("a link matrix needs 'bandwidth_mbit' (Mbit/s) and 'rtt_ms' (or "
                             "one-way 'latency_ms'): n x n lists, row i = links from peer i")
        n = len(bandwidth)
        for name, m in (("bandwidth_mbit", bandwidth), ("rtt_ms", rtt)):
            if len(m) != n or any(not isinstance(row, list) or len(row) != n for row in m):
                raise ValueError(f"link matrix {name!r} is not {n} x {n}: give one row per "
                                 "peer with one entry per peer (the diagonal is ignored)")
            for i, row in enumerate(m):
                for j, v in enumerate(row):
                    if i != j and v is not None and (not isinstance(v, (int, float)) or v < 0
                                                     or (name == "bandwidth_mbit" and v == 0)):
                        raise ValueError(f"link matrix {name}[{i}][{j}] = {v!r}: give a "
                                         "positive number, or null for an unmeasured pair")
        return cls([[None if v is None else float(v) for v in row] for row in bandwidth],
                   [[None if v is None else float(v) for v in row] for row in rtt])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    return recv_exact(sock, n, "peer closed the probe connection early", ProbeError)


def _sink(sock: socket.socket, nbytes: int) -> tuple[int, float]:
    """Receive exactly ``nbytes``; (bytes after the first chunk, seconds first -> last chunk)."""
    buf = bytearray(_CHUNK)
    got = counted = 0
    first = last = None
    while got < nbytes:
        n = sock.recv_into(buf, min(_CHUNK, nbytes - got))
        if not n:
            raise ProbeError("peer closed during a bulk transfer")
        last = time.perf_counter()
        if first is None:
            first = last
        else:
            counted += n
        got += n
    return counted, (last - first) if first is not None else 0.0


def _source(sock: socket.socket, nbytes: int) -> None:
    chunk = bytes(_CHUNK)
    left = nbytes
    while left > 0:
        n = min(left, _CHUNK)
        sock.sendall(chunk[:n])
        left -= n


def _rate_mbit(counted: int, seconds: float) -> float:
    # a transfer too fast to time (a single burst) is reported as "at least this fast"
    return counted * 8 / max(seconds, 1e-6) / 1e6


class ProbeServer:
    """Answers link probes on ``host:port`` (port 0 = any free port), one thread per connection."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> None:
        self._listener = socket.create_server((host, port))
        self.address: Address = self._listener.getsockname()[:2]
        self.timeout_s = timeout_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="probe-server")

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                op = conn.recv(1)
                if not op or op == QUIT:
                    return
                if op == PING:
                    conn.sendall(PING)
                elif op == UPLOAD:
                    (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
                    conn.sendall(_RATE.pack(*_sink(conn, n)))
                elif op == DOWNLOAD:
                    (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
                    _source(conn, n)
                else:
                    return  # not a probe: drop the connection
        except (OSError, ProbeError):
            return
        finally:
            conn.close()

    def close(self) -> None:
        self._closed.set()
        try:  # wakes the thread blocked in accept(); close() alone leaves the port listening
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def __enter__(self) -> ProbeServer:  # noqa: PYI034 - not meant to be subclassed
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe_pair(address: Address, pings: int = 5, bulk_bytes: int = 4 << 20,
               timeout_s: float = 60.0) -> PairSample:
    """Probe the peer answering at ``address``: RTT, then bulk up and bulk down."""
    if pings < 1 or bulk_bytes < 2 * _CHUNK:
        raise ValueError(f"need pings >= 1 and bulk_bytes >= {2 * _CHUNK}")
    try:
        sock = socket.create_connection(address, timeout=timeout_s)
    except OSError as exc:
        raise ProbeError(f"cannot reach probe server at {address[0]}:{address[1]}: {exc}") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for k in range(pings + 2):
            t = time.perf_counter()
            sock.sendall(PING)
            if _recv_exact(sock, 1) != PING:
                raise ProbeError("probe server answered a ping with something else")
            if k >= 2:  # the first exchanges warm up the path
                samples.append((time.perf_counter() - t) * 1000)
        sock.sendall(UPLOAD + _LEN.pack(bulk_bytes))
        _source(sock, bulk_bytes)
        counted, seconds = _RATE.unpack(_recv_exact(sock, _RATE.size))
        up = _rate_mbit(counted, seconds)
        sock.sendall(DOWNLOAD + _LEN.pack(bulk_bytes))
        down = _rate_mbit(*_sink(sock, bulk_bytes))
        sock.sendall(QUIT)
    except OSError as exc:
        raise ProbeError(f"probe of {address[0]}:{address[1]} failed: {exc}") from exc
    finally:
        sock.close()
    return PairSample(statistics.median(samples), up, down, tuple(samples))


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair once (the circle method)."""
    players = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for k in range(m // 2):
            a, b = players[k], players[m - 1 - k]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def measure_links(n: int, route: Callable[[int, int], Address], pings: int = 5,
                  bulk_bytes: int = 4 << 20, timeout_s: float = 60.0) -> LinkMatrix:
    """Probe every pair i < j at ``route(i, j)`` (where i reaches j's probe server).

    The probe's up rate fills ``[i][j]``, its down rate ``[j][i]``, the RTT both. A pair whose
    probe fails is left unmeasured (None) rather than guessed.
    """
    matrix = LinkMatrix.empty(n)
    if n < 2:
        return matrix

    def one(pair: tuple[int, int]) -> tuple[tuple[int, int], PairSample | None]:
        try:
            return pair, probe_pair(route(*pair), pings, bulk_bytes, timeout_s)
        except ProbeError:
            return pair, None

    with ThreadPoolExecutor(max_workers=max(1, n // 2)) as pool:
        for pairs in round_robin(n):
            for (i, j), sample in pool.map(one, pairs):
                if sample is None:
                    continue
                matrix.bandwidth_mbit[i][j] = sample.up_mbit
                matrix.bandwidth_mbit[j][i] = sample.down_mbit
                matrix.rtt_ms[i][j] = matrix.rtt_ms[j][i] = sample.rtt_ms
    return matrix
