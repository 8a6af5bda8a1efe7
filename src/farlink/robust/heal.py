"""Which state a group adopts when its members are at different rounds (healing), decided alike by
every member from what each announced, so no single member can impose its own.

A member's round and state fingerprint are self-announced: a member that claims round 10000 and
serves any weights must not be followed because it claims the most. So:

* **the group's round** is the committed round announced by the most members (ties: the higher
  round); members at round 0 (never committed: newcomers) hold nothing anyone adopts and count
  only when nobody committed anything. A member at any other round, behind *or ahead*, heals to
  the group's round: a member announcing round 10000 among three at round r gets nothing;
* **the sources** are the members that announced the group's round and accept connections, the
  ones whose ``(round, fingerprint)`` the most members share first (Moshpit groups may hold
  several states for one round: the fingerprint picks sources, it never makes a member at the
  group's round behind);
* **the state adopted** must hash to the fingerprint its sources announced in matchmaking (not
  what a source sends with it) and be finite (no NaN/Inf in any float tensor);
* **plausibility**: a member that has committed rounds refuses to heal more than
  :func:`max_rounds_ahead` rounds forward: ``slack + margin * elapsed / shortest`` where
  ``elapsed`` is the time since its last commit and ``shortest`` the shortest time between two
  of its commits (rounds of one run take about as long everywhere, so an honest group cannot
  have run twice as many rounds as could fit in the time, plus two).

A member that refuses a heal fails the round (it votes no) and names the source and its claim.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: a fingerprint is this many hex digits of the state's SHA-256 (as ``SyncAlgorithm.fingerprint``)
FINGERPRINT_HEX = 16


def state_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """What a member announces of its committed state: the SHA-256 of names, dtypes, shapes and
    bytes (:func:`farlink.sync.digest.state_digest`) without the schedule (a member's place in its
    inner steps when it looks for a group) and without a transfer's integrity digest, so members
    that hold one committed state announce one fingerprint."""
    from farlink.sync.digest import state_digest

    kept = {k: v for k, v in state.items() if not k.startswith("integrity.")}
    return state_digest(kept).hex()[:FINGERPRINT_HEX]


def first_non_finite(state: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an Inf, or None."""
    for name, tensor in sorted(state.items()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def group_round(rounds: Sequence[int], fingerprints: Sequence[str | None] | None = None) -> int:
    """The round most members announced (ties: the higher). Round 0 counts for the members that
    announced a fingerprint (the founders of a run, holding its initial state), not for a
    newcomer in its join round, which announces none: it has nothing to keep. So a member
    claiming a far round is outvoted by the founders it starts with, and a veteran is not rolled
    back by newcomers that outnumber it. Without fingerprints every round 0 counts as held."""
    if fingerprints is None:
        fingerprints = [""] * len(rounds)
    held = [r for r, f in zip(rounds, fingerprints) if r > 0 or (r == 0 and f is not None)]
    if not held:
        return 0
    counts = Counter(held)
    return max(counts, key=lambda r: (counts[r], r))


@dataclass(frozen=True)
class HealPlan:
    """What every member of a group concludes from the same announcements."""

    round_id: int
    behind: list[int]  # members that must adopt the group's state (behind or ahead of it)
    sources: list[int]  # members to fetch it from, most-shared fingerprint first
    expected: dict[int, str | None]  # the fingerprint each source announced


def plan_heal(rounds: Sequence[int], fingerprints: Sequence[str | None],
              servers: Sequence[int]) -> HealPlan:
    """The group's round, who heals, and from whom (see the module docstring). ``servers``: the
    members that accept connections (only they can serve state)."""
    round_id = group_round(rounds, fingerprints)
    behind = [r for r, held in enumerate(rounds) if held != round_id]
    holders = [r for r in servers if rounds[r] == round_id]
    shared = Counter(fingerprints[r] for r in range(len(rounds)) if rounds[r] == round_id)
    # the most-shared fingerprint first; among equals the member order, which all members share
    sources = sorted(holders, key=lambda r: -shared[fingerprints[r]])
    return HealPlan(round_id, behind, sources, {r: fingerprints[r] for r in sources})


def max_rounds_ahead(elapsed: float, shortest_round: float | None, margin: float = 2.0,
                     slack: int = 2) -> int | None:
    """How many rounds past its own a member that last committed ``elapsed`` seconds ago may
    heal to: ``slack + margin * elapsed / shortest_round``; None (no bound) when it has never
    timed a round (a newcomer, which has nothing of its own to keep)."""
    if shortest_round is None or shortest_round <= 0 or not math.isfinite(elapsed):
        return None
    return slack + int(margin * max(0.0, elapsed) / shortest_round)


def implausible(target: int, mine: int, elapsed: float, shortest_round: float | None) -> str | None:
    """Why healing from round ``mine`` to ``target`` cannot be honest, or None if it can be."""
    bound = max_rounds_ahead(elapsed, shortest_round)
    if bound is None or target - mine <= bound:
        return None
    return (f"round {target} is {target - mine} rounds past this member's {mine}, more than the "
            f"{bound} that fit in the {elapsed:.0f} s since its last commit (shortest round "
            f"{shortest_round:.1f} s)")


@dataclass(frozen=True)
class Announcement:
    """What a member put in its matchmaking metadata, checked field by field."""

    round_id: int
    client: bool
    bandwidth: float
    endpoints: list
    fingerprint: str | None


def parse_announcement(raw: object) -> Announcement:
    """A member's matchmaking metadata ``[round, client, bandwidth, endpoints?, fingerprint?]``,
    or ValueError saying what is wrong with it (a field of the wrong type, a negative or
    non-finite number): never an exception of another kind."""
    if not isinstance(raw, (list, tuple)) or len(raw) < 3:
        raise ValueError(f"metadata is not a list of at least 3 fields: {raw!r:.80}")
    round_id, client, bandwidth = raw[0], raw[1], raw[2]
    if not isinstance(round_id, int) or isinstance(round_id, bool) or not 0 <= round_id < 2**62:
        raise ValueError(f"round {round_id!r:.40} is not a round number")
    if not isinstance(client, (int, bool)) or client not in (0, 1):
        raise ValueError(f"client mode {client!r:.40} is not 0 or 1")
    if not isinstance(bandwidth, (int, float)) or isinstance(bandwidth, bool) \
            or not math.isfinite(bandwidth) or bandwidth <= 0:
        raise ValueError(f"bandwidth {bandwidth!r:.40} is not a positive finite number")
    endpoints = raw[3] if len(raw) > 3 else []
    if not isinstance(endpoints, list) or not all(
            isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], bytes)
            and isinstance(e[1], (list, tuple)) and all(isinstance(m, str) for m in e[1])
            for e in endpoints):
        raise ValueError("replica group endpoints are not [[peer id bytes, [multiaddrs]], ...]")
    fingerprint = raw[4] if len(raw) > 4 else None
    if fingerprint is not None and not (
            isinstance(fingerprint, str) and len(fingerprint) == FINGERPRINT_HEX
            and all(c in "0123456789abcdef" for c in fingerprint)):
        raise ValueError(f"state fingerprint {fingerprint!r:.40} is not {FINGERPRINT_HEX} hex "
                         "digits")
    return Announcement(round_id, bool(client), float(bandwidth), list(endpoints), fingerprint)


