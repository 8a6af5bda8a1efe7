"""A lagging worker under the delayed outer step (--outer-overlap delayed|eager): nobody waits
for it at a round boundary, so once it is a join timeout behind torchft's Lighthouse leaves it
out of a quorum and it heals in a later round. Every replica must still end on one committed
state, at the same inner step and outer step (threads as replicas, torchft's real in-process
Lighthouse, real Gloo)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from farlink.comm.torchft_backend import TorchftCollective
from farlink.compose import wire
from farlink.config import RunConfig
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange
from farlink.testing import in_threads, lighthouse_server

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

torch.set_num_threads(1)

REPLICAS, H, STEPS = 3, 4, 32
JOIN_TIMEOUT = 1.0


def _pause(lag: str, index: int, step: int) -> float:
    """Seconds replica ``index`` spends on inner step ``step`` (from 1). ``slow``: replica 0
    lags all run long (one phase of it, 1.6 s, is longer than the join timeout; the others
    are done before its first round), so it heals in the run's last round; ``stall``: replica
    0 stops for 1.5 s once, in step 10 (an evaluation), and keeps pace otherwise, so it is
    left out of round 2 and heals in a later round, while the others still run."""
    if lag == "slow":
        return 0.4 if index == 0 else 0.02
    return 0.1 + (1.5 if index == 0 and step == 10 else 0.0)


def _lagging_run(mode: str, name: str, lag: str) -> dict[int, dict]:
    init = threading.Lock()
    start_line = threading.Barrier(REPLICAS)

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
                start_line.wait(60)
                gen = torch.Generator().manual_seed(index + 1)
                rounds = []  # (world size, healed) of each round this replica saw land
                while not algo.finished():
                    x = torch.randn(8, 4, generator=gen)
                    (model(x) - x).pow(2).mean().backward()
                    time.sleep(_pause(lag, index, algo.inner_steps_done + 1))
                    if algo.step(16).synced and algo.last_round is not None:
                        rounds.append((algo.last_round.world_size, algo.last_round.healed))
                algo.finish()
                return {"fingerprint": algo.fingerprint(), "outer_step": algo.outer_step,
                        "inner_steps": algo.inner_steps_done, "rounds": rounds,
                        "committed": [g.clone() for g in algo.global_params],
                        "params": [p.detach().clone() for p in algo.params]}
            finally:
                coll.close()

        return in_threads(replica, dict.fromkeys(range(REPLICAS)), timeout=240)


@pytest.mark.parametrize(("mode", "name", "lag"),
                         [("delayed", "diloco", "slow"), ("eager", "diloco", "slow"),
                          ("delayed", "diloco", "stall"), ("eager", "diloco", "stall")])
def test_a_lagging_worker_left_out_of_a_quorum_heals_into_the_one_committed_state(
        mode: str, name: str, lag: str) -> None:
    results = _lagging_run(mode, name, lag)
    # the scenario happened: the fast replicas committed rounds without the lagging one, and
    # it healed
    assert any(size < REPLICAS for size, _ in results[1]["rounds"]), results[1]["rounds"]
    assert any(healed for _, healed in results[0]["rounds"]), results[0]["rounds"]
    first = results[0]
    for index, r in results.items():
        assert r["inner_steps"] == STEPS, (index, r["inner_steps"])
        assert r["outer_step"] == first["outer_step"], (index, r["outer_step"],
                                                        first["outer_step"])
        assert r["fingerprint"] == first["fingerprint"], index
        for a, b in zip(r["committed"], first["committed"]):
            assert torch.equal(a, b), index  # bit-identical committed parameters
        for a, b in zip(r["params"], r["committed"]):
            assert torch.equal(a, b), index  # every replica ends on the committed state
