"""Pipeline stages: split GPT, real stage processes over TCP, gradients equal to the unsplit
model's, compressed activations, stochastic wiring and peers killed mid-run."""

from __future__ import annotations

import pytest
import torch

from farlink.model import GPT, GPTConfig
from farlink.parallel.peers import start_pipeline, stop_pipeline
from farlink.parallel.pipeline import PipelineTrainer
from farlink.parallel.stages import build_stage, model_parameter_name, stage_bounds

torch.set_num_threads(1)

MICRO = GPTConfig(vocab_size=97, n_layer=4, n_head=2, d_model=32, d_ff=64, seq_len=16)


def batch(seed: int, rows: int = 8, config: GPTConfig = MICRO) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (rows, config.seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def unsplit_gradients(config: GPTConfig, tokens, targets, micro_batches: int):
    torch.manual_seed(0)
    model = GPT(config)
    for x, y in zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)):
        (model(x, y)[1] / micro_batches).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_stage_bounds_cover_every_block_once() -> None:
    assert stage_bounds(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="at least 2 stages"):
        stage_bounds(4, 1)
    with pytest.raises(ValueError, match="at most 4 stages"):
        stage_bounds(4, 5)


def test_stages_chained_in_process_compute_the_unsplit_loss() -> None:
    tokens, targets = batch(1, rows=2)
    torch.manual_seed(0)
    expected = GPT(MICRO)(tokens, targets)[1]
    stages = [build_stage(MICRO, 0, s, 3) for s in range(3)]
    x = tokens
    for stage in stages[:-1]:
        x = stage(x)
    assert torch.allclose(stages[-1].loss(x, targets), expected, atol=1e-6)
    assert model_parameter_name("blocks.0.attn.qkv.weight", 3) == "blocks.3.attn.qkv.weight"


@pytest.mark.parametrize("n_stages", [2, 3])
def test_pipelined_gradients_equal_unsplit_model(n_stages: int) -> None:
    """Stage processes over real sockets, 4 micro-batches in flight: fp32 gradients to 1e-5."""
    tokens, targets = batch(2)
    expected = unsplit_gradients(MICRO, tokens, targets, micro_batches=4)
    peers = start_pipeline(MICRO, n_stages)
    try:
        trainer = PipelineTrainer([[p.address for p in stage] for stage in peers],
                                  micro_batches=4, in_flight=4)
        losses = trainer.forward_backward(tokens, targets)
        grads = trainer.gradients()
    finally:
        stop_pipeline(peers)
    assert len(losses) == 4
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert torch.allclose(grads[name], g, atol=1e-5, rtol=0), name
    assert trainer.bytes["activations"] > 0 and trainer.bytes["gradients"] > 0
