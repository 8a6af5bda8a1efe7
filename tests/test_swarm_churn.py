"""Churn in a real volunteer swarm: ``farlink swarm start`` and three ``farlink swarm join``
processes, each volunteer with a run dir and data cache of its own. One volunteer is SIGKILLed
(its whole process group, as when its machine loses power) mid-run; a newcomer arrives once its
shard claim has expired, takes that shard over and trains to the end. The audit across all four
run dirs must find every committed round in the survivors' one final state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from farlink.bench.churn_swarm import SwarmChurn


@pytest.mark.slow  # a bootstrap peer, four volunteers, a claim TTL to wait out: 2-3 min
def test_a_sigkilled_volunteers_shard_is_taken_over_and_no_committed_token_is_lost(
        tmp_path: Path) -> None:
    # one departure at round 17 of 60 (a quarter into an interval of 67 rounds at 1.5 per
    # 100); every inner step padded to 0.5 s so the newcomer, a claim TTL after the kill and a
    # slow start on busy cores later, still finds rounds to train
    driver = SwarmChurn(tmp_path, rounds=60, inner_steps=2, volunteers=3, rate=1.5,
                        model="nano", seed=1, timeout_s=900, pace_seconds=0.5)
    result = driver.run()
    kills = [e for e in result["events"] if e["event"] == "sigkill"]
    arrivals = [e for e in result["events"] if e["event"] == "arrive"]
    assert len(kills) == 1 and len(arrivals) == 4, result["events"]
    victim, newcomer = kills[0]["volunteer"], arrivals[-1]["volunteer"]
    assert arrivals[-1]["committed_round"] > kills[0]["committed_round"]
    with pytest.raises(ProcessLookupError):  # nothing of the killed volunteer lives on
        os.killpg(driver.procs[victim].pid, 0)

    audit = result["audit"]
    assert audit["departed"] == [victim]
    assert audit["survivors"] == sorted(set(driver.dirs) - {victim})
    assert all(result["exit_codes"][n] == 0 for n in audit["survivors"]), result["exit_codes"]
    assert audit["committed_rounds"] == 60 and audit["missing_rounds"] == []
    assert audit["divergent_rounds"] == {}
    assert audit["same_final_state"] and audit["consistent"]
    assert audit["lost_committed_tokens"] == 0
    # the newcomer trained the departed volunteer's shard on from its last committed position,
    # and its tokens went into committed rounds
    hand_over = audit["shard_hand_overs"][0]
    assert hand_over["picked_up_by"] == newcomer
    assert 1 <= hand_over["continued_from_round"] <= hand_over["last_committed_round"]
    mine = audit["volunteers"][newcomer]
    assert mine["shard"] == audit["volunteers"][victim]["shard"]
    assert mine["committed_tokens"] > 0 and mine["survived"]
    # 2 inner steps of 4 x 32 tokens: whatever a volunteer committed is whole rounds of it
    assert all(v["committed_tokens"] % 256 == 0 for v in audit["volunteers"].values())
