"""A tiny TCP link probe, run inside two namespaces: round-trip time, then bulk throughput.

``server`` listens, echoes one-byte pings until the client announces bulk mode, then counts the
bytes that arrive in a fixed window after a warm-up (so TCP slow start does not count against
the link) and prints a JSON line. ``client`` connects, times the connect and each ping-pong,
streams zeros for the warm-up plus window plus a margin, and prints its JSON line. Only the
standard library, so it starts fast inside ``ip netns exec``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

from farlink.comm.sockets import recv_exact

LISTENING = "probe-listening"
PING, BULK = b"p", b"B"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    return recv_exact(sock, n, "peer closed during ping-pong")


def server(host: str, port: int, warmup_s: float, window_s: float) -> dict:
    listener = socket.create_server((host, port), reuse_port=False)
    print(LISTENING, flush=True)
    listener.settimeout(60)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = _recv_exact(conn, 1)
        if b == BULK:
            break
        conn.sendall(b)
    buf = bytearray(1 << 20)
    start = measure_from = measure_to = None
    counted = total = 0
    while True:
        n = conn.recv_into(buf)
        now = time.perf_counter()
        if not n:
            break
        total += n
        if start is None:
            start = now
            measure_from, measure_to = start + warmup_s, start + warmup_s + window_s
        elif measure_from <= now <= measure_to:
            counted += n
    conn.close()
    if start is None or time.perf_counter() < measure_to:  # type: ignore[operator]
        raise RuntimeError("the transfer ended before the measurement window closed")
    return {"bytes": counted, "seconds": window_s, "total_bytes": total,
            "throughput_mbit": counted * 8 / window_s / 1e6}


def client(host: str, port: int, seconds: float, pings: int) -> dict:
    t = time.perf_counter()
    sock = socket.create_connection((host, port), timeout=30)
    connect_ms = (time.perf_counter() - t) * 1000
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    samples = []
    for k in range(pings + 2):
        t = time.perf_counter()
        sock.sendall(PING)
        _recv_exact(sock, 1)
        if k >= 2:  # first exchanges warm up caches and the connection
            samples.append((time.perf_counter() - t) * 1000)
    sock.sendall(BULK)
    chunk = bytes(1 << 20)
    end = time.perf_counter() + seconds
    sent = 0
    while time.perf_counter() < end:
        sock.sendall(chunk)
        sent += len(chunk)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # wait for the server to close: everything arrived
    sock.close()
    return {"connect_ms": connect_ms, "rtt_ms": statistics.median(samples),
            "rtt_samples_ms": samples, "sent_bytes": sent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["server", "client"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--window", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--pings", type=int, default=10)
    args = parser.parse_args(argv)
    if args.role == "server":
        result = server(args.host, args.port, args.warmup, args.window)
    else:
        result = client(args.host, args.port, args.seconds, args.pings)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
