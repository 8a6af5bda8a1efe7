"""A pipeline stage's peers as the members of a collective: the run's algorithm and exchange
average them, so robust aggregation, emulated attackers, emulated links and the algorithms
with stage averaging run in pipelines too (codecs and --auth stay refused: the members live in
the trainer, whose transfers of a peer's weights are fp32 and carry the per-run stage token).

Each test builds the members from a pipelined run's config exactly as ``farlink train``
does (:func:`farlink.compose.build_stage_members`), around real stage peers (:class:`StageWorker`,
reached in-process instead of over a socket) that have trained apart, and runs real rounds
(members as threads of an in-process group); each checks what fails if the option is
ignored.
"""

from __future__ import annotations

import time

import pytest
import torch

from farlink import compose
from farlink.comm.inprocess import DrivenGroup
from farlink.config import RunConfig
from farlink.model import GPTConfig
from farlink.parallel import wire
from farlink.parallel.stage_server import StageWorker
from farlink.parallel.stage_sync import Stage, StageAveraging, StageMember
from farlink.parallel.stages import build_stage
from farlink.sync import algorithm_class

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, d_ff=64)
PIPELINE = {"pipeline_stages": 2, "batch_size": 4, "seq_len": 16}
TOKENS = 4 * 16  # one step of one replica: batch_size x seq_len


def _module():
    return build_stage(CONFIG, 0, 0, 2)


def _peers(n: int) -> dict[str, StageWorker]:
    """``n`` peers of stage 0 that trained one step each on their own tokens (apart)."""
    peers = {}
    for p in range(n):
        worker = StageWorker(_module(), lr=1e-2)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(p))
        y = worker.handle(wire.Message("forward", {"mb": "0"}, {"x": tokens})).tensors["y"]
        worker.handle(wire.Message("backward", {"mb": "0"}, {"dy": torch.ones_like(y)}))
        worker.handle(wire.Message("step", {"lr": 1e-2}))
        peers[f"s0p{p}"] = worker
    return peers


def _averaging(stage: Stage, peers: dict[str, StageWorker]) -> StageAveraging:
    return StageAveraging(
        [stage], lambda s: list(peers),
        lambda peer: {n: t.clone() for n, t in
                      peers[peer].handle(wire.Message("state")).tensors.items()},
        lambda peer, weights: peers[peer].handle(wire.Message("load", {}, weights)))


def _round(cfg: RunConfig, n: int = 2) -> tuple[StageAveraging, dict[str, StageWorker]]:
    """One round of stage 0's ``n`` peers, built from ``cfg`` as farlink train builds it."""
    peers = _peers(n)
    sync = _averaging(compose.build_stage_members(cfg, 0, list(peers), _module), peers)
    sync.sync(TOKENS)
    return sync, peers


def _weights(worker: StageWorker) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in worker.params.values()])


def _drift(peers: dict[str, StageWorker]) -> torch.Tensor:
    """How far each peer's weights are from the initial ones, stacked."""
    start = torch.cat([p.detach().reshape(-1) for p in _module().parameters()])
    return torch.stack([_weights(w) - start for w in peers.values()])


def test_a_stage_round_in_fp32_takes_the_mean_of_the_peers_weights() -> None:
    """local SGD through the exchange: every peer ends on the mean of the peers' weights (the
    dense all-reduce of the members, float noise only)."""
    peers = _peers(2)
    mean = torch.stack([_weights(w) for w in peers.values()]).mean(0)
    stage = compose.build_stage_members(RunConfig(algorithm="local_sgd", **PIPELINE), 0,
                                        list(peers), _module)
    sync = _averaging(stage, peers)
    sync.sync(TOKENS)
    for worker in peers.values():
        torch.testing.assert_close(_weights(worker), mean, rtol=0, atol=1e-6)
    assert {m.algorithm.exchange.last_path for m in sync.stages[0].members} == {"dense"}


def test_a_scaled_attacker_among_a_stage_s_peers_is_outvoted_by_a_robust_rule() -> None:
    """--attackers and --aggregator with pipelines (refused before): stage 0's peer 1 is
    worker 1, its update scaled by 1000; the coordinate median of the stage's three updates
    keeps the peers near their honest weights, where the mean of the same round is carried
    off by the attack."""
    attack = {"attackers": "1", "attack": "scale:1000", "workers": 6, **PIPELINE}
    robust, peers = _round(RunConfig(aggregator="median", **attack), 3)
    assert {m.algorithm.exchange.last_path for m in robust.stages[0].members} != {"dense"}
    assert float(_drift(peers).abs().max()) < 0.1
    _, carried_off = _round(RunConfig(**attack), 3)
    assert float(_drift(carried_off).abs().max()) > 1.0


