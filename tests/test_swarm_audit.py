"""The community-run audit across volunteers' own run dirs, on metrics written as a volunteer's
worker writes them (``MetricsLog``), with every figure worked out by hand.

The swarm: volunteers a, b, c start together; 2 inner steps of 128 tokens per round, so a
volunteer that averages a round commits 256 tokens. Round 1 is the join round (no tokens).
Rounds 2-4: a, b, c. c is SIGKILLed two inner steps after round 4 (256 tokens never committed).
Round 5: a and b; b was behind and healed (its 256 tokens since round 4 are discarded).
d arrives, takes c's shard over from its position after round 4, joins at round 5.
Round 6: a, b, d. a, b and d end on round 6.
"""

from __future__ import annotations

import json
from pathlib import Path

from farlink.train.metrics import MetricsLog
from farlink.train.swarm_audit import audit_swarm

TOKENS_PER_ROUND = 256  # 2 inner steps x 128 tokens


def fp(round_id: int) -> str:
    return f"state-{round_id}"


def volunteer(root: Path, name: str, shard: int, join_round: int, rounds: list[int],
              joined_at: int = 1, healed: tuple[int, ...] = (), extra_steps: int = 0,
              end_round: int | None = None, end_fingerprint: str | None = None,
              took_over: int | None = None,
              fingerprints: dict[int, str] | None = None,
              groups: dict[int, str] | None = None) -> Path:
    """Write one volunteer's run dir: swarm.json and its worker's metrics."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "swarm.json").write_text(json.dumps({"shard": shard, "join_round": join_round}))
    log = MetricsLog(run_dir / "metrics" / f"w{shard}.jsonl")
    log.write("start", worker=f"w{shard}")
    if took_over is not None:
        log.write("data_position", worker=f"w{shard}", epoch=0, position=64, round=took_over)
    fingerprints = fingerprints or {}
    log.write("join", committed=True, healed=joined_at > 1, outer_step=joined_at,
              fingerprint=fingerprints.get(joined_at, fp(joined_at)), world_size=3)
    tokens = 0
    for r in rounds:
        for _ in range(2):
            tokens += 128
            log.write("step", step=0, tokens=tokens)
        log.write("sync", committed=True, healed=r in healed, outer_step=r, tokens=tokens,
                  fingerprint=fingerprints.get(r, fp(r)), world_size=3,
                  **({"group": groups[r]} if groups and r in groups else {}))
    for _ in range(extra_steps):
        tokens += 128
        log.write("step", step=0, tokens=tokens)
    if end_round is not None:
        log.write("end", finished=True, outer_step=end_round, tokens=tokens,
                  fingerprint=end_fingerprint or fp(end_round))
    log.close()
    return run_dir


def swarm(root: Path, **overrides) -> dict[str, Path]:
    specs = {
        "a": dict(shard=0, join_round=0, rounds=[2, 3, 4, 5, 6], end_round=6),
        "b": dict(shard=1, join_round=0, rounds=[2, 3, 4, 5, 6], healed=(5,), end_round=6),
        "c": dict(shard=2, join_round=0, rounds=[2, 3, 4], extra_steps=2),
        "d": dict(shard=2, join_round=5, rounds=[6], joined_at=5, end_round=6, took_over=4),
    }
    for name, changes in overrides.items():
        if changes is None:
            specs.pop(name)
        else:
            specs[name] = {**specs[name], **changes}
    return {name: volunteer(root, name, **spec) for name, spec in specs.items()}


def test_a_clean_churned_swarm_loses_nothing_and_every_figure_adds_up(tmp_path: Path) -> None:
    audit = audit_swarm(swarm(tmp_path))
    assert audit["committed_rounds"] == 6
    assert audit["missing_rounds"] == [] and audit["divergent_rounds"] == {}
    assert audit["survivors"] == ["a", "b", "d"] and audit["departed"] == ["c"]
    assert audit["same_final_state"] and audit["consistent"]
    assert audit["final_fingerprint"] == fp(6)
    # a: rounds 2-6; b: 2-4 and 6 (5 healed); c: 2-4; d: 6
    assert audit["volunteers"]["a"]["committed_tokens"] == 5 * TOKENS_PER_ROUND
    assert audit["volunteers"]["b"]["committed_tokens"] == 4 * TOKENS_PER_ROUND
    assert audit["volunteers"]["c"]["committed_tokens"] == 3 * TOKENS_PER_ROUND
    assert audit["volunteers"]["d"]["committed_tokens"] == TOKENS_PER_ROUND  # the newcomer's
    assert audit["committed_tokens"] == 13 * TOKENS_PER_ROUND
    assert audit["lost_committed_tokens"] == 0
    assert audit["discarded_tokens"] == TOKENS_PER_ROUND  # b's work replaced by healing
    assert audit["uncommitted_tokens_lost_with_departed"] == TOKENS_PER_ROUND  # c's last steps
    assert audit["shard_hand_overs"] == [{
        "departed": "c", "shard": 2, "last_committed_round": 4, "uncommitted_tokens_lost": 256,
        "picked_up_by": "d", "continued_from_round": 4, "rounds_of_data_trained_again": 0,
        "rounds_left": 2}]
    assert audit["all_departed_shards_picked_up"]


def test_an_heir_that_continues_from_an_older_position_trains_those_rounds_again(
        tmp_path: Path) -> None:
    # c's position after round 4 never reached the DHT: d starts from round 3's
    audit = audit_swarm(swarm(tmp_path, d={"took_over": 3}))
    assert audit["shard_hand_overs"][0]["rounds_of_data_trained_again"] == 1
    assert audit["lost_committed_tokens"] == 0 and audit["consistent"]


def test_two_states_under_one_round_number_lose_that_rounds_committed_tokens(
        tmp_path: Path) -> None:
    audit = audit_swarm(swarm(tmp_path, c={"fingerprints": {4: "other"}}))
    assert audit["divergent_rounds"] == {4: sorted([fp(4), "other"])}
    assert audit["lost_committed_tokens"] == 3 * TOKENS_PER_ROUND  # a, b and c committed round 4
    assert not audit["consistent"] and not audit["same_final_state"]


def test_moshpit_groups_apart_in_a_round_lose_nothing_but_one_group_apart_does(
        tmp_path: Path) -> None:
    """Groups smaller than the swarm commit one round with a state each (every record names
    its group); two states within one group still lose that round's tokens."""
    apart = audit_swarm(swarm(tmp_path / "apart", a={"groups": {4: "g1"}},
                              b={"groups": {4: "g1"}},
                              c={"groups": {4: "g2"}, "fingerprints": {4: "other"}}))
    assert apart["divergent_rounds"] == {} and apart["lost_committed_tokens"] == 0
    assert apart["consistent"] and apart["same_final_state"]
    one = audit_swarm(swarm(tmp_path / "one", a={"groups": {4: "g1"}}, b={"groups": {4: "g1"}},
                            c={"groups": {4: "g1"}, "fingerprints": {4: "other"}}))
    assert one["divergent_rounds"] == {4: sorted([fp(4), "other"])} and not one["consistent"]


