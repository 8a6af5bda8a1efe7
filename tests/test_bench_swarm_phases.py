"""Where a hivemind round's time goes: the per-round phases ``bench swarm`` reports, from the
cumulative ``phases_s`` a worker's sync records carry (worked out by hand)."""

from __future__ import annotations

from farlink.bench.swarm import round_phases


def sync(rounds_s: float, committed: bool = True, **phases: float) -> dict:
    return {"kind": "sync", "committed": committed, "rounds_s": rounds_s, "phases_s": phases}


def test_phases_are_per_round_means_after_the_first_round_with_the_rest_of_the_round() -> None:
    records = [
        {"kind": "join"},
        sync(3.0, matchmaking=2.0, all_gather=0.5, commit=0.2),  # the first: not timed
        sync(5.0, matchmaking=2.1, all_gather=1.5, commit=0.5),  # +2.0: 0.1, 1.0, 0.3, rest 0.6
        {"kind": "step"},
        sync(7.0, committed=False, matchmaking=2.2, all_gather=2.0, commit=0.9),  # failed
        sync(10.0, matchmaking=2.3, all_gather=3.0, commit=1.1),  # +3.0: 0.1, 1.0, 0.2, rest 1.7
    ]
    assert round_phases(records) == {"matchmaking": 0.1, "all_gather": 1.0, "commit": 0.25,
                                     "rest": 1.15}


def test_a_backend_without_phases_reports_none() -> None:
    assert round_phases([{"kind": "sync", "committed": True, "rounds_s": 1.0}]) is None
