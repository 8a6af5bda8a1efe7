"""What raw TCP achieves for one peer serving several at once over the emulated links.

A community round's all-gather is served by a reachable peer: every client-mode member asks it
for the payloads it lacks and it answers them all at once over its one uplink. Bytes over the
uplink's rate is the floor no protocol beats; this probe measures what plain TCP (the same
kernel, shaping, delays and NAT, none of libp2p) takes for the same bytes in the same pattern,
so a round can be compared with both.

``server`` accepts ``clients`` connections, then answers every request (an 8-byte count) with
that many bytes on the connection it came on. ``client`` connects once and, at agreed wall-clock
times (namespaces share the clock, so the clients ask together), asks for ``nbytes`` and times
the request to its last byte; the pause between requests leaves the connection idle as training
leaves it between rounds. Each prints one JSON line. Only the standard library, so it starts
fast inside ``ip netns exec``.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import threading
import time

from farlink.comm.sockets import recv_exact

LISTENING = "serve-probe-listening"
CHUNK = 1 << 16


def _recv(sock: socket.socket, n: int) -> bytes:
    return recv_exact(sock, n, "the other end closed the probe connection")


def server(host: str, port: int, clients: int) -> dict:
    listener = socket.create_server((host, port))
    print(LISTENING, flush=True)
    listener.settimeout(120)
    served: list[int] = []

    def answer(conn: socket.socket) -> None:
        zeros = bytes(CHUNK)
        with conn:
            while True:
                try:
                    (nbytes,) = struct.unpack("!Q", _recv(conn, 8))
                except ConnectionError:
                    return
                left = nbytes
                while left:
                    left -= conn.send(zeros[: min(CHUNK, left)])
                served.append(nbytes)

    threads = []
    for _ in range(clients):
        conn, _ = listener.accept()
        threads.append(threading.Thread(target=answer, args=(conn,), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    listener.close()
    return {"role": "server", "requests": len(served), "bytes": sum(served)}


def client(host: str, port: int, nbytes: int, start_at: float, repeats: int,
           period_s: float) -> dict:
    deadline = time.monotonic() + 60
    while True:  # the server may still be starting
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    seconds = []
    with sock:
        sock.settimeout(120)
        for i in range(repeats):
            time.sleep(max(0.0, start_at + i * period_s - time.time()))
            t0 = time.perf_counter()
            sock.sendall(struct.pack("!Q", nbytes))
            _recv(sock, nbytes)
            seconds.append(round(time.perf_counter() - t0, 4))
    return {"role": "client", "nbytes": nbytes, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m farlink.emulate.serve_probe")
    sub = parser.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--clients", type=int, required=True)
    c = sub.add_parser("client")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--nbytes", type=int, required=True)
    c.add_argument("--start-at", type=float, required=True, help="wall-clock time of request 1")
    c.add_argument("--repeats", type=int, default=4)
    c.add_argument("--period-s", type=float, default=5.0, help="request i at start + i*period")
    args = parser.parse_args(argv)
    if args.role == "server":
        out = server(args.host, args.port, args.clients)
    else:
        out = client(args.host, args.port, args.nbytes, args.start_at, args.repeats,
                     args.period_s)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
