"""Membership on hivemind: only peers that prove it take part in a community run.

Two layers, both active when a run has ``--auth``:

1. **hivemind's own hook, for the DHT.** ``hivemind.DHT(authorizer=...)`` hands every DHT RPC
   (ping, store, find) to an :class:`~hivemind.utils.auth.AuthorizerBase`: the caller signs each
   request and the receiver each response. :class:`RunAuthorizer` does that with the run's
   authenticator (HMAC with the run secret, or the member's ed25519 key checked against
   ``--allowed-keys``), with a timestamp and a single-use nonce. A non-member's DHT requests are
   dropped by members and its answers ignored, so it can neither read nor write the run's keys
   (group declarations, peer lists) through them, nor bootstrap into the members' DHT.
2. **farlink's handlers, for everything hivemind does not authorize.** hivemind's averaging RPCs
   (``rpc_join_group``, ``rpc_aggregate_part``) and farlink's own streams (``put``, ``fetch``,
   ``state``) accept no authorizer. :class:`Admission` runs a mutual challenge-response over a
   ``<prefix>.admit`` stream at first contact with a peer, bound to both libp2p peer ids (which
   libp2p's secure channel authenticates, so a relayed proof fails), and caches the result per
   peer id. Every handler refuses a peer that has not proven membership; a follower proves its
   leader before asking to join its group (:class:`AdmittingMatchmaking`), and a member checks
   every groupmate before it sends it anything.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from farlink.comm.hivemind_matchmaking import ClientAwareMatchmaking
from farlink.robust.auth import Authenticator, AuthError

log = logging.getLogger(__name__)

_DHT_DOMAIN = b"farlink-dht\x00"
_P2P_DOMAIN = b"farlink-p2p\x00"
_MAX_FRAME = 4096  # an admission message is a challenge or a proof: small
FIX = ("Fix: wrong run secret / key not in --allowed-keys: every peer of the run needs the same "
       "--auth and secret (--secret or FARLINK_SECRET), or an ed25519 --key-file whose public key "
       "is in the run's --allowed-keys.")


class _RateLimitedLog:
    """One warning per key per ``period`` seconds: a non-member may retry many times a second."""

    def __init__(self, period: float = 10.0) -> None:
        self.period = period
        self._last: dict[str, float] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.period:
            self._last[key] = now
            log.warning(msg, *args)


_excluded_log = _RateLimitedLog()


class RunAuthorizer(AuthorizerBase):
    """hivemind's DHT authorization with the run's authenticator (see the module docstring).

    A request is accepted once, within ``window`` seconds of the time it claims; the signature
    covers the whole serialized message (with the signature field empty).
    """

    window = 60.0

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth
        self._nonces: TimedStorage[bytes, None] = TimedStorage()
        self._log = _RateLimitedLog()
        self.refused = 0

    def _tag(self, message: Any) -> bytes:
        body = _DHT_DOMAIN + message.SerializeToString()
        return self.auth.sign(body)[len(body):]

    def _verifies(self, message: Any, tag: bytes) -> str | None:
        """None when ``tag`` verifies over ``message``, else the reason."""
        body = _DHT_DOMAIN + message.SerializeToString()
        try:
            self.auth.verify(body + tag)
            return None
        except AuthError as exc:
            return str(exc)

    async def sign_request(self, request: Any, service_public_key: Any) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = self._tag(request)

    async def validate_request(self, request: Any) -> bool:
        auth = request.auth
        tag, auth.signature = auth.signature, b""
        reason = self._verifies(request, tag)
        now = get_dht_time()
        if reason is None and abs(auth.time - now) > self.window:
            reason = f"request time is {auth.time - now:+.0f} s off (replayed, or clocks differ)"
        if reason is None:
            with self._nonces.freeze():
                if auth.nonce in self._nonces:
                    reason = "request nonce already seen (replayed)"
        if reason is not None:
            self.refused += 1
            self._log.warning("dht", "DHT request refused: %s. %s", reason, FIX)
            return False
        self._nonces.store(auth.nonce, None, now + 3 * self.window)
        return True

    async def sign_response(self, response: Any, request: Any) -> None:
        response.auth.nonce = request.auth.nonce
        response.auth.signature = b""
        response.auth.signature = self._tag(response)

    async def validate_response(self, response: Any, request: Any) -> bool:
        auth = response.auth
        tag, auth.signature = auth.signature, b""
        reason = self._verifies(response, tag)
        if reason is None and auth.nonce != request.auth.nonce:
            reason = "response answers another request"
        if reason is not None:
            self._log.warning("dht-response", "DHT response ignored: %s", reason)
            return False
        return True


def _binding(prover: PeerID, verifier: PeerID) -> bytes:
    """What a proof is bound to: who proves to whom (libp2p-authenticated peer ids)."""
    a, b = prover.to_bytes(), verifier.to_bytes()
    return _P2P_DOMAIN + struct.pack("<HH", len(a), len(b)) + a + b


async def _send(writer: asyncio.StreamWriter, message: dict) -> None:
    await P2P.send_raw_data(msgpack.packb(message), writer)


async def _recv(reader: asyncio.StreamReader) -> dict:
    """One small msgpack map; a longer frame is refused before it is read (no memory blow-up)."""
    header = await reader.readexactly(P2P.HEADER_LEN)
    n = int.from_bytes(header, P2P.BYTEORDER)
    if n > _MAX_FRAME:
        raise AuthError(f"admission message of {n} bytes (limit {_MAX_FRAME})")
    message = msgpack.unpackb(await reader.readexactly(n))
    if not isinstance(message, dict):
        raise AuthError("admission message is not a map")
    return message


def _field(message: dict, key: str) -> bytes:
    value = message.get(key)
    if not isinstance(value, bytes):
        raise AuthError(f"admission message has no {key!r}")
    return value


#: how often a peer that contacts this one unproven is asked for the handshake, at most
PROVE_EVERY = 5.0


class Admission:
    """Who may talk to this peer: libp2p peer ids that proved membership (cached for the run).

    ``refusals`` keeps the last 1000 ``(peer id, reason)``; a peer refused in the last
    ``backoff`` seconds is not asked again, so a non-member costs one handshake per period.
    """

    def __init__(self, auth: Authenticator, p2p: P2P, prefix: str, timeout: float = 10.0,
                 backoff: float = 30.0) -> None:
        self.auth, self.p2p, self.timeout, self.backoff = auth, p2p, timeout, backoff
        self.handler = f"{prefix}.admit"
        self.members: dict[PeerID, str] = {}
        self.refusals: collections.deque[tuple[str, str]] = collections.deque(maxlen=1000)
        self._refused_at: dict[PeerID, tuple[float, str]] = {}
        self._locks: dict[PeerID, asyncio.Lock] = {}
        self._asked_at: dict[PeerID, float] = {}  # when this peer last asked for a proof
        self._tasks: set[asyncio.Task] = set()
        self._log = _RateLimitedLog()

    async def add_handler(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler, self._handle)

    def admitted(self, peer: PeerID, what: str) -> bool:
        """True for a proven member; otherwise the refusal is logged, the handshake is started
        from this side (:meth:`_prove_later`) and False returned."""
        if peer in self.members or peer == self.p2p.peer_id:
            return True
        reason = f"{what} from a peer that has not proven membership"
        self.refusals.append((str(peer), reason))
        self._log.warning(str(peer), "refused peer %s: %s", peer, reason)
        self._prove_later(peer)
        return False

    def _prove_later(self, peer: PeerID) -> None:
        """Run the handshake with a peer that contacted this one unproven. A member that
        restarted (same identity, empty cache) is contacted by peers whose caches say it proved
        membership long ago, so they never prove themselves to it again: it refused their join
        requests and pushes for good, and a swarm of two waited out its quorum timeout. So the
        refusing side asks for the proof itself, at most once per ``PROVE_EVERY`` seconds per
        peer; a peer that fails the handshake is refused for ``backoff`` as before. An unproven
        contact alone never starts that backoff: it is no evidence of a wrong secret."""
        now = time.monotonic()
        if now - self._asked_at.get(peer, -PROVE_EVERY) < PROVE_EVERY:
            return
        self._asked_at[peer] = now
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the peer's event loop: the next contact there asks

        async def prove() -> None:
            try:
                await self.ensure(peer)
            except Exception as exc:  # noqa: BLE001 - a non-member, or one we cannot dial
                log.info("handshake asked of %s failed: %r", peer, exc)

        self._tasks.add(task := loop.create_task(prove()))
        task.add_done_callback(self._tasks.discard)

    def _refuse(self, peer: PeerID, reason: str) -> None:
        self.refusals.append((str(peer), reason))
        self._refused_at[peer] = (time.monotonic(), reason)
        self._log.warning(str(peer), "refused peer %s: %s", peer, reason)

    async def ensure(self, peer: PeerID) -> str:
        """The member id of ``peer``, running the mutual handshake at first contact.

        Raises :class:`AuthError` when either side refuses the other, and the transport's error
        when ``peer`` cannot be reached (that is not cached: it may be a passing failure).
        """
        if peer == self.p2p.peer_id:
            return self.auth.peer_id
        if peer in self.members:
            return self.members[peer]
        refused = self._refused_at.get(peer)
        if refused is not None and time.monotonic() - refused[0] < self.backoff:
            raise AuthError(refused[1])
        lock = self._locks.setdefault(peer, asyncio.Lock())
        async with lock:
            if peer in self.members:
                return self.members[peer]
            try:
                member = await asyncio.wait_for(self._initiate(peer), self.timeout)
            except AuthError as exc:
                self._refuse(peer, str(exc))
                raise
            self.members[peer] = member
            log.info("admitted %s (%s)", peer, member)
            return member

    async def _initiate(self, peer: PeerID) -> str:
        me = self.p2p.peer_id
        _, reader, writer = await self.p2p.call_binary_stream_handler(peer, self.handler)
        try:
            their_challenge = _field(await _recv(reader), "challenge")
            mine = self.auth.make_challenge()
            await _send(writer, {"proof": self.auth.prove(their_challenge, _binding(me, peer)),
                                 "challenge": mine})
            reply = await _recv(reader)
            if "error" in reply:
                raise AuthError(f"peer {peer} refused this peer: {reply['error']}. {FIX}")
            return self.auth.check_proof(mine, _field(reply, "proof"), _binding(peer, me))
        finally:
            writer.close()

    async def _handle(self, info: Any, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        peer, me = info.peer_id, self.p2p.peer_id
        try:
            challenge = self.auth.make_challenge()
            await _send(writer, {"challenge": challenge})
            message = await asyncio.wait_for(_recv(reader), self.timeout)
            try:
                member = self.auth.check_proof(challenge, _field(message, "proof"),
                                               _binding(peer, me))
                theirs = _field(message, "challenge")
            except AuthError as exc:
                self._refuse(peer, str(exc))
                await _send(writer, {"error": str(exc)})
                return
            self.members[peer] = member
            self._refused_at.pop(peer, None)
            await _send(writer, {"proof": self.auth.prove(theirs, _binding(me, peer))})
        except Exception as exc:  # noqa: BLE001 - a broken or silent stream from one peer
            log.info("admission stream from %s failed: %r", peer, exc)
        finally:
            writer.close()


class AdmittingMatchmaking(ClientAwareMatchmaking):
    """Matchmaking (:class:`ClientAwareMatchmaking`) that proves a would-be leader (and itself to
    it) before joining: a follower never sends its join request, or later its data, to a
    non-member. A peer that ``excluded`` says this member excludes for now (it kept making
    rounds fail: :mod:`farlink.robust.strikes`) is neither joined nor let join."""

    def __init__(self, *args: Any, admission: Admission | None = None,
                 excluded: Callable[[PeerID], bool] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admission = admission
        self.excluded = excluded

    def _check_reasons_to_reject(self, request: Any, context: Any) -> Any:
        if self.excluded is not None and self.excluded(context.remote_id):
            _excluded_log.warning(str(context.remote_id), "refused a join request from %s: "
                                  "this peer excludes it for now (it kept making rounds fail)",
                                  context.remote_id)
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return super()._check_reasons_to_reject(request, context)

    async def _request_join_group(self, leader: PeerID) -> Any:
        if self.excluded is not None and self.excluded(leader):
            return None  # an excluded leader's group is not this peer's
        if self.admission is not None:
            try:
                await self.admission.ensure(leader)
            except Exception as exc:  # noqa: BLE001 - a refused or unreachable leader: skip it
                log.info("not joining %s: %s", leader, exc)
                return None
        return await super()._request_join_group(leader)
