"""The job board and the policy publisher over a TCP socket: rollout workers as processes.

A worker process holds one connection to the trainer side's :class:`RolloutServer` and sees it
through :class:`RemoteBoard` and :class:`RemotePublisher`, which have the methods a
:class:`~farlink.rl.workers.RolloutWorker` and a :class:`~farlink.rl.broadcast.PolicyReplica`
call on the in-process ones, so the worker code is the same in a thread and in a process.

Frames are a JSON header plus raw bytes (policy deltas, snapshot blobs); nothing a worker sends
is unpickled or executed: a hand-in is JSON whose fields are checked into a
:class:`~farlink.rl.policy.Rollout`, and the trainer's admission and verification judge it
as they judge a thread's. A worker whose trainer goes away (killed, restarted) reconnects for
``reconnect_s`` seconds; a restarted trainer serves its checkpointed version and numbers jobs
after the ones it may have issued before, so late hand-ins expire unblamed.
"""

from __future__ import annotations

import json
import socket
import socketserver
import struct
import threading
import time

from farlink.comm.sockets import recv_exact
from farlink.rl.board import Job, RolloutBoard
from farlink.rl.broadcast import PolicyPublisher, Snapshot
from farlink.rl.policy import Fingerprint, Rollout
from farlink.rl.tasks import Problem

_HEAD = struct.Struct(">IQ")  # header length, body length
MAX_HEADER = 16 << 20  # a worker's hand-in is a few KiB; anything this large is not one
MAX_BODY = 1 << 34


def send_frame(sock: socket.socket, header: dict, body: bytes = b"") -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_HEAD.pack(len(data), len(body)) + data + body)


def recv_frame(sock: socket.socket, max_body: int = MAX_BODY) -> tuple[dict, bytes]:
    head, body_len = _HEAD.unpack(recv_exact(sock, _HEAD.size))
    if head > MAX_HEADER or body_len > max_body:
        raise ConnectionError(f"frame of {head} + {body_len} bytes is over the limit")
    header = json.loads(recv_exact(sock, head))
    if not isinstance(header, dict):
        raise ConnectionError("a frame's header is not a JSON object")
    return header, recv_exact(sock, body_len)


def rollout_to_json(r: Rollout) -> dict:
    return {"worker": r.worker, "job": r.job, "seed": r.seed, "version": r.version,
            "prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids,
            "logprobs": r.logprobs,
            "fingerprints": [[f.position, f.ids, f.values] for f in r.fingerprints],
            "precision": r.precision}


def _ints(value: object) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise ValueError("expected a list of integers")
    return value


def _floats(value: object) -> list[float]:
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) for v in value):
        raise ValueError("expected a list of numbers")
    return [float(v) for v in value]


def rollout_from_json(d: dict) -> Rollout:
    """A worker's claimed rollout, every field type-checked (ValueError when one is not)."""
    try:
        prints = [Fingerprint(int(p), _ints(ids), _floats(values))
                  for p, ids, values in d["fingerprints"]]
        return Rollout(str(d["worker"]), int(d["job"]), int(d["seed"]), int(d["version"]),
                       _ints(d["prompt_ids"]), _ints(d["completion_ids"]),
                       _floats(d["logprobs"]), prints, str(d.get("precision", "fp32")))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a rollout: {exc}") from exc


