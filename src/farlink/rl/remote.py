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

Who a worker is: workers are untrusted volunteers, and the trainer bans the worker a bad group
names, so a name must not be claimable by anyone else. A worker process holds an Ed25519 key
and, on every new connection, signs a single-use challenge of the server's
(:class:`~farlink.robust.auth.OpenKeyAuth`); the connection is then bound to that key's id,
which is the worker's name for jobs, hand-ins, the ledger and bans. A ``job`` or ``submit`` frame
that names another worker, or comes before a proof, is refused and its connection cut (logged;
nobody is blamed). What is *not* proven: membership (anyone may make a key and join, so a banned
volunteer can come back under a new key: a ban is per key), the label a worker gives for logs,
and the link itself (no encryption: a hand-in can be read on the way, and a man in the middle
could relay a proof). Policy fetches (``hello``, ``version``, ``deltas``, ``snapshot``) need no
proof.

What a connection may hold: a frame must arrive in full within ``idle_s`` of the previous answer
(a client that sends nothing or half a frame is cut; an honest worker just reconnects on its next
call), each piece of an answer must leave within ``idle_s`` (a client that stops reading is cut),
and the server keeps at most ``max_connections`` open, ``max_per_host`` of them from one
address; one more is closed at once, with the reason logged.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

from farlink.comm.sockets import CHUNK, recv_exact
from farlink.rl.board import Job, RolloutBoard
from farlink.rl.broadcast import PolicyPublisher, Snapshot
from farlink.rl.policy import Fingerprint, Rollout
from farlink.rl.tasks import Problem
from farlink.robust.auth import AuthError, OpenKeyAuth

log = logging.getLogger(__name__)

_HEAD = struct.Struct(">IQ")  # header length, body length
MAX_HEADER = 16 << 20  # a worker's hand-in is a few KiB; anything this large is not one
MAX_BODY = 1 << 34
MAX_LABEL = 64  # characters of a worker's label kept for logs
#: what a worker's key proof is bound to, so a proof made for another farlink door is no use here
PROOF_CONTEXT = b"farlink rl-worker"


