"""Where a hivemind round's time goes: the per-round phases ``bench swarm`` reports, from the
cumulative ``phases_s`` a worker's sync records carry (worked out by hand)."""

from __future__ import annotations

from farlink.bench.swarm import round_phases, round_uploads, transfer_ratios


def sync(rounds_s: float, committed: bool = True, **phases: float) -> dict:
    return {"kind": "sync", "committed": committed, "rounds_s": rounds_s, "phases_s": phases,
            "outer_step": int(rounds_s)}


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


def test_each_round_is_compared_with_the_largest_upload_of_the_round_over_the_uplink() -> None:
    def sent(step: int, total: int, committed: bool = True) -> dict:
        return {"kind": "sync", "committed": committed, "outer_step": step, "bytes_sent": total,
                "round_s": 9.0}

    server = [{"kind": "join", "outer_step": 1}, sent(2, 20_000_000), sent(3, 35_000_000),
              sent(4, 50_000_000)]
    client = [{"kind": "join", "outer_step": 1}, sent(2, 8_000_000), sent(3, 12_000_000),
              sent(4, 14_000_000, committed=False)]
    # the first sync record also holds the joining round: no bytes for round 2
    assert round_uploads(server) == {3: 15_000_000, 4: 15_000_000}
    assert round_uploads(client) == {3: 4_000_000}
    # round 3: the server's 15 MB at 50 Mbit/s = 2.4 s; round 4: the client's bytes unknown
    rows = transfer_ratios({2: 5.0, 3: 3.0, 4: 2.6}, [round_uploads(server),
                                                      round_uploads(client)], up_mbit=50.0)
    assert rows == [{"outer_step": 3, "round_s": 3.0, "transfer_s": 2.4, "ratio": 1.25}]
