"""Admission gate: a TCP relay that lets a connection through only after a membership proof.

torchft's Lighthouse and its checkpoint server accept anyone who can reach their port. With
``--auth`` set, the service listens on loopback only and a :class:`Gate` listens on the advertised
address in front of it: every connection must first answer a fresh challenge with the run's
authenticator (:mod:`farlink.robust.auth`); only then are bytes relayed, unchanged, both ways.
Nothing reaches the service before the proof verifies. A :class:`Tunnel` is the member's side: a
loopback port that performs the handshake for every connection an unmodified client (torchft's
Manager, urllib) opens through it, so those clients only need a different address.

Wire format before relaying (integers little-endian)::

    gate -> peer   b"FLG1" u16 length, challenge         (Authenticator.make_challenge)
    peer -> gate   b"FLP1" u16 length, proof             (Authenticator.prove)
    gate -> peer   b"FLA1" u8 verdict, u16 length, text  (1 admitted: the peer id;
                                                          0 refused: the reason;
                                                          2 admitted, but the service is down)

A handshake must complete within ``handshake_timeout`` seconds (5 s: a member needs one round
trip) and a proof has at most ``MAX_PROOF`` bytes, so garbage, a truncated proof or a connection
that never answers is closed after a bounded time, and every refusal is logged with its reason.
Load never refuses anyone: one source address holds at most ``max_pending_per_source`` pending
handshakes and the gate at most ``max_pending``; a newcomer over either limit takes the place of
the *oldest* pending handshake (of its own address, else of the address holding the most), so
idle connections cannot lock a member out, whose handshake takes one round trip. Log lines are
rate-limited per kind, so a flood does not fill the disk (the count of the lines left out is
logged). The gate does not authenticate itself to the peer and does not encrypt
the bytes it relays (see docs/trust.md).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Self

from farlink.comm.sockets import parse_address, url_of
from farlink.robust.auth import Authenticator, AuthError

log = logging.getLogger(__name__)

CHALLENGE_TAG, PROOF_TAG, VERDICT_TAG = b"FLG1", b"FLP1", b"FLA1"
MAX_CHALLENGE = 256
MAX_PROOF = 1024
MAX_TEXT = 1024
REFUSED, ADMITTED, UNAVAILABLE = 0, 1, 2
_CHUNK = 1 << 16

FIX = ("Fix: wrong run secret / key not in --allowed-keys: use the run's secret (--secret or "
       "FARLINK_SECRET) with --auth secret, or with --auth ed25519 a --key-file whose public key "
       "is listed in the run's --allowed-keys.")


class AdmissionError(ConnectionError):
    """This peer could not get through a farlink gate; the message says why and what to do."""


class GateRefused(AdmissionError):
    """The gate checked this peer's membership proof and refused it."""


class GateUnreachable(AdmissionError):
    """Nothing answered as a farlink gate at the address (down, wrong address, or no gate)."""


class ProtocolError(ValueError):
    """Bytes that are not the gate's handshake (garbage, another protocol, a bad length)."""


# --- framing -------------------------------------------------------------------------------------
def frame(tag: bytes, body: bytes) -> bytes:
    return tag + struct.pack("<H", len(body)) + body


async def read_frame(reader: asyncio.StreamReader, tag: bytes, limit: int,
                     read_tag: bytes | None = None) -> bytes:
    """One frame; ``read_tag``: its tag was already read (by a caller that tells frames apart)."""
    head = (read_tag or b"") + await reader.readexactly(len(tag) + 2 - len(read_tag or b""))
    return await reader.readexactly(frame_length(head, tag, limit))


def frame_length(head: bytes, tag: bytes, limit: int) -> int:
    """The body length a frame's head (tag + 2-byte length) announces; ProtocolError for a head
    of another protocol or a body over ``limit``, before any of the body is read."""
    if head[: len(tag)] != tag:
        raise ProtocolError(f"not a farlink handshake: expected {tag.decode()}, got "
                            f"{head[: len(tag)]!r}")
    (n,) = struct.unpack("<H", head[len(tag):])
    if n > limit:
        raise ProtocolError(f"{tag.decode()} frame announces {n} bytes, over the {limit}-byte "
                            "limit")
    return n


def verdict(code: int, text: str) -> bytes:
    raw = text.encode()[:MAX_TEXT]
    return VERDICT_TAG + struct.pack("<BH", code, len(raw)) + raw


async def read_verdict(reader: asyncio.StreamReader,
                       read_tag: bytes | None = None) -> tuple[int, str]:
    head = (read_tag or b"") + await reader.readexactly(
        len(VERDICT_TAG) + 3 - len(read_tag or b""))
    if head[: len(VERDICT_TAG)] != VERDICT_TAG:
        raise ProtocolError(f"not a farlink gate verdict: {head[:4]!r}")
    code, n = struct.unpack("<BH", head[len(VERDICT_TAG):])
    if n > MAX_TEXT:
        raise ProtocolError(f"verdict text of {n} bytes")
    return code, (await reader.readexactly(n)).decode(errors="replace")