@dataclass(frozen=True)
class CatchUp:
    """Members that must fetch the group's state by a second route, and from whom."""

    round_id: int
    fingerprint: str
    receivers: list[int]
    sources: list[int]


def plan_catch_up(rounds: Sequence[int], fingerprints: Sequence[str | None],
                  fetched: Sequence[tuple[int, str] | None], limit: int = 3) -> CatchUp | None:
    """Who fetches the group's state again when the first route brought another (torchft heals
    every replica below the highest *claimed* step from the replica claiming it, so one member
    claiming step 10000 would otherwise keep every member that is behind from ever healing).

    ``fetched[r]``: the (round, fingerprint) of the state member ``r`` received by the first
    route, or None. The receivers are the members behind the group's round (:func:`plan_heal`)
    that did not receive the group's round with its most-shared fingerprint; the sources are the
    first ``limit`` members at that round announcing that fingerprint (several, so a source that
    serves other bytes than it announced costs a retry, not the heal). None when nobody needs it.
    """
    plan = plan_heal(rounds, fingerprints, range(len(rounds)))
    expected = plan.expected[plan.sources[0]] if plan.sources else None
    if plan.round_id <= 0 or expected is None:
        return None
    wanted = (plan.round_id, expected)
    receivers = [r for r, held in enumerate(rounds)
                 if 0 <= held < plan.round_id and fetched[r] != wanted]
    if not receivers:
        return None
    sources = [r for r in plan.sources if fingerprints[r] == expected][:limit]
    return CatchUp(plan.round_id, expected, receivers, sources)