def send_frame(sock: socket.socket, header: dict, body: bytes = b"") -> None:
    """One frame; a large body goes in :data:`~farlink.comm.sockets.CHUNK` pieces, so a
    socket timeout bounds a stall (a reader that stops reading), not a slow link's whole send."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    data = _HEAD.pack(len(encoded), len(body)) + encoded
    if len(body) <= CHUNK:
        sock.sendall(data + body)
        return
    sock.sendall(data)
    view = memoryview(body)
    for at in range(0, len(body), CHUNK):
        sock.sendall(view[at:at + CHUNK])


def recv_frame(sock: socket.socket, max_body: int = MAX_BODY,
               timeout_s: float | None = None) -> tuple[dict, bytes]:
    """One frame; with ``timeout_s``, all of it must arrive within that many seconds (else
    TimeoutError), so a peer that sends nothing or half a frame cannot hold the reader."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    head, body_len = _HEAD.unpack(recv_exact(sock, _HEAD.size, deadline=deadline))
    if head > MAX_HEADER or body_len > max_body:
        raise ConnectionError(f"frame of {head} + {body_len} bytes is over the limit")
    header = json.loads(recv_exact(sock, head, deadline=deadline))
    if not isinstance(header, dict):
        raise ConnectionError("a frame's header is not a JSON object")
    return header, recv_exact(sock, body_len, deadline=deadline)


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

    ``authenticator`` issues and checks the workers' key proofs; ``idle_s``,
    ``max_connections`` and ``max_per_host`` bound what connections may hold (module docstring).

    :attr:`worker_hosts` keeps the address each worker's requests came from (by key id): a
    worker behind a NAT shows up at its router's public address, and an operator can tell which
    workers share one. :attr:`worker_labels` keeps the label each key id gave (for logs; not
    proven)."""

    def __init__(self, board: RolloutBoard, publisher: PolicyPublisher, hello: dict,
                 host: str = "127.0.0.1", port: int = 0, *, idle_s: float = 120.0,
                 max_connections: int = 256, max_per_host: int = 16,
                 authenticator: OpenKeyAuth | None = None) -> None:
        self.board, self.publisher, self.hello = board, publisher, hello
        self.idle_s, self.max_connections, self.max_per_host = idle_s, max_connections, max_per_host
        self.authenticator = authenticator or OpenKeyAuth()
        self._open: set[socket.socket] = set()  # workers' connections, cut at close()
        self._per_host: dict[str, int] = {}  # open connections by remote address
        self._lock = threading.Lock()
        self.worker_hosts: dict[str, set[str]] = {}  # worker key id -> hosts it connected from
        self.worker_labels: dict[str, str] = {}  # worker key id -> the label it gave
        #: (host, reason) of the latest refused connections and frames
        self.refused: deque[tuple[str, str]] = deque(maxlen=1024)
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with server._lock:
                    server._open.add(self.request)
                peer = _Peer(self.client_address[0])
                try:
                    while True:
                        header, _ = recv_frame(self.request, max_body=0, timeout_s=server.idle_s)
                        self.request.settimeout(server.idle_s)  # each piece of the answer
                        server._answer(self.request, header, peer)
                except (ConnectionError, OSError, ValueError, KeyError, TypeError):
                    return  # a worker gone, idle, refused or talking nonsense: its connection ends
                finally:
                    with server._lock:
                        server._open.discard(self.request)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

            def verify_request(self, request: socket.socket, client_address: tuple) -> bool:
                return server._admit(client_address[0])

            def process_request(self, request: socket.socket, client_address: tuple) -> None:
                try:
                    super().process_request(request, client_address)
                except BaseException:  # no thread started: it will not leave by itself
                    server._leave(client_address[0])
                    raise

            def process_request_thread(self, request: socket.socket,
                                       client_address: tuple) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    server._leave(client_address[0])

        self._server = Server((host, port), Handler)
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

    def _refuse(self, host: str, reason: str) -> None:
        log.warning("rollout server refused %s: %s", host, reason)
        with self._lock:
            self.refused.append((host, reason))

    def _admit(self, host: str) -> bool:
        """Whether a new connection from ``host`` fits under the caps (counted if it does)."""
        with self._lock:
            total, here = sum(self._per_host.values()), self._per_host.get(host, 0)
            if total < self.max_connections and here < self.max_per_host:
                self._per_host[host] = here + 1
                return True
        self._refuse(host, f"{total} connections open ({self.max_connections} at most), "
                     f"{here} from this host ({self.max_per_host} at most)")
        return False

    def _leave(self, host: str) -> None:
        with self._lock:
            self._per_host[host] -= 1
            if not self._per_host[host]:
                del self._per_host[host]

    def _answer(self, sock: socket.socket, header: dict, peer: _Peer) -> None:
        op = header.get("op")
        if op in ("job", "submit"):  # the requests that name their worker
            named = str(header["worker"])
            if named != peer.worker:
                reason = (f"a {op} naming worker {named!r} on a connection that proved "
                          + (repr(peer.worker) if peer.worker else "no key"))
                self._refuse(peer.host, reason)
                raise ValueError(reason)
            with self._lock:
                self.worker_hosts.setdefault(peer.worker, set()).add(peer.host)
        if op == "challenge":
            if peer.challenge is not None:  # one open challenge per connection
                self._refuse(peer.host, "a second challenge before a proof")
                raise ValueError("a second challenge before a proof")
            peer.challenge = self.authenticator.make_challenge()
            send_frame(sock, {"challenge": peer.challenge.hex()})
        elif op == "prove":
            challenge, peer.challenge = peer.challenge, None  # one proof per challenge
            try:
                if challenge is None:
                    raise AuthError("a proof before a challenge")
                worker = self.authenticator.check_proof(
                    challenge, bytes.fromhex(str(header["proof"])), PROOF_CONTEXT)
            except (AuthError, ValueError) as exc:
                self._refuse(peer.host, f"key proof: {exc}")
                raise
            peer.worker = worker
            with self._lock:
                self.worker_labels[worker] = str(header.get("label", ""))[:MAX_LABEL]
            send_frame(sock, {"worker": worker})
        elif op == "hello":
            send_frame(sock, self.hello)
        elif op == "job":
            job = self.board.request(peer.worker)
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
            self.board.submit(peer.worker, int(header["job"]), rollouts)
            send_frame(sock, {"ok": True})
        else:
            raise ValueError(f"unknown op {op!r}")


@dataclass
class _Peer:
    """One connection's side of the handshake: the challenge it was given, the key it proved."""

    host: str
    challenge: bytes | None = None
    worker: str | None = None  # the proven key id


class Connection:
    """A worker's one connection to the trainer side, re-made for up to ``reconnect_s``
    seconds whenever it breaks (a request in flight is sent again on the new one).

    With an ``identity`` (the worker's key), every new connection first proves the key (the
    server binds the connection to it), so the proof is redone after each reconnect; ``label``
    is the name the trainer's logs show beside the key id."""

    def __init__(self, host: str, port: int, reconnect_s: float = 60.0,
                 identity: OpenKeyAuth | None = None, label: str = "") -> None:
        self.host, self.port, self.reconnect_s = host, port, reconnect_s
        self.identity, self.label = identity, label
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.reconnects = 0
        self.proofs = 0  # handshakes done: one per connection made

    @property
    def worker(self) -> str:
        """The name the trainer knows this worker by: its key id."""
        if self.identity is None:
            raise ValueError("a connection without an identity names no worker")
        return self.identity.peer_id

    def call(self, header: dict) -> tuple[dict, bytes]:
        with self._lock:
            give_up = time.monotonic() + self.reconnect_s
            while True:
                try:
                    if self._sock is None:
                        self._sock = self._connect()
                    send_frame(self._sock, header)
                    return recv_frame(self._sock)
                except OSError:  # ConnectionError is one
                    self.close()
                    if time.monotonic() > give_up:
                        raise
                    self.reconnects += 1
                    time.sleep(0.2)

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=30)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.identity is not None:
                send_frame(sock, {"op": "challenge"})
                challenge = bytes.fromhex(recv_frame(sock)[0]["challenge"])
                send_frame(sock, {"op": "prove", "label": self.label,
                                  "proof": self.identity.prove(challenge, PROOF_CONTEXT).hex()})
                if recv_frame(sock)[0].get("worker") != self.identity.peer_id:
                    raise ConnectionError("the trainer did not bind this worker's key")
                self.proofs += 1
        except BaseException:
            sock.close()
            raise
        return sock

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
