"""SparseLoCo: exact bytes by formula, the 2-bit top-k codec, outer steps by hand on two
in-process workers, and an exact resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from farlink.codecs import CodecError
from farlink.comm.inprocess import InProcessGroup
from farlink.compose import wire
from farlink.config import RunConfig
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange
from farlink.sync.sparseloco import SparseLoCo, SparseTwoBitCodec


@pytest.mark.parametrize(("shape", "nbytes"), [
    # 128 chunks of 4096, 64 kept each: 16 + 2 bits and 12 bits per kept value
    ((4096, 128), 16 + 128 * 64 * 2 // 8 + 128 * 64 * 12 // 8),
    ((128,), 16 + 1 + 2),            # one chunk of 128, ceil(64 * 128 / 4096) = 2 kept, 7 bits
    ((100,), 16 + 1 + 2),            # 2 kept of 100 (7-bit indices): ceil(4/8) + ceil(14/8)
    ((5000,), 16 + 32 + 192),        # 2 chunks of 4096 (the second padded), 128 kept
    ((1,), 16 + 1 + 1),
])
def test_payload_bytes_by_formula(shape: tuple[int, ...], nbytes: int) -> None:
    codec = SparseTwoBitCodec()
    payload = codec.encode(torch.randn(shape))
    assert len(payload) == nbytes == codec.max_payload_nbytes(shape)


def test_keeps_the_top_k_of_each_chunk_with_four_bin_means() -> None:
    codec = SparseTwoBitCodec(chunk=256, topk=8)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    out = codec.decode(codec.encode(x), x.shape, torch.float32)
    flat_x, flat_out = x.reshape(-1, 256), out.reshape(-1, 256)
    for chunk_x, chunk_out in zip(flat_x, flat_out):
        kept = set(torch.nonzero(chunk_out).reshape(-1).tolist())
        assert kept == set(chunk_x.abs().topk(8).indices.tolist())
    values = flat_x.gather(1, flat_x.abs().topk(8).indices).reshape(-1)
    threshold = float(np.median(values.abs().numpy()))
    bins = 2 * (values >= 0).long() + (values.abs() > threshold).long()
    for b in range(4):  # each kept value decodes to the mean of its bin
        positions = torch.isin(x.reshape(-1), values[bins == b])
        expected = values[bins == b].mean().expand(int(positions.sum()))
        torch.testing.assert_close(out.reshape(-1)[positions], expected)
    assert len(torch.unique(out[out != 0])) <= 4


def test_rejects_corrupt_payloads() -> None:
    codec = SparseTwoBitCodec(chunk=16, topk=4)
    payload = bytearray(codec.encode(torch.randn(32)))
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(bytes(payload[:-1]), (32,), torch.float32)
    nan = bytearray(payload)
    nan[0:4] = np.array([np.nan], dtype="<f4").tobytes()
    with pytest.raises(CodecError, match="NaN"):
        codec.decode(bytes(nan), (32,), torch.float32)
    repeated = bytearray(payload)
    repeated[-4:] = b"\x00\x00\x00\x00"  # the last chunk's indices all 0: not increasing
    with pytest.raises(CodecError, match="increasing"):
        codec.decode(bytes(repeated), (32,), torch.float32)


class TwoTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(64, 96, generator=gen))
        self.b = nn.Parameter(torch.randn(100, generator=gen))


def _algo(collective, **overrides) -> SparseLoCo:  # noqa: ANN001
    cfg = RunConfig(algorithm="sparseloco", steps=100, warmup_steps=0, **overrides)
    cls = algorithm_class("sparseloco")
    exchange = Exchange(collective, sender=f"p{id(collective)}", **wire(cls, cfg, cfg.codec))
    return cls(TwoTensors(), cfg, collective, exchange)


def _drift(rank: int, rnd: int, shape: torch.Size) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + rnd)
    return 0.01 * torch.randn(shape, generator=gen)


def _rounds(algo: SparseLoCo, rank: int, rounds: range, log: list) -> None:  # noqa: ANN001
    for rnd in rounds:
        start = [g.clone() for g in algo.global_params]
        with torch.no_grad():
            for p, g in zip(algo.params, algo.global_params):
                p.copy_(g - _drift(rank, rnd, g.shape))
        errors_before = [e.clone() for e in algo.error]
        algo.tokens_since_sync = 100
        assert algo.sync().committed
        sent = [algo.beta * eb + _drift(rank, rnd, e.shape) - e
                for eb, e in zip(errors_before, algo.error)]
        log.append((start, sent, [g.clone() for g in algo.global_params],
                    [e.clone() for e in algo.error]))


def test_two_workers_outer_step_by_hand() -> None:
    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = _algo(collective)
        log: list = []
        _rounds(algo, rank, range(3), log)
        return log

    logs = InProcessGroup(2).run(member, timeout=120)
    codec = SparseTwoBitCodec()
    for rnd in range(3):
        (start, sent0, global0, _), (_, sent1, global1, _) = logs[0][rnd], logs[1][rnd]
        for s0, s1, g0, g1, theta in zip(sent0, sent1, global0, global1, start):
            torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # replicas agree exactly
            # what each worker took out of e is a top-k message: 1.56% of the entries
            for s in (s0, s1):
                _, m, k, _ = codec.geometry(s.numel())
                assert int((s.abs() > 1e-6).sum()) <= m * k
            # plain outer SGD, lr 1, on the (equal-token) mean of the sent updates
            torch.testing.assert_close(g0, theta - 1.0 * (s0 + s1) / 2, rtol=1e-6, atol=1e-7)


def test_resume_continues_exactly() -> None:
    def uninterrupted(rank: int, collective):  # noqa: ANN001, ANN202
        algo, log = _algo(collective), []
        _rounds(algo, rank, range(4), log)
        return log[-1]

    def first_half(rank: int, collective):  # noqa: ANN001, ANN202
        algo = _algo(collective)
        _rounds(algo, rank, range(2), [])
        return algo.state_dict()

    saved = InProcessGroup(2).run(first_half, timeout=120)

    def second_half(rank: int, collective):  # noqa: ANN001, ANN202
        algo, log = _algo(collective), []
        algo.load_state_dict(saved[rank])
        _rounds(algo, rank, range(2, 4), log)
        return log[-1]

    for a, b in zip(InProcessGroup(2).run(uninterrupted, timeout=120),
                    InProcessGroup(2).run(second_half, timeout=120)):
        for x, y in zip(a[2] + a[3], b[2] + b[3]):  # global parameters and accumulators
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_options_and_errors() -> None:
    group = InProcessGroup(1)
    algo = _algo(group.member(0))
    assert (algo.beta, algo.outer_opt.param_groups[0]["lr"]) == (0.95, 1.0)  # the paper's
    algo = _algo(group.member(0), sparseloco_lr=0.5, sparseloco_beta=0.8)
    assert (algo.beta, algo.outer_opt.param_groups[0]["lr"]) == (0.8, 0.5)
    with pytest.raises(ValueError, match="drop --codec"):
        _algo(group.member(0), codec="int8")
    assert math.isclose(64 / 4096, 0.015625)


def test_a_failed_round_leaves_the_accumulator_as_it_was() -> None:
    group = InProcessGroup(1)
    collective = group.member(0)
    algo = _algo(collective, round_retries=0)
    _rounds(algo, 0, range(1), [])  # a committed round leaves a residual in e
    errors, globals_ = [e.clone() for e in algo.error], [g.clone() for g in algo.global_params]
    assert any(e.abs().sum() > 0 for e in errors)
    commit = collective.commit
    collective.commit = lambda: (commit(), False)[1]  # every peer reports the round failed
    with torch.no_grad():
        for p, g in zip(algo.params, algo.global_params):
            p.copy_(g - _drift(0, 7, g.shape))
    algo.tokens_since_sync = 100
    assert not algo.sync().committed
    for e, before in zip(algo.error, errors):
        torch.testing.assert_close(e, before, rtol=0, atol=0)
    for g, before in zip(algo.global_params, globals_):
        torch.testing.assert_close(g, before, rtol=0, atol=0)


def test_density_options_change_the_bytes_by_formula_and_keep_the_paper_default() -> None:
    group = InProcessGroup(1)
    default = _algo(group.member(0))
    assert (default.codec.chunk, default.codec.topk) == (4096, 64)
    sparser = _algo(group.member(0), sparseloco_chunk=1024, sparseloco_topk=8)
    # a (64, 96) tensor: 6 chunks of 1024, 8 kept each, 10-bit indices
    assert sparser.codec.max_payload_nbytes((64, 96)) == 16 + 6 * 8 * 2 // 8 + 6 * 8 * 10 // 8
    payload = sparser._sparse_update()["a"].payload
    assert len(payload) == 16 + 12 + 60
    with pytest.raises(ValueError, match="--sparseloco-topk"):
        RunConfig(algorithm="sparseloco", sparseloco_chunk=16, sparseloco_topk=32)
