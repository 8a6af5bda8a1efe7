"""Peers as threads of one process: the collective interface without sockets.

Used for single-process runs (one member), for fast, exact tests of the outer algorithms with
several members, and as the transport of in-process link emulation (an optional ``link`` delays
each collective by ``latency + bytes / bandwidth``). Byte accounting follows the same ring
formulas as the network backends, so numbers are comparable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from farlink.comm.base import (
    Collective,
    LinkModel,
    RoundInfo,
    ring_allgather_bytes,
    ring_allreduce_bytes,
)

__all__ = ["DrivenGroup", "DrivenMember", "InProcessCollective", "InProcessGroup", "LinkModel"]

T = TypeVar("T")


class LeavingBarrier:
    """:class:`threading.Barrier` whose parties can leave: a member that dies (``close``) stops
    being waited for, as a network backend stops waiting for a peer whose connection is gone,
    so the live members' collectives go on without it."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self._cond = threading.Condition()
        self._count = self._generation = 0
        self._broken = False

    def wait(self, timeout: float | None = None) -> None:
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._count += 1
            if self._count >= self.parties:
                self._release()
                return
            if not self._cond.wait_for(lambda: generation != self._generation or self._broken,
                                       timeout):
                self._broken = True
                self._cond.notify_all()
            if generation == self._generation:
                raise threading.BrokenBarrierError

    def _release(self) -> None:
        self._count, self._generation = 0, self._generation + 1
        self._cond.notify_all()

    def leave(self) -> None:
        """One party is gone for good; those it held back go on."""
        with self._cond:
            self.parties -= 1
            if self._count and self._count >= self.parties:
                self._release()

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()


class InProcessGroup:
    """Shared rendezvous for ``size`` members; ``member(i)`` is rank i's collective.

    Membership is fixed: a member that closes (dies) leaves an empty slot (``None``, or
    ``b""`` in byte collectives) that the live members see for the rest of the group's life;
    :class:`DrivenGroup` is the form whose driver re-forms rounds without it."""

    def __init__(self, size: int, link: LinkModel | None = None) -> None:
        self.size = size
        self.link = link
        self.barrier = LeavingBarrier(size)
        self.departed: set[int] = set()
        self._wire_lock = threading.Lock()
        self._wire_free_at = 0.0  # a shared link: when it finishes what is queued on it
        self.slots: list[object] = [None] * size
        self.round = 0
        self.shared_state: dict | None = None
        self._members = [InProcessCollective(self, i) for i in range(size)]

    def member(self, rank: int) -> InProcessCollective:
        return self._members[rank]

    def run(self, fn: Callable[[int, InProcessCollective], T], timeout: float = 60.0) -> list[T]:
        """``fn(rank, member)`` for every member, each in its own thread; their results in rank
        order. The first failure aborts the rendezvous (so no member waits forever on a dead
        one) and is re-raised here."""
        results: list = [None] * self.size
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.member(rank))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"in-process members still running after {timeout:.0f}s")
        return results

    def exchange(self, rank: int, value: object) -> list[object]:
        self.barrier.wait()
        self.slots[rank] = value
        self.barrier.wait()
        values = [None if r in self.departed else v for r, v in enumerate(self.slots)]
        self.barrier.wait()
        return values

    def leave(self, rank: int) -> None:
        """Member ``rank`` is gone: its slot stays empty, nobody waits for it."""
        if rank not in self.departed:
            self.departed.add(rank)
            self.barrier.leave()


class InProcessCollective(Collective):
    def __init__(self, group: InProcessGroup, rank: int) -> None:
        super().__init__()
        self.group, self.rank = group, rank
        self.committed_rounds = 0
        self._get_state = self._set_state = None
        self.failure: Exception | None = None  # why this member failed the current round

    def begin_round(self, final: bool = False, *, joining: bool = False,
                    timeout: float | None = None, tag: str | None = None) -> RoundInfo:
        # one group that every member meets (final is moot), without timeouts or fingerprints
        held = self.group.exchange(self.rank, (self.committed_rounds, tag))
        steps = [None if h is None else h[0] for h in held]
        healed = False
        leader = max((r for r in range(self.group.size) if steps[r] is not None),
                     key=lambda r: steps[r])
        states = self.group.exchange(
            self.rank, self._get_state() if self.rank == leader and self._get_state else None
        )
        if steps[self.rank] < steps[leader] and self._set_state is not None:
            self._set_state(states[leader])
            self.committed_rounds = steps[leader]
            healed = True
        tags = [h[1] for h in held if h is not None and h[0] == steps[leader]]
        return RoundInfo(self.committed_rounds, self.rank, self.group.size, healed, tags=tags)

    @property
    def emulated_link(self) -> LinkModel | None:
        """The group's link: every member of an in-process group shares the one it was built
        with (``InProcessGroup(n, link)``)."""
        return self.group.link

    def _delay(self, nbytes: int, hops: int) -> None:
        link = self.group.link
        if link is None:
            return
        began = time.perf_counter()
        if not link.shared:
            time.sleep(link.seconds(nbytes, hops))
        else:
            group = self.group
            with group._wire_lock:  # the members' bytes queue on one wire, as on a shared link
                group._wire_free_at = max(began, group._wire_free_at) + \
                    nbytes / link.bandwidth_bytes_per_s
                done = group._wire_free_at
            time.sleep(max(0.0, done + hops * link.latency_s - time.perf_counter()))
        self.stats.emulated_seconds += time.perf_counter() - began

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        n = self.group.size
        for tensor in tensors:
            values = self.group.exchange(self.rank, tensor.detach().clone())
            total = torch.stack([v for v in values]).sum(0)
            tensor.copy_(total)
            sent = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), n)
            self.stats.bytes_sent += sent
            self.stats.collectives += 1
            self._delay(sent, 2 * (n - 1))

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        n = self.group.size
        values = self.group.exchange(self.rank, bytes(payload))
        sent = ring_allgather_bytes(len(payload), n)
        self.stats.bytes_sent += sent
        self.stats.collectives += 1
        self._delay(sent, n - 1)
        return [b"" if v is None else v for v in values]

    native_all_to_all = True
    survives_departures = True

    def round_members(self) -> int:
        return self.group.size

    def round_rank(self) -> int:
        return self.rank

    def all_to_all_bytes(self, outgoing: list[bytes]) -> list[bytes]:
        n = self.group.size
        if len(outgoing) != n:
            raise ValueError(f"all-to-all of {len(outgoing)} messages in a round of {n}")
        rows = self.group.exchange(self.rank, [bytes(m) for m in outgoing])
        sent = sum(len(outgoing[j]) for j in range(n) if j != self.rank)
        self.stats.bytes_sent += sent
        self.stats.collectives += 1
        self._delay(sent, 1)  # every message leaves at once: one latency, the upload's bytes
        return [b"" if rows[k] is None else rows[k][self.rank] for k in range(n)]

    def fail_round(self, error: Exception, blame=()) -> None:  # noqa: ANN001 - ranks
        self.failure = error

    def commit(self) -> bool:
        """Every member's verdict on the round: it commits only where none failed it."""
        failures = self.group.exchange(self.rank, self.failure)
        self.failure = None
        if any(f is not None for f in failures) or self.rank in self.group.departed:
            return False
        self.committed_rounds += 1
        return True

    def close(self) -> None:
        """Leave the group (a member that dies): the others stop waiting for it."""
        self.group.leave(self.rank)

    def load_committed_step(self, step: int) -> None:
        self.committed_rounds = step


