"""The collective interface every outer algorithm talks to, whatever the transport.

An outer round is ``begin_round`` -> one or more collectives -> ``commit``. A backend may drop
peers between rounds (crash, stall, leave) and add newcomers (who are healed from live peers in
``begin_round``); an algorithm only ever sees the peers of the current round. Collectives never
raise on a peer failure: the backend records it and ``commit`` returns False, so the caller
discards the round and nothing half-applied reaches the parameters.

Byte accounting is exact and per worker: every backend counts the bytes *this* worker puts on the
wire for each collective under the algorithm it really runs (ring all-reduce sends
``2 (n-1)/n * size``, ring all-gather ``(n-1) * size``), which tests check against payload sizes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from farlink.comm.errors import CommError
    from farlink.links import LinkProfile


@dataclass
class RoundInfo:
    """Who takes part in the current outer round."""

    round_id: int  # committed outer steps so far (the same on every participant)
    rank: int  # this worker's position among the participants
    world_size: int  # participants in this round
    healed: bool = False  # this worker just loaded state from a live peer
    #: no group formed for this worker within its window (Moshpit groups of fixed size leave a
    #: peer out when the swarm does not divide into them): it averages nothing this round,
    #: commits nothing, and goes on with its local update
    skipped: bool = False
    peers: list[str] = field(default_factory=list)  # participant ids, in rank order
    #: the ``tag`` (``begin_round``) of every participant that holds the group's round (those
    #: behind it heal), where the backend carries them in its quorum (torchft, in-process); None
    #: where it does not. An algorithm whose rounds differ in what they carry checks them agree
    tags: list[str | None] | None = None


@dataclass
class CommStats:
    """Running totals of what this worker sent, for metrics and benchmarks."""

    bytes_sent: int = 0
    collectives: int = 0
    failed_rounds: int = 0
    comm_seconds: float = 0.0
    #: comm_seconds by phase of a round, for backends that tell them apart (hivemind:
    #: matchmaking, all_reduce, all_gather, commit): where a round's time goes on a slow link
    phase_seconds: dict[str, float] = field(default_factory=dict)
    #: of ``comm_seconds``, the time an emulated link held this worker (in-process emulation)
    emulated_seconds: float = 0.0

    def add_phase(self, phase: str, seconds: float) -> None:
        self.comm_seconds += seconds
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds


@dataclass
class LinkModel:
    """A link as in-process emulation sees it: bandwidth and one-way latency, no queueing (the
    full model with a shared wire, jitter and loss is :class:`farlink.emulate.ShapedLink`)."""

    bandwidth_bytes_per_s: float = float("inf")
    latency_s: float = 0.0
    #: one wire for every member (a shared bottleneck): their transfers queue on it
    shared: bool = False

    @classmethod
    def of(cls, mbit: float | None, one_way_ms: float, shared: bool = False) -> LinkModel:
        """From a link table's units (Mbit/s, None for unlimited; milliseconds one way)."""
        return cls(float("inf") if mbit is None else mbit * 1e6 / 8, one_way_ms / 1000, shared)

    @classmethod
    def of_profile(cls, profile: LinkProfile) -> LinkModel | None:
        """A named profile's upload rate and hop latency (delay + jitter, as the planner prices
        a hop: a collective step waits for its latest packet); None for a link that is not
        shaped (loopback)."""
        return cls.of(profile.up_mbit, profile.hop_latency_ms, profile.shared) \
            if profile.shaped else None

    def seconds(self, nbytes: int, hops: int) -> float:
        """How long ``nbytes`` over ``hops`` one-way latencies take."""
        return hops * self.latency_s + nbytes / self.bandwidth_bytes_per_s


