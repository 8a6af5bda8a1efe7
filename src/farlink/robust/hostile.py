"""Emulations of a hostile or broken MEMBER of a run, for benchmarks and tests of the protocol.

:mod:`farlink.robust.attacks` rewrites the *update* an honest worker sends; the attacks here
misuse the *protocol* around it, as a member holding the run's secret (or its own listed ed25519
key) could, or as a buggy peer might by accident: what it announces about itself in matchmaking
or to the Lighthouse, what it serves to a peer that heals from it, what it claims in its envelope,
whose mailbox slots it writes, what it sends to whom, how it votes. They exist so benchmarks and
tests can show that a run refuses or bounds such a member; they are not an adaptive adversary.

An attack is armed on the real objects of one worker (:func:`arm`): its collective and its
exchange get a subclass of their own class that overrides only public methods every backend has
(``begin_round``, ``expect_round``, ``register_state``, ``all_gather_bytes``, ``commit``,
hivemind's ``vote``) and, for the wire-level attacks, hivemind's one request sender
(``_request``), so the attacks keep working whatever checks the honest side adds.

``NAME[:ARG]`` (``--attack NAME --attackers I,J``):

- ``round_inflation[:nan]``: announces its committed round as its real one + 10000 before every
  round (``load_committed_step``: hivemind puts it in matchmaking metadata, torchft reports it to
  the Lighthouse) and, asked for its state by a peer that heals, serves weights replaced by
  random values (``:nan``: by NaN);
- ``weight_inflation[:X]``: claims X tokens in its envelope (default 1e30; 1e39 overflows float32);
- ``slot_forging`` (hivemind): around each push of its update, puts forged envelopes (its update
  x -10, signed with what it holds: the run secret under invented sender names, or its own
  ed25519 key) into the slots of the other members in every receiver's mailbox, again and again
  until the others' updates have arrived;
- ``equivocation`` (hivemind): sends its honest update to every second other member (in rank
  order) and a validly signed update x -10 to the rest;
- ``bad_metadata`` (hivemind): announces a malformed matchmaking field (bandwidth ``"fast"``);
- ``always_no`` (hivemind): votes no on every round.

On torchft the hivemind-only attacks have no surface (:data:`NOT_ON_TORCHFT` says why for each).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: how far ahead of its real round a round-inflating member says it is
ROUND_OFFSET = 10000
#: what a forged or equivocal update is, relative to the member's own update
FORGED_FACTOR = -10.0
#: the line an armed member logs about itself; benchmarks read its names from it
HOSTILE_TAG = "emulated hostile member"

PROTOCOL_ATTACKS = ("round_inflation", "weight_inflation", "slot_forging", "equivocation",
                    "bad_metadata", "always_no")
#: attacks that need a surface only the hivemind backend has, and why torchft has none
NOT_ON_TORCHFT = {
    "slot_forging": "Gloo binds each rank to its own connection: there is no mailbox slot a "
                    "member could write for another",
    "equivocation": "Gloo's all-gather hands every member the same buffer from each rank: a "
                    "member cannot send different bytes to different receivers",
    "bad_metadata": "torchft has no matchmaking metadata: the Lighthouse's quorum carries only "
                    "fields its own client fills in",
    "always_no": "torchft's should_commit is agreed among the ranks of one replica group only: "
                 "a member that votes no fails its own round, not the others'",
}


@dataclass(frozen=True)
class ProtocolAttack:
    """A parsed protocol attack."""

    name: str
    nan: bool = False  # round_inflation: serve NaN instead of random weights
    tokens: float = 1e30  # weight_inflation: the claimed token count

    @property
    def spec(self) -> str:
        if self.name == "round_inflation" and self.nan:
            return "round_inflation:nan"
        if self.name == "weight_inflation":
            return f"weight_inflation:{self.tokens:g}"
        return self.name


def parse(spec: str | None) -> ProtocolAttack | None:
    """The protocol attack ``spec`` names, or None when it names none (an update attack, or
    ``none``); a protocol attack with a bad argument raises ValueError."""
    name, _, arg = (spec or "none").strip().lower().partition(":")
    if name not in PROTOCOL_ATTACKS:
        return None
    if name == "round_inflation" and arg in ("", "nan", "random"):
        return ProtocolAttack(name, nan=arg == "nan")
    if name == "weight_inflation":
        try:
            tokens = float(arg) if arg else 1e30
        except ValueError:
            raise ValueError(f"bad attack parameter in {spec!r}: weight_inflation:X takes a "
                             "token count (1e30, 1e39)") from None
        return ProtocolAttack(name, tokens=tokens)
    if not arg:
        return ProtocolAttack(name)
    raise ValueError(f"bad attack parameter in {spec!r}: round_inflation takes :nan, "
                     "weight_inflation a token count, the others nothing")


def not_applicable(spec: str, backend: str) -> str | None:
    """Why ``spec`` cannot run on ``backend`` (None when it can)."""
    attack = parse(spec)
    if attack is not None and backend == "torchft":
        return NOT_ON_TORCHFT.get(attack.name)
    return None


def poisoned(get_state, nan: bool):  # noqa: ANN001, ANN201 - state callables
    """``get_state`` whose floating tensors are replaced by random values (or NaN), resealed
    with a valid SHA-256 so the receiver's integrity check passes: the hash says the bytes
    arrived as sent, not that they are good."""
    from farlink.sync.digest import verified, with_digest

    def serve():  # noqa: ANN202
        state = get_state()
        has_digest = "integrity.sha256" in state
        state = verified(state) if has_digest else dict(state)
        gen = torch.Generator().manual_seed(ROUND_OFFSET)
        for name, value in state.items():
            if value.is_floating_point() and not name.startswith("schedule."):
                bad = (torch.full(value.shape, float("nan")) if nan
                       else torch.randn(value.shape, generator=gen) * 3.0)
                state[name] = bad.to(dtype=value.dtype, device=value.device)
        log.warning("%s: serving a poisoned state (%s) to a healing peer", HOSTILE_TAG,
                    "NaN" if nan else "random weights")
        return with_digest(state) if has_digest else state

    return serve


def hostile_exchange(base: type) -> type:
    """A subclass of the exchange class ``base`` (:class:`~farlink.sync.exchange.Exchange`)
    for a hostile member; see :func:`arm`."""

    class HostileExchange(base):
        """Inflates the claimed tokens (weight_inflation), and keeps what the collective needs
        to forge or equivocate: the last dense update and its weight, and a codec of its own
        (``hostile_codec``) so the honest codec's residuals stay untouched."""

        hostile: ProtocolAttack
        hostile_codec = None
        _hostile_last: tuple[dict[str, torch.Tensor], float] | None = None

        def average(self, tensors, weight: float, round_id: int):  # noqa: ANN001, ANN201
            from farlink.sync.exchange import dense_of

            if self.hostile.name == "weight_inflation":
                weight = self.hostile.tokens
            update = {n: dense_of(t).detach().float().cpu() for n, t in tensors.items()}
            self._hostile_last = (update, weight)
            return super().average(tensors, weight, round_id)

        def forged(self, round_id: int, sender: str,
                   factor: float = FORGED_FACTOR) -> bytes | None:
            """A validly signed envelope of ``factor`` x the last update, claiming ``sender``."""
            from farlink.codecs import envelope

            if self._hostile_last is None:
                return None
            update, weight = self._hostile_last
            payloads = {n: self.hostile_codec.encode(n, t * factor) for n, t in update.items()}
            message = envelope.pack(sender, round_id, weight, payloads,
                                    {n: tuple(t.shape) for n, t in update.items()},
                                    {n: torch.float32 for n in update})
            return self.authenticator.sign(message)

    return HostileExchange