class DrivenGroup:
    """In-process members whose driver picks each round's members (``form``) between rounds.

    A pipeline's trainer holds one member per peer of a stage; a round takes only the peers
    whose weights arrived usable, so a dead or broken peer is simply not formed into the round
    (a fixed :class:`InProcessGroup` would wait on it, or count it). Each round runs on a fresh
    :class:`InProcessGroup` of the members formed; a member keeps its committed rounds and its
    byte counts across rounds, and one that missed rounds is healed at its next round's start
    from the member with the most committed rounds, as in every backend."""

    def __init__(self, size: int, link: LinkModel | None = None) -> None:
        self.size, self.link = size, link
        self._members = [DrivenMember(self, i) for i in range(size)]
        self._round: InProcessGroup | None = None
        self._ranks: dict[int, int] = {}  # member id -> rank in the formed round

    def member(self, member: int) -> DrivenMember:
        return self._members[member]

    def form(self, members: list[int]) -> None:
        """The next round's members (ids, in rank order); called before any of them begins it."""
        if not members or any(not 0 <= m < self.size for m in members):
            raise ValueError(f"a round of members {members} in a group of {self.size}")
        self._round = InProcessGroup(len(members), self.link)
        self._ranks = {m: rank for rank, m in enumerate(members)}

    def run(self, fn: Callable[[int], T], timeout: float = 600.0) -> list[T]:
        """``fn(member)`` for every member of the formed round, each in its own thread (see
        :meth:`InProcessGroup.run`: the first failure aborts the round and is raised here)."""
        members = sorted(self._ranks, key=self._ranks.__getitem__)
        return self._round.run(lambda rank, _: fn(members[rank]), timeout)

    def collective_of(self, member: int) -> InProcessCollective:
        """``member``'s collective in the formed round."""
        if self._round is None or member not in self._ranks:
            raise RuntimeError(f"member {member} was not formed into this round")
        return self._round.member(self._ranks[member])


class DrivenMember(Collective):
    """One member of a :class:`DrivenGroup`: its collectives run on the formed round's group."""

    native_all_to_all = True
    survives_departures = True

    def __init__(self, group: DrivenGroup, member: int) -> None:
        super().__init__()
        self.group, self.id = group, member
        self.committed_rounds = 0
        self._get_state = self._set_state = None
        self._round_collective: InProcessCollective | None = None

    def begin_round(self, final: bool = False, *, joining: bool = False,
                    timeout: float | None = None, tag: str | None = None) -> RoundInfo:
        current = self._round_collective = self.group.collective_of(self.id)
        current.stats = self.stats  # the bytes this member sends, whichever round it was in
        current.committed_rounds = self.committed_rounds
        current.register_state(self._get_state, self._set_state)
        info = current.begin_round(final, tag=tag)
        self.committed_rounds = current.committed_rounds
        return info

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        self._round_collective.all_reduce_sum(tensors)

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        return self._round_collective.all_gather_bytes(payload)

    def all_to_all_bytes(self, outgoing: list[bytes]) -> list[bytes]:
        return self._round_collective.all_to_all_bytes(outgoing)

    def round_members(self) -> int:
        return self._round_collective.round_members()

    def round_rank(self) -> int:
        return self._round_collective.round_rank()

    def fail_round(self, error: Exception, blame=()) -> None:  # noqa: ANN001 - ranks
        self._round_collective.fail_round(error, blame)

    def commit(self) -> bool:
        committed = self._round_collective.commit()
        self.committed_rounds = self._round_collective.committed_rounds
        return committed

    def close(self) -> None:
        pass

    def load_committed_step(self, step: int) -> None:
        self.committed_rounds = step
