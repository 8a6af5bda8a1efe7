"""Excluding, for a while, a peer that keeps making rounds fail.

A member that always votes no (or never votes, or serves a state that is refused, or announces
malformed metadata) would stop every round of every group it is in, forever: nothing in the
round itself can outvote it. Each member keeps its own count: a peer that made ``after``
consecutive rounds of this member fail is excluded from this member's groups for ``seconds``
(its join requests are refused, and this member does not join it), then gets a clean slate. A
round it takes part in without failing resets its count. Every member decides for itself, from
what it saw; members of one group see the same votes, so they exclude the same peer together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class Strikes:
    """Consecutive failed rounds per peer (any hashable id), and who is excluded until when."""

    def __init__(self, after: int = 3, seconds: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if after < 1 or seconds <= 0:
            raise ValueError("exclude after >= 1 failed round, for a positive time")
        self.after, self.seconds, self.clock = after, seconds, clock
        self.count: dict[object, int] = {}
        self.until: dict[object, float] = {}

    def round_done(self, failed: Iterable[object], fine: Iterable[object]) -> list[object]:
        """Count one round: ``failed`` made it fail, ``fine`` did their part. Returns the peers
        excluded by this round (each at its ``after``-th consecutive failure)."""
        for peer in fine:
            self.count.pop(peer, None)
        excluded = []
        for peer in failed:
            self.count[peer] = self.count.get(peer, 0) + 1
            if self.count[peer] >= self.after:
                excluded.append(peer)
                self.exclude(peer)
        return excluded

    def exclude(self, peer: object) -> None:
        """Exclude ``peer`` now, whatever its count (e.g. metadata no honest peer sends)."""
        self.until[peer] = self.clock() + self.seconds
        self.count.pop(peer, None)

    def excluded(self, peer: object) -> bool:
        until = self.until.get(peer)
        if until is None:
            return False
        if self.clock() >= until:  # served its time: a clean slate
            del self.until[peer]
            return False
        return True
