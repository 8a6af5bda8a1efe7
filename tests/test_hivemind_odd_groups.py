"""Moshpit groups that the swarm does not divide into: 3 hivemind peers in groups of 2, through
``farlink train`` on loopback. One peer is always left out of a round; it skips that round's
averaging instead of waiting out the quorum timeout, and the run's last round is one group of
all three, so the run ends on one model."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from farlink.config import load_config
from farlink.train.audit import audit_run
from farlink.train.launcher import launch
from farlink.train.metrics import read_metrics


# replica groups of 2 ranks (rank 0 matchmakes for the replica group; every rank skips with it)
# take 6 processes; a time-budgeted run counts rounds, so a left-out peer must count the round it
# skipped; 5 peers form two groups a round, which commit one round number with different states,
# and the last round (one group of all five) must join them
# every shape is a whole `farlink train` run (slow): by default the same groups of two stand in
# on the collectives (test_the_left_out_peer_skips_...), Moshpit mixing in groups of two in
# test_moshpit_groups, and an end-to-end hivemind run in test_run_groups
@pytest.mark.parametrize("shape", [
    pytest.param({}, marks=pytest.mark.slow),
    pytest.param({"ranks_per_worker": 2}, marks=pytest.mark.slow, id="replica_groups"),
    pytest.param({"round_seconds": 1.0}, marks=pytest.mark.slow, id="timed"),
    pytest.param({"workers": 5}, marks=pytest.mark.slow, id="two-groups"),
])
def test_peers_in_groups_of_two_end_on_one_model(tmp_path: Path, cache_dir: Path,
                                                 shape: dict) -> None:
    workers = [f"w{i}" for i in range(shape.get("workers", 3))]
    # a short quorum timeout: a peer that waited for a group that cannot form would fail fast
    cfg = load_config(None, {
        "model": "nano", "workers": 3, **shape, "backend": "hivemind", "group_size": 2,
        "min_replicas": 2,
        "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2,
        "steps": 20, "inner_steps": 10, "warmup_steps": 2, "quorum_timeout": 20,
        "run_dir": tmp_path / "run", "cache_dir": cache_dir})
    result = launch(cfg, show_progress=False)
    assert result.returncodes == [0] * len(workers)

    syncs = {w: [r for r in read_metrics(cfg.run_dir / "metrics" / f"{w}.jsonl")
                 if r["kind"] == "sync"] for w in workers}
    skipped = [r for records in syncs.values() for r in records if r.get("skipped")]
    assert all(not r["committed"] and r["world_size"] == 1 for r in skipped)
    assert sum(w["skipped_rounds"] for w in result.summary["per_worker"].values()) == len(skipped)
    if len(workers) == 3:
        assert skipped, "3 peers in groups of 2: some peer must have been left out of a round"
    else:  # two groups in some round committed one round number with different states
        states = {(r["outer_step"], r["fingerprint"]) for records in syncs.values()
                  for r in records if r["committed"] and r["world_size"] == 2}
        assert len({s for s, _ in states}) < len(states), states
    # the last round is one group of everyone, committed by each
    for records in syncs.values():
        assert records[-1]["committed"] and records[-1]["world_size"] == len(workers)

    audit = audit_run(cfg.run_dir)  # every committed round: one state, none missing
    assert audit["consistent"] and audit["outer_steps"] == 2, audit
    ended = result.summary["final_replicas"]
    assert ended["consistent"] and ended["holders"] == workers
    models = [load_file(str(p)) for p in sorted((cfg.run_dir / "final").glob("w*.safetensors"))]
    assert len(models) == len(workers)
    for other in models[1:]:
        assert all((other[name] == models[0][name]).all() for name in models[0])


def test_the_left_out_peer_skips_after_its_window_and_the_last_round_takes_everyone() -> None:
    """On the collectives themselves (real daemons): the peer groups of 2 leave out stops
    looking after ``skip_after``, far short of ``round_timeout``; the pair moves on to the
    last round at once, and its group waits for the third (longer than a matchmaking window)
    instead of starting as a pair, heals it and commits with it."""
    import time

    import torch
    from test_hivemind_early_matchmaking import FAST, in_threads

    from farlink.comm.hivemind_backend import HivemindCollective

    options = {**FAST, "round_timeout": 60.0}
    first = HivemindCollective("odd", target_group_size=2, skip_after=3.0, final_group_size=3,
                               **options)
    peers = {"a": first}
    peers.update({name: HivemindCollective("odd", first.maddrs, target_group_size=2,
                                           skip_after=3.0, final_group_size=3, **options)
                  for name in "bc"})
    states = {name: {"x": torch.full((8,), float(i))} for i, name in enumerate(peers)}
    for name, peer in peers.items():
        peer.register_state(lambda n=name: {k: v.clone() for k, v in states[n].items()},
                            lambda s, n=name: states[n].update(s))
    try:
        def round_of(name: str, peer: HivemindCollective, final: bool = False) -> tuple:
            started = time.monotonic()
            info = peer.begin_round(final=final)
            x = [states[name]["x"]]
            peer.all_reduce_sum(x)
            return info, peer.commit(), time.monotonic() - started

        first_round = in_threads(round_of, peers)
        left_out = [n for n, (info, _, _) in first_round.items() if info.skipped]
        assert len(left_out) == 1, first_round
        info, committed, seconds = first_round[left_out[0]]
        assert not committed and info.world_size == 1 and 3.0 <= seconds < 10
        assert peers[left_out[0]].skipped_rounds == 1
        assert all(c and i.world_size == 2 for n, (i, c, _) in first_round.items()
                   if n not in left_out)

        last = in_threads(lambda name, peer: round_of(name, peer, final=True), peers)
        assert all(info.world_size == 3 and info.round_id == 1 and committed
                   for info, committed, _ in last.values()), last
        assert [n for n, (info, _, _) in last.items() if info.healed] == left_out
        assert len({tuple(s["x"].tolist()) for s in states.values()}) == 1
    finally:
        for peer in peers.values():
            peer.close()


@pytest.mark.parametrize("algorithm", ["streaming_diloco", "demo", "ddp"])
def test_groups_smaller_than_the_swarm_are_refused_where_states_would_never_join(
        tmp_path: Path, algorithm: str) -> None:
    """Only an algorithm that mixes its committed state within a group (the DiLoCo family and
    SparseLoCo) runs in groups; another algorithm's groups would commit one round apart and stay
    apart, so --group-size is refused up front."""
    from farlink.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="group_size .* runs local_sgd/diloco"):
        load_config(None, {"backend": "hivemind", "workers": 3, "group_size": 2,
                           "algorithm": algorithm, "run_dir": tmp_path / "run"})
    for mixing in ("local_sgd", "sparseloco"):
        assert load_config(None, {"backend": "hivemind", "workers": 3, "group_size": 2,
                                  "algorithm": mixing, "run_dir": tmp_path / "run"}
                           ).group_size == 2
