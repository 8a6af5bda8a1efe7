"""A round that heals a worker and fails is retried: in the retry the healed worker still sends
nothing of its own, with zero weight, so the round averages exactly its other members'
pseudo-gradients, blocking or with the outer step delayed (--outer-overlap). Its phase was
measured from the state it had before the heal; the retry must not send it (nor dilute the
average with its weight). Three DiLoCo replicas as threads in an in-process group that loses a
member and heals it (farlink.testing.HealingGroup); the exchange of the healing round fails
once (farlink.testing.Faults). About a second of CPU."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from farlink.codecs import make_compressor
from farlink.comm.inprocess import InProcessGroup
from farlink.compose import build_handoff, wire
from farlink.config import RunConfig
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange
from farlink.testing import FaultyCollective, Faults, HealingGroup, in_threads

torch.set_num_threads(1)

# where each replica's phase t ends (a one-weight model), and the tokens it weighs with
LOCAL = {0: [[0.0, 1.0], [0.5, 1.0], [2.0, -1.0], [0.25, 0.75]],
         1: [[1.0, 0.0], [1.0, 2.0], [-1.0, 0.5], [1.5, 1.0]],
         2: [[3.0, 3.0], [-2.0, 4.0], [5.0, -3.0], [0.0, 2.0]]}
TOKENS = {0: 300, 1: 100, 2: 200}
LEFT_OUT, HEALING = 1, 2  # the round replica 2 misses, the round it heals in


def _algo(collective, mode: str, name: str, leader: bool):  # noqa: ANN001, ANN202
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    if name == "hierarchical_diloco":  # one island; its global rounds far off (every 100th)
        cfg = RunConfig(algorithm=name, steps=1000, warmup_steps=0, inner_steps=100,
                        island_steps=1)
    else:
        cfg = RunConfig(algorithm=name, steps=100, warmup_steps=0, outer_overlap=mode)
    cls = algorithm_class(name)
    exchange = Exchange(collective, sender=f"r{id(collective)}", **wire(cls, cfg, "none"))
    if name != "hierarchical_diloco":
        return cls(model, cfg, collective, exchange)
    upper = InProcessGroup(1).member(0) if leader else None  # the leaders' group: one island
    return cls(model, cfg, collective, exchange,
               global_exchange=None if upper is None else Exchange(upper, make_compressor("none"),
                                                                 sender="g0"),
               **build_handoff(cls, exchange))


def _run(mode: str, name: str = "diloco") -> tuple[dict, Faults]:
    group = HealingGroup(3, timeout=30)
    # replicas 0 and 1 begin round HEALING as their third round (counted from 0: 2); the
    # exchange fails on replica 0 there, so the round commits nowhere and is retried
    faults = Faults().fail_exchange_at(round=HEALING, replica=0)
    back = threading.Event()  # replicas 0 and 1 committed round LEFT_OUT without replica 2
    delayed = mode != "none"

    def landed(algo) -> None:  # noqa: ANN001
        if delayed:
            algo.state_dict()  # a consistent cut: it waits for the round in flight

    def member(m: int, coll) -> dict:  # noqa: ANN001
        algo = _algo(FaultyCollective(coll, faults, m), mode, name, leader=m == 0)
        out: dict = {"deltas": {}}

        def phase(t: int) -> None:
            out["deltas"][t] = algo.params[0].detach().clone() - torch.tensor([LOCAL[m][t]])
            with torch.no_grad():
                algo.params[0].copy_(torch.tensor([LOCAL[m][t]]))
            algo.tokens_since_sync = TOKENS[m]
            outcome = algo.sync()  # (an island round is no global sync)
            assert outcome.synced or name == "hierarchical_diloco"

        for t in range(len(LOCAL[m])):
            if m == 2 and t == LEFT_OUT:
                landed(algo)  # its round 0 is done: it leaves between rounds
                group.lose(2)
                assert back.wait(30)
                continue  # it misses this phase's round; its next one heals it
            phase(t)
            if m == 0 and t == LEFT_OUT:
                landed(algo)  # round LEFT_OUT ran without replica 2
                group.rejoin(2)  # the next round waits for it
                back.set()
            if t == HEALING:
                landed(algo)
                out["healing_round"] = algo.last_exchange
        algo.finish()
        out.update(committed=algo.global_params[0].clone(), final=algo.params[0].detach().clone(),
                   fingerprint=algo.fingerprint(), outer_step=algo.outer_step,
                   island=[a.clone() for a in getattr(algo, "anchor", [])])
        return out

    return in_threads(member, {m: group.member(m) for m in range(3)}, timeout=60), faults


@pytest.mark.parametrize("mode", ["none", "delayed", "eager"])
def test_a_retried_healing_round_averages_only_its_other_members(mode: str) -> None:
    results, faults = _run(mode)
    assert (0, HEALING, "exchange") in faults.fired  # the healing round's first try failed
    # replicas 0 and 1 measured their Δ of the healing round from where their phase began;
    # replica 2 sends nothing of its own (its phase began from its state before the heal)
    want_weight = float(TOKENS[0] + TOKENS[1])
    want = (results[0]["deltas"][HEALING] * TOKENS[0]
            + results[1]["deltas"][HEALING] * TOKENS[1]) / want_weight
    for m, r in results.items():
        got = r["healing_round"]
        assert got.total_weight == want_weight, (mode, m, got.total_weight)
        assert torch.allclose(got.tensors["weight"], want, atol=1e-6), (mode, m, got.tensors)
    first = results[0]
    for m, r in results.items():  # and every replica ends on the one committed state
        assert r["fingerprint"] == first["fingerprint"], m
        assert r["outer_step"] == first["outer_step"] == len(LOCAL[0]), (m, r["outer_step"])
        assert torch.equal(r["committed"], first["committed"]), m
        assert torch.equal(r["final"], first["committed"]), m


def test_a_retried_healing_island_round_averages_only_its_other_members() -> None:
    """The same for Hierarchical DiLoCo's island round (its own retry loop): one island of the
    three replicas, whose leader's global rounds are far off; the island round that heals
    replica 2 fails once and is retried. (Its heal also zeroes the tokens it weighs with, so
    this held before its loop used :func:`farlink.sync.base.healed_in_any_try` too.)"""
    results, faults = _run("none", "hierarchical_diloco")
    assert (0, HEALING, "exchange") in faults.fired
    want_weight = float(TOKENS[0] + TOKENS[1])
    want = (results[0]["deltas"][HEALING] * TOKENS[0]
            + results[1]["deltas"][HEALING] * TOKENS[1]) / want_weight
    for m, r in results.items():
        got = r["healing_round"]
        assert got.total_weight == want_weight, (m, got.total_weight)
        assert torch.allclose(got.tensors["weight"], want, atol=1e-6), (m, got.tensors)
    for m, r in results.items():  # one island state on every replica
        assert torch.equal(r["island"][0], results[0]["island"][0]), m
        assert torch.equal(r["final"], results[0]["final"]), m
