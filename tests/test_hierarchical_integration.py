"""Hierarchical DiLoCo for real: 4 workers (threads of this process: launch_in_threads) in 2
islands formed from measured links, torchft (a Lighthouse per island plus the global one, two
Managers in each leader), Gloo on localhost, one deliberately slow worker; and clear errors for
bad topology/island flags. Worker processes: the `farlink train` runs of the other tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from farlink.config import ConfigError, load_config
from farlink.train.audit import audit_run
from farlink.testing.runs import launch_in_threads
from farlink.train.metrics import read_metrics

SMALL = {"model": "nano", "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 4,
         "warmup_steps": 5, "log_every": 5, "join_timeout": 10, "heartbeat_timeout": 3}


# the end-to-end proof; in the default suite each part stands in on its own: the launcher's
# measured islands (test_measured_islands_and_gated_island_lighthouses_are_planned_before_the_run),
# the algorithm against a hand-computed reference with and without overlap
# (test_sync_hierarchical), a hierarchical run of threads that ends bit-identical with only leaders
# crossing islands (test_replica_group_hierarchical::..._one_rank_replica_groups_train[fsdp],
# and test_api::test_hierarchical_diloco_with_islands_the_user_forms, whose loss falls), and a slow
# worker under time-budgeted rounds (test_train_integration::
# test_time_budgeted_rounds_keep_a_slow_worker_in_every_round, test_replica_group_clock)
@pytest.mark.slow
@pytest.mark.torchft_threads
@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_two_islands_with_a_slow_worker_stay_bit_identical_and_learn(
        tmp_path: Path, cache_dir: Path, overlap: bool) -> None:
    # islands interleaved on purpose: they must come from the measured links, not the indices
    cfg = load_config(None, {
        **SMALL, "run_dir": tmp_path / "run", "cache_dir": cache_dir, "workers": 4,
        "algorithm": "hierarchical_diloco", "topology": "0,2|1,3", "slowdown": "1,1,1,3",
        "steps": 30, "inner_steps": 10, "round_seconds": 3.0, "island_seconds": 1.5,
        "overlap_global": overlap})
    result = launch_in_threads(cfg)
    assert result.returncodes == [0, 0, 0, 0]
    network = json.loads((cfg.run_dir / "network.json").read_text())
    assert network["islands"] == [[0, 2], [1, 3]] and network["source"] == "measured"
    assert result.summary["network"]["islands"] == [[0, 2], [1, 3]]

    # every worker logged every outer round with the same committed-state fingerprint
    audit = audit_run(cfg.run_dir)
    assert audit["consistent"] and audit["outer_steps"] == 3, audit
    syncs = {w: [r for r in read_metrics(cfg.run_dir / "metrics" / f"{w}.jsonl")
                 if r["kind"] == "sync"] for w in ("w0", "w1", "w2", "w3")}
    for w, records in syncs.items():
        # (overlapped: each result arrives one island round after its global round started)
        assert [r["outer_step"] for r in records] == [1, 2, 3], w
        assert all(r["committed"] and r["world_size"] == 2 for r in records), w
    for k in range(len(syncs["w0"])):
        assert len({syncs[w][k]["fingerprint"] for w in syncs}) == 1
    finals = [load_file(str(p)) for p in sorted((cfg.run_dir / "final").glob("w*.safetensors"))]
    assert len(finals) == 4
    for other in finals[1:]:
        assert all((other[k] == finals[0][k]).all() for k in finals[0])

    # the slow worker contributed fewer tokens than its island mate, and the model learned
    per = result.summary["per_worker"]
    assert 0 < per["w3"]["tokens"] < per["w1"]["tokens"]
    assert audit["last_eval_loss"] < audit["first_eval_loss"] - 0.1
    # only leaders (w0, w1) crossed islands; everyone talked inside its island
    assert per["w0"]["inter_bytes"] > 0 and per["w1"]["inter_bytes"] > 0
    assert per["w2"]["inter_bytes"] == 0 and per["w3"]["inter_bytes"] == 0
    assert all(per[w]["intra_bytes"] > 0 for w in per)
    assert result.summary["inter_island_bytes"] == per["w0"]["inter_bytes"] + per["w1"][
        "inter_bytes"]


# in the default suite: the island Lighthouses' gates in
# test_measured_islands_and_gated_island_lighthouses_are_planned_before_the_run, and the signed
# island updates, hand-offs and global rounds in
# test_sync_hierarchical::test_two_islands_match_hand_computed_reference[authenticated]
@pytest.mark.slow
@pytest.mark.torchft_threads
def test_authenticated_islands_gate_their_lighthouses_and_sign_the_handoff(
        tmp_path: Path, cache_dir: Path) -> None:
    """--auth secret: every island's Lighthouse is gated like the main one, and island updates,
    hand-offs and global rounds are signed; the run ends on identical replicas."""
    cfg = load_config(None, {
        **SMALL, "run_dir": tmp_path / "run", "cache_dir": cache_dir, "workers": 4,
        "algorithm": "hierarchical_diloco", "islands": "0,1|2,3", "steps": 20,
        "inner_steps": 10, "island_steps": 5, "auth": "secret", "secret": "s3cret"})
    result = launch_in_threads(cfg)
    assert result.returncodes == [0, 0, 0, 0]
    audit = audit_run(cfg.run_dir)
    assert audit["consistent"] and audit["outer_steps"] == 2, audit
    logs = [(cfg.run_dir / f"lighthouse-island{k}.log") for k in (0, 1)]
    assert all(p.exists() for p in logs)
    finals = [load_file(str(p)) for p in sorted((cfg.run_dir / "final").glob("w*.safetensors"))]
    assert len(finals) == 4
    assert all((f[k] == finals[0][k]).all() for f in finals[1:] for k in finals[0])


@pytest.mark.parametrize("values,message", [
    ({"topology": "0,1|1,2,3"}, "topology '0,1|1,2,3': worker 1 is in two groups"),
    ({"topology": "0,1|2"}, r"workers \[3\] are in no group"),
    ({"topology": "0,1|2,3", "inter_link": "moon"}, "inter_link: unknown link profile 'moon'"),
    ({"topology": "0,1|2,3", "emulate_link": "home"}, "either topology .* or emulate_link"),
    ({"algorithm": "hierarchical_diloco", "islands": "0,1|2,9"}, "worker 9 does not exist"),
    ({"algorithm": "diloco", "islands": "0,1|2,3"}, "apply to hierarchical_diloco only"),
    ({"algorithm": "hierarchical_diloco", "inner_steps": 10, "island_steps": 3},
     "must be a multiple of island_steps=3"),
    ({"algorithm": "hierarchical_diloco", "island_seconds": 2.0}, "island_seconds needs"),
    ({"algorithm": "hierarchical_diloco", "round_seconds": 2.0, "island_seconds": 5.0},
     "exceeds the global round's"),
    ({"algorithm": "hierarchical_diloco", "backend": "hivemind"}, "torchft or inprocess backend"),
])
def test_bad_topology_or_island_flags_are_clear_errors(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"workers": 4, **values})


def test_measured_islands_and_gated_island_lighthouses_are_planned_before_the_run(
        tmp_path: Path) -> None:
    """What the launcher does before any worker starts: islands measured through the emulated
    links (interleaved on purpose: they come from the links, not the indices), written to
    ``network.json``, and with --auth one gated Lighthouse per island (the Lighthouse itself on
    loopback, the gate on the address the workers are given)."""
    from farlink.train.network import prepare_network

    cfg = load_config(None, {**SMALL, "run_dir": tmp_path, "workers": 4,
                             "algorithm": "hierarchical_diloco", "topology": "0,2|1,3",
                             "auth": "secret", "secret": "s3cret"})
    plan, lighthouses = prepare_network(cfg, 512)
    try:
        assert plan.islands == [[0, 2], [1, 3]] and plan.source == "measured"
        network = json.loads((tmp_path / "network.json").read_text())
        assert network["islands"] == [[0, 2], [1, 3]] and network["source"] == "measured"
        assert len(lighthouses) == 2
        assert plan.island_lighthouses == [lh.address for lh in lighthouses]
        for k, lighthouse in enumerate(lighthouses):
            assert (tmp_path / f"lighthouse-island{k}.log").exists()
            assert lighthouse.gate is not None and lighthouse.bind_host == "127.0.0.1"
            assert lighthouse.bind_port != lighthouse.port
    finally:
        for lighthouse in lighthouses:
            lighthouse.stop()


def test_islands_are_forced_or_kept_on_resume_without_measuring(tmp_path: Path) -> None:
    from farlink.train.network import NetworkPlan, plan_network, prepare_network

    base = {"workers": 4, "algorithm": "hierarchical_diloco", "run_dir": tmp_path,
            "topology": "0,1|2,3"}
    plan = plan_network(load_config(None, {**base, "islands": "0,3|1,2"}), 1 << 20)
    assert plan.islands == [[0, 3], [1, 2]] and plan.source == "forced" and plan.links is None
    assert plan.is_leader(1) and not plan.is_leader(2) and plan.leaders() == [0, 1]
    # islands across topology groups: each island's collective is paced by the slow link
    assert plan.collective_link([0, 3]).name == "intercontinental"
    assert plan.collective_link([0, 1]).name == "datacenter"
    plan.island_lighthouses = ["http://old"]
    plan.save(tmp_path)
    kept, lighthouses = prepare_network(load_config(None, {**base, "resume": True}), 512)
    try:
        assert kept.islands == [[0, 3], [1, 2]] and kept.source == "forced"
        assert len(lighthouses) == 2 and kept.island_lighthouses != ["http://old"]
        assert NetworkPlan.load(tmp_path).island_lighthouses == kept.island_lighthouses
    finally:
        for lighthouse in lighthouses:
            lighthouse.stop()
