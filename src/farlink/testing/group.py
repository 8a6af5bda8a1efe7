"""An in-process group whose members can be lost and come back healed.

:class:`farlink.comm.inprocess.InProcessGroup` is a fixed set of threads: a member that stops
leaves the others waiting forever. Here membership changes at round boundaries, as in torchft's
quorum: ``lose(member)`` takes a member out (mid-round, the round fails on every survivor and
commits nowhere; their collectives never raise, as the :class:`~farlink.comm.base.Collective`
contract asks), and a member that calls ``begin_round`` again is let in at the survivors' next
``begin_round`` (``rejoin(member)`` makes that round wait for it) and healed there from the
member with the most committed rounds.
"""

from __future__ import annotations

import threading

from farlink.comm.base import LinkModel, RoundInfo
from farlink.comm.errors import CommError
from farlink.comm.inprocess import InProcessCollective, InProcessGroup

__all__ = ["HealingGroup", "HealingMember", "MemberLost"]


class MemberLost(CommError):
    """A member of the round was lost before it took part in an exchange."""


class HealingGroup(InProcessGroup):
    """``size`` members that meet at every ``begin_round``; ``member(i)`` keeps its id ``i``
    for life, its rank is its place among the members of the current round."""

    def __init__(self, size: int, link: LinkModel | None = None,
                 timeout: float = 60.0) -> None:
        super().__init__(size, link)
        self._members = [HealingMember(self, i) for i in range(size)]
        self.timeout = timeout
        self.live: set[int] = set(range(size))
        self.round_members: list[int] = list(range(size))  # ids, in rank order
        self._waiting: set[int] = set()  # at the gate of the next round
        self._values: dict[int, dict[int, object]] = {}  # exchange number -> id -> value
        self._generation = 0
        self._cond = threading.Condition()

    def lose(self, member: int) -> None:
        """Take ``member`` out now: a round under way fails on every survivor."""
        with self._cond:
            self.live.discard(member)
            self._waiting.discard(member)
            self._open_gate()
            self._cond.notify_all()

    def rejoin(self, member: int) -> None:
        """Expect ``member`` back (called between rounds): the next round waits for it. A lost
        member that just calls ``begin_round`` is let in at whichever round start it reaches."""
        with self._cond:
            self.live.add(member)

    def gate(self, member: int) -> None:
        """Wait until every live member (and any member coming back) reached this round's
        start; then the round's membership and ranks are fixed."""
        with self._cond:
            self._waiting.add(member)
            generation = self._generation
            self._open_gate()
            if not self._cond.wait_for(lambda: self._generation != generation, self.timeout):
                raise TimeoutError(f"member {member}: the group did not meet within "
                                   f"{self.timeout:.0f} s")

    def _open_gate(self) -> None:
        if not self._waiting or not self.live <= self._waiting:
            return
        self.live |= self._waiting
        self._waiting = set()
        self.round_members = sorted(self.live)
        self.size = len(self.round_members)
        self._values = {}
        for member in self._members:
            member.rank = (self.round_members.index(member.id) if member.id in self.live
                           else -1)
            member.exchanges = 0
        self._generation += 1
        self._cond.notify_all()

    def exchange(self, rank: int, value: object) -> list[object]:
        """Every round member's ``value`` for this exchange, in rank order; MemberLost when a
        member of the round was lost before it gave its value."""
        member = self._members[self.round_members[rank]]
        with self._cond:
            number = member.exchanges
            member.exchanges += 1
            values = self._values.setdefault(number, {})
            values[member.id] = value
            self._cond.notify_all()

            def settled() -> bool:
                return all(m in values or m not in self.live for m in self.round_members)

            if not self._cond.wait_for(settled, self.timeout):
                raise TimeoutError(f"member {member.id}: exchange {number} unanswered")
            if any(m not in values for m in self.round_members):
                raise MemberLost(f"a member of the round was lost before exchange {number}")
            return [values[m] for m in self.round_members]


class HealingMember(InProcessCollective):
    """An in-process member whose collectives record a lost peer as the round's failure."""

    def __init__(self, group: HealingGroup, member: int) -> None:
        super().__init__(group, member)
        self.id = member
        self.exchanges = 0  # exchanges of the current round so far

    def begin_round(self, final: bool = False, **round_options) -> RoundInfo:  # noqa: ANN003
        self.group.gate(self.id)
        self.failure = None
        return super().begin_round(final, **round_options)

    def _lost(self) -> bool:
        """A member of this round was lost: its exchanges cannot meet any more. Any other
        failure (one a test injects through ``fail_round``) fails the round at its commit,
        and the member still takes part in the round's exchanges, as its peers wait for it."""
        return isinstance(self.failure, MemberLost)

    def all_reduce_sum(self, tensors: list) -> None:
        if not self._lost():
            try:
                super().all_reduce_sum(tensors)
            except MemberLost as exc:
                self.failure = exc

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        if not self._lost():
            try:
                return super().all_gather_bytes(payload)
            except MemberLost as exc:
                self.failure = exc
        return [payload] * self.group.size

    def commit(self) -> bool:
        if self._lost():  # the others cannot meet it either: each fails the round on its own
            self.failure = None
            self.stats.failed_rounds += 1
            return False
        try:
            return super().commit()
        except MemberLost:
            self.stats.failed_rounds += 1
            return False
