"""The healing policy (farlink.robust.heal) and the exclusion of peers that keep failing rounds
(farlink.robust.strikes): pure decisions, every member of a group computes the same ones."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from farlink.robust.heal import (
    first_non_finite,
    group_round,
    implausible,
    max_rounds_ahead,
    parse_announcement,
    plan_catch_up,
    plan_heal,
    state_fingerprint,
)
from farlink.robust.strikes import Strikes


def test_the_group_round_is_the_most_announced_not_the_highest() -> None:
    assert group_round([7, 7, 7, 10000]) == 7
    assert group_round([7, 8]) == 8  # a tie: the higher (a member left out of a round is 1 behind)
    assert group_round([3, 3, 9, 9, 9]) == 9
    assert group_round([0, 0]) == 0


def test_founders_at_round_0_outvote_a_far_claim_and_newcomers_do_not_count() -> None:
    founders = ["a" * 16, "a" * 16]  # the run's initial state, announced
    # the start of a run: two founders and a member claiming round 10000
    assert group_round([0, 0, 10000], [*founders, "f" * 16]) == 0
    # newcomers in their join round announce no fingerprint: they never roll a veteran back
    assert group_round([0, 0, 5], [None, None, "b" * 16]) == 5
    assert plan_heal([0, 0, 5], [None, None, "b" * 16], servers=[0, 1, 2]).behind == [0, 1]
    # a lone founder and a far claim tie: the higher wins (nothing tells them apart)
    assert group_round([0, 10000], ["a" * 16, "f" * 16]) == 10000


def test_a_member_ahead_of_the_group_heals_to_it_and_is_no_source() -> None:
    plan = plan_heal([4, 4, 4, 10000], ["a" * 16] * 3 + ["f" * 16], servers=[0, 1, 2, 3])
    assert plan.round_id == 4 and plan.behind == [3] and plan.sources == [0, 1, 2]
    assert plan.expected == {0: "a" * 16, 1: "a" * 16, 2: "a" * 16}


def test_sources_sharing_the_most_common_fingerprint_come_first() -> None:
    # Moshpit: three members at round 5 with two states; the newcomer heals from the pair's
    plan = plan_heal([5, 5, 5, 0], ["b" * 16, "a" * 16, "a" * 16, None], servers=[0, 1, 2, 3])
    assert plan.behind == [3] and plan.sources == [1, 2, 0]
    # members at the group's round with other states are not behind (the sync layer mixes them)
    assert 0 not in plan.behind
    # client-mode members serve nothing
    assert plan_heal([5, 5, 0], ["a" * 16] * 2 + [None], servers=[1, 2]).sources == [1]


def test_members_behind_fetch_the_majority_state_when_the_first_route_brought_another() -> None:
    # three honest members at 5, a member claiming 10000, a newcomer and one that missed a round;
    # torchft brought the two behind the claimer's state
    rounds = [5, 10000, 5, 0, 4, 5]
    prints = ["a" * 16, "x" * 16, "a" * 16, None, "b" * 16, "a" * 16]
    fetched = [None, None, None, (10000, "x" * 16), (10000, "x" * 16), None]
    plan = plan_catch_up(rounds, prints, fetched)
    assert plan is not None and plan.round_id == 5 and plan.fingerprint == "a" * 16
    assert plan.receivers == [3, 4] and plan.sources == [0, 2, 5]
    assert plan_catch_up(rounds, prints, fetched, limit=2).sources == [0, 2]
    # one member at 5 announcing other weights is never a source
    assert plan_catch_up([5, 5, 5, 0], ["c" * 16, "a" * 16, "a" * 16, None],
                         [None] * 3 + [(5, "c" * 16)]).sources == [1, 2]


def test_nobody_catches_up_when_the_first_route_brought_the_group_state() -> None:
    prints = ["a" * 16, "a" * 16, None]
    assert plan_catch_up([5, 5, 0], prints, [None, None, (5, "a" * 16)]) is None
    assert plan_catch_up([5, 5, 5], ["a" * 16] * 3, [None] * 3) is None
    assert plan_catch_up([0, 0], [None, None], [None, None]) is None
    # a claimer alone with a newcomer holds the group's round: nothing else to fetch
    assert plan_catch_up([10000, 0], ["x" * 16, None], [None, (10000, "x" * 16)]) is None
    # a member ahead of the group's round is no receiver, a malformed announcement (-1) neither
    assert plan_catch_up([5, 5, 9, -1], ["a" * 16] * 3 + [None], [None] * 4) is None


def test_plausibility_bounds_a_jump_by_the_time_since_the_last_commit() -> None:
    assert max_rounds_ahead(10.0, None) is None  # never timed a round: a newcomer
    assert max_rounds_ahead(10.0, 1.0) == 22
    assert implausible(5 + 22, 5, 10.0, 1.0) is None
    why = implausible(10000, 5, 10.0, 1.0)
    assert why is not None and "10000" in why and "9995 rounds" in why
    assert implausible(10000, 0, 10.0, None) is None
    assert implausible(3, 9, 0.0, 1.0) is None  # back to the group's round: always


def test_fingerprint_ignores_the_schedule_and_the_seal_but_not_the_weights() -> None:
    from farlink.sync.digest import with_digest

    state = {"global.w": torch.arange(4.0), "schedule.inner_steps": torch.tensor(10)}
    later = {**state, "schedule.inner_steps": torch.tensor(17)}
    assert state_fingerprint(state) == state_fingerprint(later) == state_fingerprint(with_digest(state))
    assert state_fingerprint({**state, "global.w": torch.arange(4.0) + 1}) != state_fingerprint(
        state)
    assert len(state_fingerprint(state)) == 16


def test_a_state_with_a_nan_or_inf_is_named() -> None:
    ok = {"a": torch.ones(3), "n": torch.tensor(3)}
    assert first_non_finite(ok) is None
    assert first_non_finite({**ok, "b": torch.tensor([1.0, math.nan])}) == "b"
    assert first_non_finite({**ok, "c": torch.tensor([math.inf], dtype=torch.float16)}) == "c"


def test_well_formed_metadata_parses_and_malformed_fields_raise_value_error_only() -> None:
    raw = msgpack.unpackb(msgpack.packb([3, 0, 1.5, [], "0123456789abcdef"]))
    a = parse_announcement(raw)
    assert (a.round_id, a.client, a.bandwidth, a.endpoints, a.fingerprint) == (
        3, False, 1.5, [], "0123456789abcdef")
    assert parse_announcement([3, 1, 2]).fingerprint is None  # fields after bandwidth optional
    for bad in ([3, 0, "fast"], [3, 0, math.nan], [3, 0, -1.0], ["3", 0, 1.0], [-1, 0, 1.0],
                [3, 2, 1.0], [3, 0, 1.0, "x"], [3, 0, 1.0, [], "not-hex"], [3, 0], "junk", None,
                {"round": 3}, [True, 0, 1.0], [3, 0, 1.0, [[b"id", "maddr"]]]):
        with pytest.raises(ValueError):
            parse_announcement(bad)


def test_a_peer_failing_consecutive_rounds_is_excluded_for_a_while() -> None:
    now = [0.0]
    strikes = Strikes(after=3, seconds=100.0, clock=lambda: now[0])
    assert strikes.round_done(failed=["x", "y"], fine=["a"]) == []
    assert strikes.round_done(failed=["x"], fine=["y"]) == []  # y did its part: count reset
    assert strikes.round_done(failed=["x", "y"], fine=[]) == ["x"]
    assert strikes.excluded("x") and not strikes.excluded("y")
    now[0] = 99.0
    assert strikes.excluded("x")
    now[0] = 100.0
    assert not strikes.excluded("x")  # served its time
    assert strikes.round_done(failed=["x"], fine=[]) == []  # and starts from a clean slate
    strikes.exclude("z")
    assert strikes.excluded("z")
