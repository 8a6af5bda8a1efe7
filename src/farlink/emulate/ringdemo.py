"""A small ring exchange over real TCP, to show programs talking across an emulated WAN.

Worker ``i`` listens on its emulated address (``FARLINK_EMULATED_HOST``), connects to worker
``i+1``, and sends it ``nbytes`` of a pattern derived from ``i`` while receiving the same amount
from worker ``i-1``, which it verifies. It prints one JSON line: connect time, transfer time,
bytes received, whether they matched. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import threading
import time

CHUNK = 1 << 16


def pattern(index: int, nbytes: int) -> bytes:
    seed = hashlib.sha256(f"farlink-ring-{index}".encode()).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def run(index: int, peers: list[str], port: int, nbytes: int, timeout_s: float) -> dict:
    me = os.environ.get("FARLINK_EMULATED_HOST", peers[index])
    n = len(peers)
    listener = socket.create_server((me, port))
    listener.settimeout(timeout_s)
    received = bytearray()

    def receive() -> None:
        conn, _ = listener.accept()
        while len(received) < nbytes:
            chunk = conn.recv(CHUNK)
            if not chunk:
                break
            received.extend(chunk)
        conn.close()

    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    target = (peers[(index + 1) % n], port)
    deadline = time.monotonic() + timeout_s
    while True:
        t0 = time.perf_counter()
        try:
            out = socket.create_connection(target, timeout=timeout_s)
            break
        except ConnectionRefusedError:  # the next worker is not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    connect_ms = (time.perf_counter() - t0) * 1000
    start = time.perf_counter()
    out.sendall(pattern(index, nbytes))
    out.shutdown(socket.SHUT_WR)
    reader.join(timeout_s)
    seconds = time.perf_counter() - start
    out.close()
    ok = bytes(received) == pattern((index - 1) % n, nbytes)
    return {"index": index, "address": me, "connect_ms": connect_ms, "seconds": seconds,
            "received": len(received), "ok": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--peers", required=True, help="comma-separated worker addresses")
    parser.add_argument("--port", type=int, default=47000)
    parser.add_argument("--nbytes", type=int, default=1 << 20)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    peers = args.peers.split(",")
    if not 0 <= args.index < len(peers):
        parser.error(f"--index {args.index} outside the {len(peers)} peers")
    result = run(args.index, peers, args.port, args.nbytes, args.timeout)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