async def relay(a_reader: asyncio.StreamReader, a_writer: asyncio.StreamWriter,
                b_reader: asyncio.StreamReader, b_writer: asyncio.StreamWriter) -> None:
    """Copy bytes both ways until either side closes or fails, then close both.

    Closing both at the first end is enough for the protocols relayed here (HTTP/2 gRPC, one
    HTTP request per connection): neither half-closes and then waits for an answer.
    """
    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()

    tasks = [asyncio.ensure_future(pipe(a_reader, b_writer)),
             asyncio.ensure_future(pipe(b_reader, a_writer))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in (a_writer, b_writer):
            writer.close()


class LogLimiter:
    """At most ``burst`` lines of one kind per ``window`` seconds; then one line says how many
    were left out. A flood of refusals or failed connections costs bytes, not the disk.

    ``clock`` (seconds, monotonic) is what the windows are measured on: a test that must see a
    window end passes its own instead of waiting one out."""

    def __init__(self, burst: int = 20, window: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.window, self.clock = burst, window, clock
        self._state: dict[str, list[float | int]] = {}  # kind -> [window start, lines, skipped]

    def admit(self, kind: str) -> tuple[bool, int]:
        """(write this line?, lines of this kind left out since the last one written)."""
        now = self.clock()
        state = self._state.setdefault(kind, [now, 0, 0])
        if now - state[0] >= self.window:
            state[0], state[1] = now, 0
        if state[1] >= self.burst:
            state[2] += 1
            return False, 0
        skipped, state[2] = int(state[2]), 0
        state[1] += 1
        return True, skipped


def _source(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("peername")
    return str(name[0]) if isinstance(name, tuple) else str(name)


def _peername(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("peername")
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name)


class _LoopThread:
    """An asyncio loop on a daemon thread, so blocking callers (the launcher, a worker) can own
    a server without becoming async themselves."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(cancel_all(), timeout=5)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.debug("gate loop shutdown: %r", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class _LoopServer:
    """A TCP server on its own event-loop thread: what the gate and the tunnel share (start in
    the subclass, close and the context manager here)."""

    _runner: _LoopThread | None = None
    _server: asyncio.AbstractServer | None = None

    def start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        if self._runner is None:
            return
        if self._server is not None:
            self._runner.loop.call_soon_threadsafe(self._server.close)
        self._runner.stop()
        self._runner = None

    def __enter__(self) -> Self:
        return self if self._runner is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class Gate(_LoopServer):
    """Listens on ``host:port``; relays an admitted connection to ``upstream`` (loopback).

    ``events`` keeps the last 1000 admissions, refusals and evictions as ``(kind, peer address,
    detail)``; with ``log_path`` they are also appended to that file, and refusals go to the log
    as warnings, both rate-limited by ``log_limit`` (by default a :class:`LogLimiter` of 20
    lines per 10 s).
    """

    def __init__(
        self,
        auth: Authenticator,
        upstream: tuple[str, int],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "service",
        handshake_timeout: float = 5.0,
        connect_timeout: float = 10.0,
        max_pending: int = 64,
        max_pending_per_source: int = 4,
        log_path: Path | None = None,
        log_limit: LogLimiter | None = None,
    ) -> None:
        if max_pending < 1 or max_pending_per_source < 1:
            raise ValueError("max_pending and max_pending_per_source must be >= 1")
        max_pending_per_source = min(max_pending_per_source, max_pending)
        self.auth, self.upstream = auth, upstream
        self.host, self.port, self.name = host, port, name
        self.handshake_timeout, self.connect_timeout = handshake_timeout, connect_timeout
        self.max_pending, self.max_pending_per_source = max_pending, max_pending_per_source
        self.log_path = log_path
        self.events: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=1000)
        # source address -> its pending handshakes (task -> peer name), oldest first
        self._pending: dict[str, dict[asyncio.Task, str]] = {}
        self._log_limit = log_limit or LogLimiter()
        self._runner: _LoopThread | None = None
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return url_of(self.host, self.port)

    @property
    def refusals(self) -> list[tuple[str, str]]:
        return [(peer, detail) for kind, peer, detail in self.events if kind == "refused"]

    @property
    def admitted(self) -> list[str]:
        return [detail for kind, _, detail in self.events if kind == "admitted"]

    def start(self) -> Gate:
        self._runner = _LoopThread(f"gate-{self.name}")
        try:
            self._server = self._runner.call(
                asyncio.start_server(self._serve, self.host, self.port), timeout=10)
        except BaseException:
            self._runner.stop()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("%s gate on %s -> %s:%d", self.name, self.url, *self.upstream)
        return self

    def _record(self, kind: str, peer: str, detail: str) -> None:
        self.events.append((kind, peer, detail))
        write, skipped = self._log_limit.admit(kind)
        if not write:
            return
        line = f"{self.name} gate {kind} {peer}: {detail}"
        if skipped:
            line += f" ({skipped} more {kind} lines left out in the last " \
                    f"{self._log_limit.window:g} s)"
        if kind == "refused":
            log.warning("%s", line)
        else:
            log.info("%s", line)
        if self.log_path is not None:
            try:
                with open(self.log_path, "a") as fh:
                    fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
            except OSError as exc:
                log.debug("cannot write %s: %s", self.log_path, exc)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._admit(reader, writer)
        except asyncio.CancelledError:  # the gate is closing; asyncio would log it as an error
            writer.close()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer, source = _peername(writer), _source(writer)
        task = asyncio.current_task()
        queue = self._pending.setdefault(source, {})
        queue[task] = peer
        self._make_room(source)
        try:
            peer_id, reason = await self._check(reader, writer)
        finally:
            queue.pop(task, None)
            if not queue and self._pending.get(source) is queue:
                del self._pending[source]
        if peer_id is None:
            await self._refuse(writer, peer, reason)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), self.connect_timeout)
        except (OSError, TimeoutError) as exc:
            self._record("unavailable", peer, f"{peer_id}: {self.name} at "
                         f"{self.upstream[0]}:{self.upstream[1]} unreachable ({exc!r})")
            await self._send_and_close(writer, verdict(
                UNAVAILABLE, f"the {self.name} behind the gate is unreachable"))
            return
        self._record("admitted", peer, peer_id)
        writer.write(verdict(ADMITTED, peer_id))
        await relay(reader, writer, up_reader, up_writer)

    def _make_room(self, source: str) -> None:
        """Drop the oldest pending handshakes over the per-source and overall limits (see the
        module docstring): a newcomer is never the one turned away."""
        def evict(address: str) -> None:
            task, peer = next(iter(self._pending[address].items()))
            del self._pending[address][task]
            task.cancel()
            self._record("dropped", peer, f"pending handshake closed to make room ({address} "
                         f"holds the most; limits {self.max_pending_per_source} per address, "
                         f"{self.max_pending} in all)")

        while len(self._pending[source]) > self.max_pending_per_source:
            evict(source)
        while sum(map(len, self._pending.values())) > self.max_pending:
            # the address holding the most; on a tie not the newcomer's own
            evict(max(self._pending, key=lambda a: (len(self._pending[a]), a != source)))

    async def _check(self, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> tuple[str | None, str]:
        """(peer id, "") when the proof verifies, else (None, why not)."""
        challenge = self.auth.make_challenge()

        async def exchange() -> bytes:
            writer.write(frame(CHALLENGE_TAG, challenge))
            await writer.drain()
            return await read_frame(reader, PROOF_TAG, MAX_PROOF)

        try:
            proof = await asyncio.wait_for(exchange(), self.handshake_timeout)
            return self.auth.check_proof(challenge, proof), ""
        except TimeoutError:
            return None, f"no complete membership proof within {self.handshake_timeout:g} s"
        except asyncio.IncompleteReadError as exc:
            return None, (f"connection closed mid-handshake after {len(exc.partial)} of "
                          f"{exc.expected} expected bytes (truncated proof)")
        except (AuthError, ProtocolError) as exc:
            return None, str(exc)
        except OSError as exc:
            return None, f"connection failed during the handshake: {exc!r}"

    async def _refuse(self, writer: asyncio.StreamWriter, peer: str, reason: str) -> None:
        self._record("refused", peer, reason)
        await self._send_and_close(writer, verdict(REFUSED, reason))

    @staticmethod
    async def _send_and_close(writer: asyncio.StreamWriter, data: bytes) -> None:
        try:
            writer.write(data)
            await asyncio.wait_for(writer.drain(), 2.0)
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()


class Tunnel(_LoopServer):
    """A loopback port whose every connection is handshaken with the gate at ``remote`` and then
    relayed to it. :meth:`start` first proves membership once, synchronously, so a refused peer
    fails at once with :class:`GateRefused` instead of its client retrying until a timeout.

    A later refusal (the run's keys changed, the gate restarted with another secret) is kept in
    ``failure`` for the owner to report; the log line of each failed connection is rate-limited
    by ``log_limit`` (by default a :class:`LogLimiter` of 20 lines per 10 s).
    """

    def __init__(
        self,
        auth: Authenticator,
        remote: tuple[str, int],
        *,
        name: str = "service",
        handshake_timeout: float = 10.0,
        connect_timeout: float = 10.0,
        log_limit: LogLimiter | None = None,
    ) -> None:
        self.auth, self.remote, self.name = auth, remote, name
        self.handshake_timeout, self.connect_timeout = handshake_timeout, connect_timeout
        self.port = 0
        self.peer_id: str | None = None
        self.failure: AdmissionError | None = None
        self._runner: _LoopThread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._log_limit = log_limit or LogLimiter()

    @property
    def url(self) -> str:
        return url_of("127.0.0.1", self.port)

    def start(self) -> Tunnel:
        self._runner = _LoopThread(f"tunnel-{self.name}")
        try:
            _, writer, self.peer_id = self._runner.call(
                self._open(), timeout=self.connect_timeout + self.handshake_timeout + 5)
            self._runner.loop.call_soon_threadsafe(writer.close)
            self._server = self._runner.call(
                asyncio.start_server(self._serve, "127.0.0.1", 0), timeout=10)
        except BaseException:
            self.close()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        host, port = self.remote
        where = f"the {self.name} gate at {host}:{port}"
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), self.connect_timeout)
        except (OSError, TimeoutError) as exc:
            raise GateUnreachable(f"cannot connect to {where}: {exc!r}. Fix: check the address "
                                  "and that the run is up.") from None

        async def handshake() -> tuple[int, str, bool]:
            tag = await reader.readexactly(len(CHALLENGE_TAG))
            if tag == VERDICT_TAG:  # turned away before any challenge (an older gate, busy)
                return (*await read_verdict(reader, read_tag=tag), False)
            challenge = await read_frame(reader, CHALLENGE_TAG, MAX_CHALLENGE, read_tag=tag)
            writer.write(frame(PROOF_TAG, self.auth.prove(challenge)))
            await writer.drain()
            return (*await read_verdict(reader), True)

        try:
            code, text, proved = await asyncio.wait_for(handshake(), self.handshake_timeout)
        except TimeoutError:
            writer.close()
            raise GateUnreachable(
                f"{where} sent no farlink challenge within {self.handshake_timeout:g} s. Fix: "
                "every process of a run must use the same --auth; a run with --auth puts its "
                f"{self.name} behind a gate (farlink train starts it).") from None
        except (asyncio.IncompleteReadError, ProtocolError, OSError, AuthError) as exc:
            writer.close()
            raise GateUnreachable(f"{where} did not complete the handshake ({exc}); is it a "
                                  "farlink gate?") from None
        if code == ADMITTED:
            return reader, writer, text
        writer.close()
        if not proved:  # nothing was checked: not a verdict on this peer's membership
            raise GateUnreachable(f"{where} turned this connection away before any handshake: "
                                  f"{text}. Fix: retry; if it persists the gate is flooded.")
        if code == REFUSED:
            raise GateRefused(f"{where} refused this peer: {text}. {FIX}")
        raise GateUnreachable(f"{where} admitted this peer but said: {text}")

    async def _serve(self, local_reader: asyncio.StreamReader,
                     local_writer: asyncio.StreamWriter) -> None:
        try:
            reader, writer, _ = await self._open()
        except AdmissionError as exc:
            self.failure = exc
            write, skipped = self._log_limit.admit("failed")
            if write:  # a client retrying in a loop would otherwise log every attempt
                log.error("%s%s", exc, f" ({skipped} similar lines left out)" if skipped else "")
            local_writer.close()
            return
        except asyncio.CancelledError:  # the tunnel is closing
            local_writer.close()
            return
        try:
            await relay(local_reader, local_writer, reader, writer)
        except asyncio.CancelledError:
            pass


def open_tunnel(address: str, auth: Authenticator, name: str = "service",
                timeout: float = 10.0) -> Tunnel:
    """A started :class:`Tunnel` to the gate at ``address`` (``http://host:port``)."""
    return Tunnel(auth, parse_address(address), name=name, handshake_timeout=timeout,
                  connect_timeout=timeout).start()


def answers_as_gate(address: str, timeout: float = 2.0) -> bool:
    """Whether ``address`` is a farlink gate, for a peer without ``--auth`` to fail fast.

    A gate greets with its challenge before reading anything. A harmless HTTP request is sent so
    a plain server (torchft's Lighthouse serves HTTP too) answers at once instead of leaving the
    probe to time out. Any failure reads as "not a gate": the normal path reports it.
    """
    try:
        with socket.create_connection(parse_address(address), timeout=timeout) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: farlink-probe\r\nConnection: close\r\n\r\n")
            head = b""
            while len(head) < len(CHALLENGE_TAG):
                chunk = sock.recv(len(CHALLENGE_TAG) - len(head))
                if not chunk:
                    break
                head += chunk
            return head == CHALLENGE_TAG
    except (OSError, ValueError):
        return False
