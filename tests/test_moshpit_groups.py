"""Group state mixing (Moshpit, :mod:`farlink.sync.moshpit`) for an algorithm that gains
``partial_groups`` through the layer: five real hivemind peers in one process (threads as
replicas) in groups of two, so each round two groups commit the same round number with different
states and one peer is left out; a later round's group mixes the state its update is linear in,
and the run's last round (one group of all five) ends the run on one committed model. (DiLoCo
and local SGD run the same layer through ``farlink train``: tests/test_hivemind_odd_groups.py.)"""

from __future__ import annotations

import threading

import torch
from torch import nn

from farlink.comm.hivemind_backend import HivemindCollective
from farlink.compose import wire
from farlink.config import RunConfig
from farlink.sync import algorithm_class, capabilities
from farlink.sync.exchange import Exchange
from farlink.testing import in_threads

torch.set_num_threads(1)

FAST = dict(matchmaking_time=1.5, request_timeout=1.0, allreduce_timeout=8.0, gather_timeout=8.0,
            commit_timeout=6.0, round_timeout=60.0)


def test_sparseloco_groups_of_two_mix_their_states_and_end_on_one_model() -> None:
    algorithm = "sparseloco"
    assert capabilities(algorithm).partial_groups
    cfg = RunConfig(algorithm=algorithm, steps=20, inner_steps=5, warmup_steps=0, lr=0.02,
                    sparseloco_chunk=16, sparseloco_topk=8)
    first = HivemindCollective("moshpit", target_group_size=2, skip_after=3.0,
                               final_group_size=5, **FAST)
    peers = {"a": first}
    peers.update({name: HivemindCollective("moshpit", first.maddrs, target_group_size=2,
                                           skip_after=3.0, final_group_size=5, **FAST)
                  for name in "bcde"})
    init_lock = threading.Lock()
    target = torch.randn(8, 8, generator=torch.Generator().manual_seed(7)) / 3

    def replica(name: str, collective: HivemindCollective):  # noqa: ANN202
        with init_lock:  # the global RNG is shared by threads: seed and build at once
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
        cls = algorithm_class(algorithm)
        algo = cls(model, cfg, collective, Exchange(
            collective, sender=name, **wire(cls, cfg, "none")))
        gen = torch.Generator().manual_seed(ord(name))
        outcomes = []
        while not algo.finished():
            x = torch.randn(16, 8, generator=gen)
            (model(x) - x @ target).pow(2).mean().backward()
            outcome = algo.step(16)
            if outcome.synced:
                outcomes.append(outcome)
        last = algo.finish()
        if last is not None:
            outcomes.append(last)
        return algo.fingerprint(), outcomes, algo.mixed_rounds

    try:
        results = in_threads(replica, peers, timeout=240)
    finally:
        for peer in peers.values():
            peer.close()
    outcomes = {name: o for name, (_, o, _) in results.items()}
    # some peer was left out of some round, and some group had differing states to mix
    assert any(o.skipped for per in outcomes.values() for o in per), outcomes
    assert sum(mixed for _, _, mixed in results.values()) > 0, results
    for per in outcomes.values():  # the run's last round took all five peers
        assert per[-1].committed and per[-1].world_size == 5, per
    assert len({fingerprint for fingerprint, _, _ in results.values()}) == 1, results