def hostile_collective(base: type) -> type:
    """A subclass of the collective class ``base`` (torchft's or hivemind's) for a hostile
    member; see :func:`arm`."""

    class HostileCollective(base):
        """Announces, serves, sends and votes as the module docstring says."""

        hostile: ProtocolAttack
        hostile_exchange = None  # the member's armed Exchange
        _inflated = False
        _round_id = 0  # the round of the current group (as every member of it sees it)
        _equivocal: bytes | None = None  # this gather's update for odd receivers
        _forging = False  # inside all_gather_bytes with slot_forging

        # --- announcements ---------------------------------------------------------------------
        def _inflate(self) -> None:
            if self.hostile.name != "round_inflation" or self._inflated:
                return
            self._inflated = True
            manager = getattr(self, "manager", None)
            real = manager.current_step() if manager is not None else self.round_id
            self.load_committed_step(real + ROUND_OFFSET)

        def expect_round(self, in_seconds: float, final: bool = False) -> None:
            self._inflate()
            super().expect_round(in_seconds, final)

        def begin_round(self, final: bool = False, **round_options):  # noqa: ANN003, ANN201
            self._inflate()
            info = super().begin_round(final, **round_options)
            self._round_id = info.round_id
            if self.hostile.name == "slot_forging" and not info.skipped:
                self._forge_early()
            return info

        def _forge_early(self) -> None:
            """Forge into the round's first all-gather as soon as the group is known, from the
            last round's update, while the honest members still compute theirs (hivemind names
            a round's first all-gather ``<group id>/g1``)."""
            group, exchange = getattr(self, "_group", None), self.hostile_exchange
            if group is None or not hasattr(self, "_mailbox") or exchange is None:
                return
            key = group.group_id + b"/g" + str(group.seq + 1).encode()

            async def forge() -> None:
                await asyncio.gather(*(self._forge_slots(group.peers[t], t, key)
                                       for t in group.servers() if t != group.me))

            try:
                self._call(forge(), timeout=self.gather_timeout)
            except Exception as exc:  # noqa: BLE001 - the round goes on with the later forgeries
                log.info("%s: early forging failed: %r", HOSTILE_TAG, exc)

        def register_state(self, get_state, set_state) -> None:  # noqa: ANN001
            if self.hostile.name == "round_inflation":
                get_state = poisoned(get_state, self.hostile.nan)
            super().register_state(get_state, set_state)

        # --- what it sends ---------------------------------------------------------------------
        def all_gather_bytes(self, payload: bytes) -> list[bytes]:
            name, exchange = self.hostile.name, self.hostile_exchange
            if name == "equivocation" and exchange is not None:
                self._equivocal = exchange.forged(self._round_id, exchange.sender)
            self._forging = name == "slot_forging" and exchange is not None
            try:
                return super().all_gather_bytes(payload)
            finally:
                self._equivocal, self._forging = None, False

        async def _request(self, peer, handler: str, header: dict,  # noqa: ANN001, ANN201
                           bodies: list[bytes]):
            """hivemind's one sender of requests: a put of this member's own update is rewritten
            for odd receivers (equivocation), or flanked by forged puts into the other members'
            slots of that receiver's mailbox (slot forging)."""
            group = getattr(self, "_group", None)
            ours = (handler == "put" and group is not None
                    and int(header.get("rank", -1)) == group.me)
            if not ours or not (self._equivocal or self._forging):
                return await super()._request(peer, handler, header, bodies)
            receiver = list(group.peers).index(peer)
            others = [r for r in range(group.size) if r != group.me]
            if self._equivocal and others.index(receiver) % 2 == 1:
                from farlink.comm.hivemind_backend import slice_of

                part, parts = int(header.get("part", 0)), int(header.get("parts", 1))
                return await super()._request(peer, handler, header,
                                              [slice_of(self._equivocal, part, parts)])
            if not self._forging or int(header.get("part", 0)) != 0:
                return await super()._request(peer, handler, header, bodies)
            key = bytes(header["key"])
            await self._forge_slots(peer, receiver, key)
            answer = await super()._request(peer, handler, header, bodies)
            # a receiver's slot keeps the last put until it reads it: forge again until every
            # other member's update reached this one (theirs reached the receiver about then)
            others = set(range(group.size)) - {group.me}
            deadline = time.monotonic() + self.gather_timeout
            while time.monotonic() < deadline and not others <= set(
                    self._mailbox.slots.get(key, {})):
                await self._forge_slots(peer, receiver, key)
                await asyncio.sleep(0.05)
            await self._forge_slots(peer, receiver, key)
            return answer

        async def _forge_slots(self, peer, receiver: int, key: bytes) -> None:  # noqa: ANN001
            """Put a forged envelope into every other member's slot of ``key`` at ``receiver``."""
            exchange, group = self.hostile_exchange, self._group
            ed25519 = exchange.authenticator.name == "ed25519"
            puts = []
            for rank in range(group.size):
                if rank in (group.me, receiver):
                    continue
                sender = exchange.sender if ed25519 else f"forged-rank{rank}"
                body = exchange.forged(self._round_id, sender)
                if body is not None:
                    forged = {"key": key, "rank": rank, "part": 0, "parts": 1}
                    puts.append(super()._request(peer, "put", forged, [body]))
            for outcome in await asyncio.gather(*puts, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    log.info("%s: a forged put failed: %r", HOSTILE_TAG, outcome)

        # --- votes -----------------------------------------------------------------------------
        def vote(self, ok: bool) -> bool:
            return super().vote(False if self.hostile.name == "always_no" else ok)

        def commit(self) -> bool:
            self._inflated = False  # the next round is announced ahead again
            return super().commit()

    return HostileCollective


def _swap(obj, subclass, attack: ProtocolAttack) -> None:  # noqa: ANN001
    """Make ``obj`` an instance of ``subclass(its class)``: its state stays as it is."""
    obj.__class__ = subclass(type(obj))
    obj.hostile = attack


def innermost(collective):  # noqa: ANN001, ANN201
    """The backend's own collective under wrappers that delegate to ``inner`` (link shaping)."""
    while hasattr(collective, "inner"):
        collective = collective.inner
    return collective


def arm(spec: str, collective, exchange, codec: str,  # noqa: ANN001
        name: str = "") -> ProtocolAttack:
    """Turn one worker's real ``collective`` and ``exchange`` into a hostile member's.

    Call before the algorithm registers its state with the collective (a poisoned state is
    served through ``register_state``)."""
    from farlink.codecs import make_compressor

    attack = parse(spec)
    if attack is None:
        raise ValueError(f"{spec!r} is not a protocol attack; choose from "
                         f"{', '.join(PROTOCOL_ATTACKS)}")
    backend = innermost(collective)
    _swap(exchange, hostile_exchange, attack)
    exchange.hostile_codec = make_compressor(codec)
    _swap(backend, hostile_collective, attack)
    backend.hostile_exchange = exchange
    if attack.name == "bad_metadata" and hasattr(backend, "bandwidth"):
        backend.bandwidth = "fast"  # announced as is in matchmaking metadata
    peer = getattr(backend, "peer_id", None)
    log.warning("%s: %s runs %s (names: %s)", HOSTILE_TAG, name or exchange.sender, attack.spec,
                ", ".join(str(n) for n in (name, exchange.sender, peer) if n))
    return attack
