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


@pytest.mark.parametrize("spec", ["fp32", "int8", "int4", "topk:0.1"])
def test_frame_bytes_are_header_plus_codec_payloads(spec: str) -> None:
    import json
    import struct

    from farlink.codecs import make_codec
    from farlink.parallel import wire

    y = torch.randn(2, 16, 32)
    targets = torch.randint(0, 97, (2, 16))
    message = wire.Message("loss", {"scale": 0.25}, {"x": y, "targets": targets.to(torch.int32)})
    frame = wire.encode(message, {"x": spec})
    (hlen,) = struct.unpack_from("<I", frame, 4)
    header = json.loads(frame[8:8 + hlen])
    codec = make_codec(spec)
    assert len(frame) == 8 + hlen + len(codec.encode(y)) + 4 * targets.numel()
    assert len(frame) <= 8 + hlen + codec.max_payload_nbytes(tuple(y.shape)) + 4 * targets.numel()
    received = wire.decode(frame[4:])
    assert received.nbytes == len(frame)
    assert torch.equal(received.tensors["targets"], targets)
    assert [t["codec"] for t in header["tensors"]] == [make_codec(spec).name, "raw"]
    if spec == "fp32":
        assert torch.equal(received.tensors["x"], y)
    if spec == "int8":  # blockwise absmax: off by at most half a step of the block's scale
        bound = y.reshape(-1, 64).abs().amax(1) / 127 / 2
        error = (received.tensors["x"] - y).reshape(-1, 64).abs().amax(1)
        assert bool((error <= bound * 1.01 + 1e-8).all())


def test_compressed_activations_cut_bytes_by_the_codec_ratio_and_keep_gradients_close() -> None:
    """Activations wide enough that frame headers are a few percent of the fp32 payload."""
    wide = GPTConfig(vocab_size=97, n_layer=2, n_head=2, d_model=128, d_ff=128, seq_len=32)
    tokens, targets = batch(3, config=wide)
    runs = {}
    for spec in ("fp32", "int8", "int4"):
        peers = start_pipeline(wide, 2)
        try:
            trainer = PipelineTrainer([[p.address for p in stage] for stage in peers],
                                      micro_batches=4, activation_codec=spec)
            trainer.forward_backward(tokens, targets)
            runs[spec] = (trainer.gradients(), dict(trainer.bytes))
        finally:
            stop_pipeline(peers)
    exact, fp32_bytes = runs["fp32"]
    numel = 2 * wide.seq_len * wide.d_model  # one micro-batch's activations
    for spec, ratio in (("int8", 4 * numel / (numel + numel // 64 * 2)),
                        ("int4", 4 * numel / (numel // 2 + numel // 64 * 2))):
        grads, nbytes = runs[spec]
        for kind in ("activations", "gradients"):
            measured = fp32_bytes[kind] / nbytes[kind]
            assert ratio * 0.85 < measured <= ratio, (spec, kind, measured, ratio)
        for name, g in exact.items():
            cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), g.flatten(), 0)
            assert cosine > (0.99 if spec == "int8" else 0.9), (spec, name, float(cosine))
        assert not torch.equal(grads["blocks.0.mlp.up.weight"], exact["blocks.0.mlp.up.weight"])
