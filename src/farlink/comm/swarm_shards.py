"""Which shard of the corpus a volunteer trains: claimed in the swarm's DHT, not assigned.

The run's train tokens are cut into ``workers`` contiguous shards, as for ``farlink train``
(:func:`farlink.data.sampler.shard_bounds`); ``workers`` is the room the run has for volunteers.
A volunteer has no index, so it derives one from who it is and when it comes:

1. **Join round.** Every live claim carries the committed round of its holder; their lower
   median is the round the newcomer joins (0 in a new swarm), so one claim cannot move it.
   A claim is its writer's word, so a claim outside the run's shards, with a lease longer than
   :data:`CLAIM_TTL`, dated in the future or malformed is ignored (:func:`claim_problem`).
2. **Preference order.** The shard its own run dir trained before (a restart), then every shard
   starting at ``SHA-256(peer id | join round) mod workers`` and going round. The peer id is the
   volunteer's libp2p identity, kept in its run dir, so a restart is the same volunteer.
3. **Claim.** It takes the first shard in that order that no live peer holds, stores
   ``(shard, since, round)`` in the DHT key of the run's claims under its peer id and the
   ``[owner:KEY]`` marker of its identity's RSA key, waits for the DHT to settle and reads the
   claims back. The DHT peers store a marked record only when KEY signed it, and a reader counts
   a claim only when KEY hashes to the peer id beside it (:func:`claimant`): nobody writes a
   claim under an invented peer id or under another volunteer's. A shard held by several claims belongs to the oldest
   claim (earliest ``since``; ties: the smaller peer id); a volunteer that lost moves on. So two
   live volunteers never train the same tokens.
4. **Keep it.** The claim expires :data:`CLAIM_TTL` seconds after it was last stored and its
   holder re-stores it every third of that. A volunteer that leaves (or is killed) stops
   refreshing, and its shard is free for the next newcomer; a volunteer restarted within the TTL
   finds its own claim and keeps its shard and data position. Each refresh also reads the
   claims back: how many volunteers hold a shard (:attr:`ShardClaim.live`) is the swarm's size,
   which the volunteer's rounds wait for instead of ``workers`` (the run's room).
5. **Its data position outlives the claim.** After every committed round the holder stores where
   its sampler stands in the shard (epoch and position, as of that round) under the shard's
   number in a second key, kept :data:`POSITION_TTL` seconds. A newcomer that takes the shard
   over continues from there, so the tokens its last holder trained into committed rounds are
   not trained again; what the holder drew after its last committed round is drawn again, as
   that work was lost with it.

When every shard is held by a live volunteer the run is full, and a newcomer is told so.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CLAIM_TTL = 30.0
SETTLE_S = 2.0
POSITION_TTL = 7 * 24 * 3600.0  # a shard nobody trains for a week starts over


class SwarmFull(RuntimeError):
    """Every shard of the run is held by a live volunteer."""


def preference(peer_id: str, join_round: int, num_shards: int,
               previous: int | None = None) -> list[int]:
    """The order in which a volunteer tries the shards (see the module docstring)."""
    start = int.from_bytes(hashlib.sha256(f"{peer_id}|{join_round}".encode()).digest()[:8],
                           "big") % num_shards
    order = [(start + k) % num_shards for k in range(num_shards)]
    if previous is not None and 0 <= previous < num_shards:
        order.remove(previous)
        order.insert(0, previous)
    return order


def group_bounds(least: int, size: int | None, live: int) -> tuple[int, int | None]:
    """The smallest and the full group of a round in a swarm of ``live`` volunteers, for a run
    that asks for groups of ``least`` to ``size`` peers. A swarm's ``--workers`` is its room,
    not its size: with fewer live volunteers than ``least`` a group of all of them is the most
    there can be, so the first volunteers train (one alone, two together) instead of waiting
    for peers that do not exist, and the groups grow as others claim shards."""
    live = max(1, int(live))
    least = min(least, live)
    if size is not None:
        size = max(least, min(size, live))
    return least, size


CLOCK_SLACK = 10.0  # how far peers' DHT clocks may differ


def claim_problem(entry: Any, expiration: float, now: float, num_shards: int,
                  ttl: float = CLAIM_TTL) -> str | None:
    """Why a claim read from the DHT cannot be honest, or None. A claim is what its writer
    says about itself, so everything in it is bounded: a shard of this run, a lease no longer
    than :data:`CLAIM_TTL` (a year-long claim would hold a shard for a peer long gone), a
    ``since`` not in the future, a round that is a count."""
    try:
        shard, since, round_id = entry
        shard, since, round_id = int(shard), float(since), int(round_id)
    except (TypeError, ValueError, OverflowError):
        return "a malformed claim"
    if not 0 <= shard < num_shards:
        return f"shard {shard}, which this run of {num_shards} shards does not have"
    if expiration > now + ttl + CLOCK_SLACK:
        return (f"a lease of {expiration - now:.0f} s, beyond the {ttl:.0f} s a claim lasts "
                "unless renewed")
    if not since <= now + CLOCK_SLACK:
        return f"a claim dated {since - now:.0f} s in the future"
    if round_id < 0:
        return f"round {round_id}"
    return None


OWNER = "[owner:"  # hivemind's marker of a record only its key may write (RSASignatureValidator)


def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id of an RSA public key (OpenSSH form, as in an ``[owner:...]`` marker):
    the SHA-256 multihash of its protobuf, as hivemind's ``PeerID.from_identity`` derives it."""
    import multihash
    from cryptography.hazmat.primitives import serialization
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    key = serialization.load_ssh_public_key(public_key)
    der = key.public_bytes(encoding=serialization.Encoding.DER,
                           format=serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def claim_subkey(peer_id: str, owner: bytes) -> str:
    """The subkey a claim is stored under: its holder's peer id and ``[owner:KEY]`` marker, so
    every DHT peer refuses to store it unless KEY signed it (see :func:`claimant`)."""
    return peer_id + owner.decode()


def claimant(subkey: Any) -> tuple[str, str | None]:
    """(the peer a claim's subkey names, why the claim is not that peer's or None). The DHT
    has checked the ``[owner:KEY]`` signature; what is left is that KEY is the peer's own
    identity, so nobody writes under an id they do not hold (an invented one, or another's)."""
    name = subkey.decode(errors="replace") if isinstance(subkey, bytes) else str(subkey)
    peer, mark, rest = name.partition(OWNER)
    if not mark:
        return name, "unsigned (no [owner:KEY] in its subkey): anyone could have written it"
    if not rest.endswith("]"):
        return peer, "a malformed [owner:KEY] marker"
    try:
        owner = peer_id_of(rest[:-1].encode())
    except (ValueError, TypeError):
        return peer, "an [owner:KEY] marker with no RSA public key"
    if owner != peer:
        return peer, f"signed by peer {owner}, whose key is not {peer}'s"
    return peer, None


def join_round(rounds: list[int]) -> int:
    """The round a newcomer joins at: the lower median of the live claims' rounds, so one
    volunteer announcing round 1e9 moves it no more than one announcing its true round."""
    ordered = sorted(rounds)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0


def owners(claims: dict[str, tuple[int, float, int]]) -> dict[int, str]:
    """shard -> the peer holding it: the oldest claim wins, ties go to the smaller peer id."""
    best: dict[int, tuple[float, str]] = {}
    for peer, (shard, since, _) in claims.items():
        if shard not in best or (since, peer) < best[shard]:
            best[shard] = (since, peer)
    return {shard: peer for shard, (_, peer) in best.items()}


class ShardClaim:
    """This volunteer's claim on one shard, kept alive in the DHT until :meth:`release`.

    ``dht``: the volunteer's running ``hivemind.DHT``, started with ``dht_options(...,
    identity_path)``; ``identity``: that identity's key
    (:func:`~farlink.comm.hivemind_net.identity_key`), which signs the claim; ``key``: the
    run's claims key; ``progress``: this volunteer's committed round (refreshed into its claim).
    """

    def __init__(self, dht: Any, key: str, num_shards: int, identity: Any,
                 progress: Callable[[], int] = lambda: 0, ttl: float = CLAIM_TTL,
                 settle: float = SETTLE_S) -> None:
        from hivemind.dht.crypto import RSASignatureValidator

        self.owner = RSASignatureValidator(identity).local_public_key
        self.peer_id = peer_id_of(identity.get_public_key().to_bytes())
        if self.peer_id != str(dht.peer_id):
            raise ValueError(f"the claim's key is peer {self.peer_id}'s, but its DHT runs as "
                             f"{dht.peer_id}: start the DHT with that identity_path")
        self.subkey = claim_subkey(self.peer_id, self.owner)
        self.dht, self.key, self.num_shards = dht, key, num_shards
        self.progress, self.ttl, self.settle = progress, ttl, settle
        self.positions_key = key + "_positions"
        self.shard: int | None = None
        self.since = 0.0
        self.join_round = 0
        #: live volunteers, this one included, as of the last read of the claims (at the claim,
        #: then every refresh): the swarm's size now, which ``--workers`` (its room) is not
        self.live = 1
        self._position: dict | None = None  # the last committed position, not yet stored
        self._stop = threading.Event()
        self._wake = threading.Event()  # store now: a new position, or leaving
        self._thread: threading.Thread | None = None
        self._ignored: set = set()  # (peer, why) already logged

    def claims(self) -> dict[str, tuple[int, float, int]]:
        """Live claims: peer id -> (shard, since, committed round)."""
        from hivemind.utils import get_dht_time

        found = self.dht.get(self.key, latest=True)
        out: dict[str, tuple[int, float, int]] = {}
        if found is None or not isinstance(found.value, dict):
            return out
        now = get_dht_time()
        for subkey, entry in found.value.items():
            peer, problem = claimant(subkey)
            if problem is None:
                problem = claim_problem(entry.value, entry.expiration_time, now,
                                        self.num_shards, self.ttl)
            if problem is not None:
                if (peer, problem) not in self._ignored:
                    self._ignored.add((peer, problem))
                    log.warning("shard claim of %s ignored: %s", peer, problem)
                continue
            shard, since, round_id = entry.value
            out[str(peer)] = (int(shard), float(since), int(round_id))
        return out

    def _store(self) -> None:
        from hivemind.utils import get_dht_time

        value = [self.shard, self.since, int(self.progress())]
        if not self.dht.store(self.key, value, get_dht_time() + self.ttl, subkey=self.subkey):
            log.warning("could not store the shard claim in the DHT; retrying")

    def acquire(self, previous: int | None = None) -> int:
        """Claim a shard (see the module docstring); raises :class:`SwarmFull`."""
        from hivemind.utils import get_dht_time

        claims = self.claims()
        mine = claims.get(self.peer_id)
        self.join_round = join_round([c[2] for c in claims.values()])
        if mine is not None:  # restarted within the TTL: our claim is still there
            previous, self.since = mine[0], mine[1]
        else:
            self.since = get_dht_time()
        tried: set[int] = set()
        for _ in range(self.num_shards):
            held = {s: p for s, p in owners(claims).items() if p != self.peer_id}
            free = [s for s in preference(self.peer_id, self.join_round, self.num_shards,
                                          previous) if s not in held and s not in tried]
            if not free:
                break
            self.shard = free[0]
            tried.add(self.shard)
            self._store()
            time.sleep(self.settle)
            claims = self.claims()
            claims[self.peer_id] = (self.shard, self.since, 0)
            if owners(claims).get(self.shard) == self.peer_id:
                self.live = len(set(owners(claims).values()))
                self._thread = threading.Thread(target=self._refresh, daemon=True,
                                                name="shard-claim")
                self._thread.start()
                log.info("claimed shard %d of %d (join round %d)", self.shard, self.num_shards,
                         self.join_round)
                return self.shard
            log.info("shard %d was claimed first by another volunteer; trying the next",
                     self.shard)
        self.shard = None
        raise SwarmFull(
            f"all {self.num_shards} shards of this run are trained by live volunteers (the run "
            f"has room for {self.num_shards}, its --workers). Try again later: a shard is free "
            f"{self.ttl:.0f} s after its volunteer leaves")

    # --- the shard's data position ------------------------------------------------------------
    def committed_position(self, shard: int | None = None) -> dict | None:
        """Where the shard's last holder stood after its last committed round:
        ``{"round": r, "sampler": ShardSampler.state_dict()}``, or None if nobody stored one."""
        shard = self.shard if shard is None else shard
        found = self.dht.get(self.positions_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return None
        entry = found.value.get(str(shard))
        value = getattr(entry, "value", None)
        if not isinstance(value, dict) or not isinstance(value.get("sampler"), dict):
            return None
        return {"round": int(value.get("round", 0)), "sampler": dict(value["sampler"])}

    def record(self, round_id: int, sampler_state: dict) -> None:
        """This holder committed ``round_id`` with its sampler at ``sampler_state``: stored in
        the background (the training thread never waits for the DHT)."""
        self._position = {"round": int(round_id), "sampler": dict(sampler_state)}
        self._wake.set()

    def _store_position(self) -> None:
        from hivemind.utils import get_dht_time

        position, self._position = self._position, None
        if position is None or self.shard is None:
            return
        if not self.dht.store(self.positions_key, position, get_dht_time() + POSITION_TTL,
                              subkey=str(self.shard)):
            self._position = self._position or position  # keep it for the next try
            log.warning("could not store the shard's data position in the DHT; retrying")

    def _refresh(self) -> None:
        while True:
            self._wake.wait(self.ttl / 3)
            self._wake.clear()
            if not self.dht.is_alive():  # the volunteer's collective closed it: nothing to keep
                return
            try:
                self._store_position()
                if self._stop.is_set():
                    return
                self._store()
                held = set(owners(self.claims()).values()) | {self.peer_id}
                self.live = len(held)
            except Exception as exc:  # noqa: BLE001 - the DHT going down ends the run anyway
                log.warning("refreshing the shard claim failed: %r", exc)
                if self._stop.is_set():
                    return

    def release(self) -> None:
        """Store the last committed position, then stop refreshing: the claim expires within
        the TTL."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