def test_a_survivor_on_another_state_or_behind_is_caught(tmp_path: Path) -> None:
    other = audit_swarm(swarm(tmp_path / "other", d={"end_fingerprint": "elsewhere"}))
    assert not other["same_final_state"] and not other["consistent"]
    assert other["final_fingerprint"] is None
    behind = audit_swarm(swarm(tmp_path / "behind", a={"rounds": [2, 3, 4, 5, 6, 7]}))
    # round 7 was committed, yet the survivors' final state is round 6: a's round 7 is lost
    assert behind["committed_rounds"] == 7 and not behind["same_final_state"]
    assert behind["lost_committed_tokens"] == TOKENS_PER_ROUND


def test_a_gap_in_the_committed_rounds_and_an_orphaned_shard_are_reported(
        tmp_path: Path) -> None:
    gap = audit_swarm(swarm(tmp_path / "gap", a={"rounds": [2, 4, 5, 6]},
                            b={"rounds": [2, 4, 5, 6]}, c={"rounds": [2, 4]}))
    assert gap["missing_rounds"] == [3] and not gap["consistent"]
    orphan = audit_swarm(swarm(tmp_path / "orphan", d=None))
    assert orphan["shard_hand_overs"][0]["picked_up_by"] is None
    assert not orphan["all_departed_shards_picked_up"]