class Collective(ABC):
    """A fault-tolerant group of peers that runs one outer round at a time."""

    #: whether ``all_reduce_sum`` returns bit-identical sums on every participant; when not
    #: (hivemind's butterfly hands out averages as deltas), exchanges use the gathered path so
    #: replicas stay bit-identical
    exact_all_reduce: bool = True
    #: how long ``begin_round`` waits for a quorum (s) unless the call says otherwise
    quorum_timeout: float = 120.0
    #: a round's group may be smaller than the swarm (hivemind's Moshpit groups): members of
    #: different groups then hold different states at one round number, and an algorithm that
    #: runs in such groups averages its committed state within each group
    partial_groups: bool = False
    #: whether ``all_to_all_bytes`` sends each member only its own message (the compressed
    #: all-reduce of :mod:`farlink.sync.allreduce` runs only where it does)
    native_all_to_all: bool = False
    #: whether, once a member dies mid-round, the live members' collectives still work and their
    #: commit needs only the live members' verdicts, so the compressed all-reduce can redo a
    #: dead owner's shard within the round. In-process: yes. torchft: no (the failed Gloo
    #: collective errors the Manager, whose ``should_commit`` stays False until the next quorum,
    #: and the round's Gloo collectives span every rank, the dead one included, until that
    #: quorum rebuilds the group). hivemind: no (a push that does not arrive fails the vote).
    survives_departures: bool = False

    def __init__(self, emulated_link: LinkModel | None = None) -> None:
        """``emulated_link``: in-process link emulation (every transfer held for the link's
        latency and bytes over its bandwidth), or None for the real link only. Given at
        construction: a collective's link does not change under it."""
        self.stats = CommStats()
        self._emulated_link = emulated_link

    @property
    def emulated_link(self) -> LinkModel | None:
        return self._emulated_link

    def emulate_transfer(self, nbytes: int, hops: int) -> None:
        """Hold the caller as long as ``nbytes`` over ``hops`` latencies take on the emulated
        link (used where network namespaces are not available; labelled as such in reports)."""
        if self._emulated_link is None:
            return
        import time

        held = self._emulated_link.seconds(nbytes, hops)
        time.sleep(held)
        self.stats.emulated_seconds += held

    @abstractmethod
    def begin_round(self, final: bool = False, *, joining: bool = False,
                    timeout: float | None = None, tag: str | None = None) -> RoundInfo:
        """Agree on the participants of the next round; heal this worker if it is behind.
        ``final``: the run's last round; a backend whose groups are smaller than the swarm
        (hivemind's Moshpit groups) forms it with every live peer, so the run ends on one
        model. Backends with one group per round ignore it.
        ``joining``: a newcomer's first round (``Optimizer.join``): it holds no state of the
        run's worth keeping, so it announces no fingerprint and its round 0 does not count
        toward the group's round (:func:`farlink.robust.heal.group_round`); the founders of a
        run at round 0 do count, so a member claiming a far round cannot outvote them.
        ``timeout``: this round's wait for a quorum (default :attr:`quorum_timeout`); a
        newcomer waits for the members' next round, however long their rounds are.
        ``tag``: what this member's round carries (Streaming DiLoCo: its fragment); a backend
        that gathers announcements at the quorum (torchft, in-process) adds it to them at no
        cost and hands the members' tags back in ``RoundInfo.tags``; others ignore it.
        These are arguments of the round, not state set on the collective, so a wrapper passes
        them on and nothing has to be restored after the round."""

    def expect_round(self, in_seconds: float, final: bool = False) -> None:
        """A hint from the training side: the next ``begin_round`` (the run's last if
        ``final``) comes in about ``in_seconds``.

        A backend whose group forming takes time (hivemind's DHT matchmaking) starts it ahead so
        the group is ready at the boundary, as hivemind's own Optimizer pre-schedules its
        averaging; the round itself is still agreed on in ``begin_round``, so a wrong estimate
        costs only waiting. Backends whose quorum is cheap (torchft, in-process) ignore it."""

    @abstractmethod
    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        """Sum float tensors in place across participants (dense, uncompressed)."""

    @abstractmethod
    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every participant's payload, in rank order (this worker's included)."""

    def all_to_all_bytes(self, outgoing: list[bytes]) -> list[bytes]:
        """Send ``outgoing[j]`` to member ``j`` of the round (``outgoing[rank]`` stays here);
        return what each member sent to this one, in rank order, ``b""`` where nothing
        arrived (the collective then fails the round). Bytes counted: what this worker hands
        its transport for the other members, measured per message."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all")

    def round_members(self) -> int:
        """How many members the current round has (``len`` of an all-to-all's list)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its round's size")

    def round_rank(self) -> int:
        """This worker's rank among the current round's members."""
        raise NotImplementedError(f"{type(self).__name__} does not say its round rank")

    @abstractmethod
    def commit(self) -> bool:
        """True when every participant finished the round's collectives without error."""

    @abstractmethod
    def fail_round(self, error: CommError, blame: Sequence[int] = ()) -> None:
        """Fail the current round for a reason found above the transport (the exchange saw
        members receive different updates): ``commit`` then returns False here. Where commit
        is a group decision (hivemind's vote, in-process) it is False on every participant;
        torchft decides per replica, and there the exchange's check reaches the same verdict
        on every replica (each compares the same digests), so each fails its own round.
        ``blame``: the members (ranks of this round) whose misbehaviour failed it; a backend
        that excludes peers that keep failing rounds counts it against them."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group and release sockets and threads."""

    @abstractmethod
    def load_committed_step(self, step: int) -> None:
        """On resume from a checkpoint: the rounds this worker has committed, so the group
        neither heals it (it is up to date) nor heals others from a stale count."""

    @property
    def maddrs(self) -> list[str]:
        """Addresses another peer passes to join this one directly (hivemind: this peer's
        multiaddrs, its ``initial_peers``); none where peers meet at a coordinator (torchft's
        Lighthouse) or in one process."""
        return []

    def register_state(self, get_state, set_state) -> None:  # noqa: ANN001 - callables
        """State a lagging or new peer receives from a live one (params, outer optimizer)."""
        self._get_state, self._set_state = get_state, set_state


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one worker sends in a ring all-reduce of ``nbytes``: reduce-scatter + all-gather."""
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * nbytes) // world_size


def ring_allgather_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one worker sends in a ring all-gather where each peer contributes ``nbytes``."""
    return max(world_size - 1, 0) * nbytes
