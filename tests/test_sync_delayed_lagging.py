"""A lagging worker under the delayed outer step (--outer-overlap delayed|eager): nobody waits
for it at a round boundary, so once it is a join timeout behind torchft's Lighthouse leaves it
out of a quorum and it heals in a later round. Every replica must still end on one committed
state, at the same inner step and outer step: DiLoCo (one round in flight), SparseLoCo and
Streaming DiLoCo (a round per fragment in flight for a whole period). Threads as replicas,
torchft's real in-process Lighthouse, real Gloo; a run takes about 6 s."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from farlink.comm.base import RoundInfo
from farlink.comm.torchft_backend import TorchftCollective
from farlink.compose import wire
from farlink.config import RunConfig
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange
from farlink.testing import in_threads, lighthouse_server
from farlink.train.launcher import ended_apart_report, final_replicas

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

torch.set_num_threads(1)

REPLICAS, H, STEPS = 3, 4, 32
JOIN_TIMEOUT = 1.0


def _pause(lag: str, index: int, step: int) -> float:
    """Seconds replica ``index`` spends on inner step ``step`` (from 1). Replica 0 stops once,
    as for an evaluation, longer than the join timeout, and keeps pace otherwise. ``early``: in
    step 10, so it is left out of round 2 and heals in a later round while the others still
    run; ``late``: in step 22, so it is left out of round 5 (launched at step 24) and reaches
    the quorum of round 7, the run's last (launched at step 32 = 0.8 s after round 6, which
    the others launch once round 5 is done without it, 1 s after its launch), and heals in it
    (Streaming DiLoCo: in a round of the last periods). ``last``: in step 30, so it reaches
    the quorum of round 7, the run's last, 2 s after the others, who commit it and finish
    without it. On a busy machine the others can be slow as well: the stall then lasts until
    they formed a quorum without replica 0."""
    if lag == "early":
        return 0.1 + (1.5 if index == 0 and step == 10 else 0.0)
    if lag == "last":
        return 0.1 + (2.0 if index == 0 and step == 30 else 0.0)
    return 0.2 + (1.4 if index == 0 and step == 22 else 0.0)


def _lagging_run(mode: str, name: str, lag: str) -> dict[int, dict]:
    init = threading.Lock()
    start_line = threading.Barrier(REPLICAS)
    left_out = threading.Event()  # the others formed a quorum without replica 0

    with lighthouse_server(1, join_timeout_s=JOIN_TIMEOUT, heartbeat_timeout_s=2.0) as address:
        def replica(index: int, _member: object) -> dict:
            coll = TorchftCollective(f"r{index}", address, min_replicas=1, round_timeout=10,
                                     join_timeout=JOIN_TIMEOUT)
            try:
                with init:  # one model for all: torch's RNG is the process's
                    torch.manual_seed(0)
                    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
                cfg = RunConfig(algorithm=name, backend="torchft", steps=STEPS, inner_steps=H,
                                warmup_steps=0, outer_overlap=mode)
                cls = algorithm_class(name)
                algo = cls(model, cfg, coll,
                           Exchange(coll, sender=f"r{index}", **wire(cls, cfg, "none")))
                rounds = []  # (id, world size, healed) of every quorum this replica joined
                begin_round = coll.begin_round

                def recorded(*args, **kwargs) -> RoundInfo:
                    # every quorum, as it forms: several rounds run between two steps of
                    # Streaming DiLoCo, so the last round seen at a step misses most of them
                    info = begin_round(*args, **kwargs)
                    rounds.append((info.round_id, info.world_size, info.healed))
                    if index != 0 and info.world_size < REPLICAS:
                        left_out.set()
                    return info

                coll.begin_round = recorded
                start_line.wait(60)
                gen = torch.Generator().manual_seed(index + 1)
                while not algo.finished():
                    x = torch.randn(8, 4, generator=gen)
                    (model(x) - x).pow(2).mean().backward()
                    pause = _pause(lag, index, algo.inner_steps_done + 1)
                    time.sleep(pause)
                    if pause > JOIN_TIMEOUT:  # on a busy machine the others may be slow too:
                        left_out.wait(30)  # the stall lasts until they went on without it
                    algo.step(16)
                algo.finish()
                return {"fingerprint": algo.fingerprint(), "outer_step": algo.outer_step,
                        "inner_steps": algo.inner_steps_done, "rounds": rounds,
                        "last_group": algo.last_group, "ended_apart": algo.ended_apart(),
                        "committed": [g.clone() for g in algo.global_params],
                        "params": [p.detach().clone() for p in algo.params]}
            finally:
                coll.close()

        return in_threads(replica, dict.fromkeys(range(REPLICAS)), timeout=240)


@pytest.mark.parametrize(("mode", "name", "lag"), [
    ("delayed", "diloco", "early"), ("eager", "diloco", "late"),
    ("delayed", "streaming_diloco", "early"), ("delayed", "streaming_diloco", "late"),
    ("eager", "diloco", "early"), ("delayed", "diloco", "late"),
    ("delayed", "sparseloco", "early")])
def test_a_lagging_worker_left_out_of_a_quorum_heals_into_the_one_committed_state(
        mode: str, name: str, lag: str) -> None:
    results = _lagging_run(mode, name, lag)
    # the scenario happened: the fast replicas committed rounds without the lagging one, and
    # it healed
    assert any(size < REPLICAS for _, size, _ in results[1]["rounds"]), results[1]["rounds"]
    healed_in = {round_id for round_id, _, healed in results[0]["rounds"] if healed}
    assert healed_in, results[0]["rounds"]
    if lag == "late" and name != "streaming_diloco":
        # it healed in the run's last round: the others were done after it
        assert healed_in == {STEPS // H - 1}, results[0]["rounds"]
    first = results[0]
    for index, r in results.items():
        assert r["inner_steps"] == STEPS, (index, r["inner_steps"])
        assert r["outer_step"] == first["outer_step"], (index, r["outer_step"],
                                                        first["outer_step"])
        assert r["fingerprint"] == first["fingerprint"], index
        for a, b in zip(r["committed"], first["committed"]):
            assert torch.equal(a, b), index  # bit-identical committed parameters
        if name != "streaming_diloco":  # (it mixes the arriving fragments into its own)
            for a, b in zip(r["params"], r["committed"]):
                assert torch.equal(a, b), index  # every replica ends on the committed state


def test_a_worker_left_out_of_the_last_round_ends_apart_and_it_is_reported() -> None:
    """No peer is left to heal it from: it commits the last round alone, and ends on a state of
    its own (the documented bound: the join timeout). Each replica says so at its end, and the
    run's report names it with the group of its last round."""
    results = _lagging_run("delayed", "diloco", "last")
    straggler, peers = results[0], [results[1], results[2]]
    assert peers[0]["fingerprint"] == peers[1]["fingerprint"]
    assert straggler["fingerprint"] != peers[0]["fingerprint"]  # the scenario happened
    assert straggler["outer_step"] == peers[0]["outer_step"] == STEPS // H
    assert straggler["last_group"] == 1 and "committed it alone" in straggler["ended_apart"]
    for peer in peers:  # they know someone was left out of the last round
        assert peer["last_group"] == REPLICAS - 1
        assert f"with {REPLICAS - 1} of the {REPLICAS} replicas" in peer["ended_apart"]
    # the end records as the workers write them, read by the launcher's summary
    ends = {f"w{i}": {"outer_step": r["outer_step"], "fingerprint": r["fingerprint"],
                      "last_group": r["last_group"]} for i, r in results.items()}
    holders, consistent = final_replicas(ends)
    assert holders == ["w1", "w2"] and not consistent
    report = ended_apart_report({"holders": holders, "states": {
        w: [e["outer_step"], e["fingerprint"]] for w, e in ends.items()},
        "last_groups": {w: e["last_group"] for w, e in ends.items()}})
    assert "w0 (outer step 8" in report and "group of 1)" in report and "w1, w2" in report