def test_sparseloco_averages_a_stage_with_its_own_sparse_payloads() -> None:
    """--algorithm sparseloco with pipelines (refused before): its 2-bit top-k payloads are
    what the members send, far fewer bytes than DiLoCo's fp32, and the peers end on one
    model."""
    sparse, peers = _round(RunConfig(algorithm="sparseloco", **PIPELINE))
    dense, _ = _round(RunConfig(algorithm="diloco", **PIPELINE))
    assert 0 < sparse.exchange_bytes < dense.exchange_bytes / 4
    first, second = peers.values()
    assert torch.equal(_weights(first), _weights(second))
    assert sparse.state_dict().keys() >= {"stage0.member0.error.embed.weight"}


@pytest.mark.parametrize("algorithm", ["ddp", "demo", "streaming_diloco",
                                       "hierarchical_diloco"])
def test_algorithms_without_stage_averaging_are_still_refused(algorithm: str) -> None:
    with pytest.raises(ValueError, match="use local_sgd or diloco or sparseloco"):
        RunConfig(algorithm=algorithm, **PIPELINE)


def test_a_left_out_member_is_healed_at_its_next_round() -> None:
    """A peer whose weights were not usable in one round is left out of it; at the next round
    its member is healed from the others (θ, outer momentum, the round count) and the stage's
    members agree again."""
    peers = _peers(3)
    sync = _averaging(compose.build_stage_members(RunConfig(**PIPELINE), 0, list(peers),
                                                  _module), peers)
    fetch = sync.fetch
    sync.fetch = lambda peer: None if peer == "s0p2" else fetch(peer)
    sync.sync(TOKENS)
    members = sync.stages[0].members
    assert [m.algorithm.outer_step for m in members] == [1, 1, 0]
    sync.fetch = fetch
    sync.sync(TOKENS)
    assert [m.algorithm.outer_step for m in members] == [2, 2, 2]
    assert members[2].algorithm.fingerprint() == members[0].algorithm.fingerprint()


def test_an_emulated_link_holds_a_stage_s_round_as_long_as_the_link_would() -> None:
    """--emulate-link with pipelines (refused before): the members' collectives take as long
    as the profile's upload rate and latency say (here DSL: 5 Mbit/s, 100 ms one way)."""
    from farlink.comm.base import LinkModel
    from farlink.links import get_profile

    peers = _peers(2)
    stage = compose.build_stage_members(RunConfig(emulate_link="dsl", **PIPELINE), 0,
                                        list(peers), _module)
    sync = _averaging(stage, peers)
    started = time.perf_counter()
    sync.sync(TOKENS)
    took = time.perf_counter() - started
    link = LinkModel.of_profile(get_profile("dsl"))
    assert sync.stages[0].group.link == link
    member = sync.stages[0].members[0].algorithm.collective
    floor = link.seconds(member.stats.bytes_sent, 2)  # one ring all-reduce of two members
    assert floor > 0.25 and took >= floor, (took, floor)


def test_grad_accum_makes_each_replica_s_step_its_grad_accum_batches(tmp_path) -> None:
    """--grad-accum with pipelines (refused before): a replica's step holds its next
    grad_accum batches, one after another, cut into pipeline_micro_batches each, so the
    trainer accumulates one gradient over all of them, as a worker does over its batches."""
    import numpy as np

    from farlink.data import ShardSampler
    from farlink.data.prepare import PreparedData
    from farlink.train.pipeline_run import PipelineRun

    tokens = np.arange(20_000, dtype=np.int64) % 64
    data = PreparedData(tokens, tokens[:2_000], None, 64, "synthetic")
    cfg = RunConfig(grad_accum=2, workers=4, pipeline_micro_batches=2, vocab_size=512,
                    run_dir=tmp_path / "run", **PIPELINE)
    run = PipelineRun(cfg, data)
    x, y = run.next_batch()
    assert run.micro_batches_per_replica == 4
    assert tuple(x.shape) == (2 * 2 * 4, 16)  # replicas x grad_accum x batch_size rows
    alone = ShardSampler(tokens, 0, 2, 16, 4, cfg.seed)  # replica 0's shard, as the run's
    first, second = alone.next_batch()[0], alone.next_batch()[0]
    mine = torch.cat([x[i * 2:(i + 1) * 2] for i in range(0, 8, 2)])  # replica 0's chunks
    assert torch.equal(mine, torch.cat([first, second]))