class RolloutServer:
    """Serves ``board`` and ``publisher`` to worker processes on ``(host, port)`` (port 0: any
    free one, see :attr:`address`); ``hello`` is what a new worker is told (model, config).

    :attr:`worker_hosts` keeps the address each named worker's requests came from: a worker
    behind a NAT shows up at its router's public address, and an operator can tell which
    workers share one."""

    def __init__(self, board: RolloutBoard, publisher: PolicyPublisher, hello: dict,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.board, self.publisher, self.hello = board, publisher, hello
        self._open: set[socket.socket] = set()  # workers' connections, cut at close()
        self._lock = threading.Lock()
        self.worker_hosts: dict[str, set[str]] = {}  # worker name -> hosts it connected from
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with server._lock:
                    server._open.add(self.request)
                try:
                    while True:
                        header, _ = recv_frame(self.request, max_body=0)
                        server._answer(self.request, header, self.client_address[0])
                except (ConnectionError, OSError, ValueError, KeyError, TypeError):
                    return  # a worker gone or talking nonsense: its connection ends
                finally:
                    with server._lock:
                        server._open.discard(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="rollout-server")
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    def close(self) -> None:
        """Stop serving and cut every worker's connection (as the trainer's end would)."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _answer(self, sock: socket.socket, header: dict, host: str) -> None:
        op = header.get("op")
        if op in ("job", "submit"):  # the requests that name their worker
            with self._lock:
                self.worker_hosts.setdefault(str(header["worker"]), set()).add(host)
        if op == "hello":
            send_frame(sock, self.hello)
        elif op == "job":
            job = self.board.request(str(header["worker"]))
            if job is None:
                send_frame(sock, {"job": None})
            else:
                send_frame(sock, {"job": job.job, "prompt": job.problem.prompt,
                                  "prompt_ids": job.prompt_ids, "seeds": job.seeds,
                                  "issued_version": job.issued_version})
        elif op == "version":
            send_frame(sock, {"version": self.publisher.version, "epoch": self.publisher.epoch})
        elif op == "deltas":
            update = self.publisher.deltas(int(header["since"]))
            if update is None:
                send_frame(sock, {"version": None})
                return
            version, chain = update
            names = [[[name, len(p)] for name, p in payloads.items()] for payloads in chain]
            send_frame(sock, {"version": version, "chain": names},
                       b"".join(p for payloads in chain for p in payloads.values()))
        elif op == "snapshot":
            snap = self.publisher.snapshot()
            send_frame(sock, {"version": snap.version, "sha256": snap.sha256,
                              "chunk_bytes": snap.chunk_bytes, "chunks": snap.chunks}, snap.blob)
        elif op == "submit":
            rollouts = [rollout_from_json(r) for r in header["rollouts"]]
            self.board.submit(str(header["worker"]), int(header["job"]), rollouts)
            send_frame(sock, {"ok": True})
        else:
            raise ValueError(f"unknown op {op!r}")


class Connection:
    """A worker's one connection to the trainer side, re-made for up to ``reconnect_s``
    seconds whenever it breaks (a request in flight is sent again on the new one)."""

    def __init__(self, host: str, port: int, reconnect_s: float = 60.0) -> None:
        self.host, self.port, self.reconnect_s = host, port, reconnect_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.reconnects = 0

    def call(self, header: dict) -> tuple[dict, bytes]:
        with self._lock:
            give_up = time.monotonic() + self.reconnect_s
            while True:
                try:
                    if self._sock is None:
                        self._sock = socket.create_connection((self.host, self.port), timeout=30)
                        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    send_frame(self._sock, header)
                    return recv_frame(self._sock)
                except OSError:  # ConnectionError is one
                    self.close()
                    if time.monotonic() > give_up:
                        raise
                    self.reconnects += 1
                    time.sleep(0.2)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class RemoteCodec:
    """What a worker needs of the text codec: the id that ends a completion."""

    def __init__(self, eot: int) -> None:
        self.eot = eot


class RemoteBoard:
    """The board as a worker process sees it (``request`` and ``submit``)."""

    def __init__(self, connection: Connection, eot: int) -> None:
        self.connection, self.codec = connection, RemoteCodec(eot)

    def request(self, worker: str) -> Job | None:
        reply, _ = self.connection.call({"op": "job", "worker": worker})
        if reply["job"] is None:
            return None
        # the answer stays on the trainer side: a worker is not told what would score
        return Job(reply["job"], worker, Problem(reply["prompt"], ""), reply["prompt_ids"],
                   reply["seeds"], reply["issued_version"])

    def submit(self, worker: str, job: int, rollouts: list[Rollout]) -> None:
        self.connection.call({"op": "submit", "worker": worker, "job": job,
                              "rollouts": [rollout_to_json(r) for r in rollouts]})


class RemotePublisher:
    """The publisher as a :class:`~farlink.rl.broadcast.PolicyReplica` in a worker process
    sees it (``epoch``, ``version``, ``deltas``, ``snapshot``); chunk digests are checked by the replica."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    @property
    def version(self) -> int:
        return self.connection.call({"op": "version"})[0]["version"]

    @property
    def epoch(self) -> int:
        return self.connection.call({"op": "version"})[0]["epoch"]

    def deltas(self, since: int) -> tuple[int, list[dict[str, bytes]]] | None:
        reply, body = self.connection.call({"op": "deltas", "since": since})
        if reply["version"] is None:
            return None
        chain, at = [], 0
        for names in reply["chain"]:
            payloads = {}
            for name, length in names:
                payloads[name] = body[at:at + length]
                at += length
            chain.append(payloads)
        return reply["version"], chain

    def snapshot(self) -> Snapshot:
        reply, body = self.connection.call({"op": "snapshot"})
        return Snapshot(reply["version"], body, reply["sha256"], reply["chunk_bytes"],
                        reply["chunks"])
