"""SparseLoCo as its authors run it (``--sparseloco-variant authors``): one outer step of three
in-process workers against a reference computed by hand, the wire bytes by formula, and the
codec's checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from farlink.codecs import CodecError
from farlink.comm.inprocess import InProcessGroup
from farlink.compose import wire
from farlink.config import RunConfig
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange
from farlink.sync.sparseloco_tiles import TiledTwoBitCodec, quantize

# Each worker's pseudo-gradient Δ (θ_g = 0, so θ_local = -Δ). ``w`` is cut into four 2x2 tiles
# (columns 0-1, 2-3, 4-5, 6-7) with one entry kept per tile; ``b`` (1-D) is sent whole.
DELTA_W = [
    {(0, 0): 3.0, (1, 3): -3.0, (0, 4): 1.0, (1, 7): -1.0},
    {(0, 0): 6.0, (0, 2): 2.0, (1, 5): -2.0, (0, 6): 6.0},
    {(1, 1): 2.0, (1, 3): -2.0, (0, 4): 2.0, (1, 7): -2.0},
]
DELTA_B = [[1.0, 1.0, -1.0, -1.0], [4.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]]

# By hand. The quantizer centres a tensor's kept values on their mean m, bins them at
# round(c / (6 sigma / 4) + 2) (sigma = |c| / sqrt(n - 1)), and decodes a bin as its mean:
#   w0 [3, -3, 1, -1]: m 0, sigma 2.582, c/scale 0.77 -0.77 0.26 -0.26 -> bins 3 1 2 2
#      -> decoded [3, -3, 0, 0] (1 and -1 share bin 2, mean 0); norm sqrt(18)
#   w1 [6, 2, -2, 6]: m 3, c [3, -1, -5, 3], sigma 3.830 -> bins 3 2 1 3 -> [6, 2, -2, 6];
#      norm sqrt(80)
#   w2 [2, -2, 2, -2]: bins 3 1 3 1 -> [2, -2, 2, -2]; norm 4
# Median norm sqrt(18): w1 is scaled by sqrt(18 / 80) = 0.474342, the others by 1. Then each
# position is averaged over the workers that sent it (a sent value decoded to 0 still counts):
F = math.sqrt(18 / 80)
EXPECTED_W_AVG = {
    (0, 0): (3 + 6 * F) / 2, (1, 1): 2.0, (1, 3): (-3 - 2) / 2, (0, 2): 2 * F,
    (0, 4): (0 + 2) / 2, (1, 5): -2 * F, (1, 7): (0 - 2) / 2, (0, 6): 6 * F,
}
#   b0 [1, 1, -1, -1] -> itself, norm 2; b1 [4, 0, 0, 0]: m 1, c [3, -1, -1, -1], sigma 2,
#   scale 3 -> bins 3 2 2 2 -> [4, 0, 0, 0], norm 4; b2 all 0.5: sigma 0 (scale 1), one bin
#   -> [0.5] * 4, norm 1. Median 2: b1 scaled by 0.5. Every worker sent every entry:
EXPECTED_B_AVG = [(1 + 2 + 0.5) / 3, (1 + 0 + 0.5) / 3, (-1 + 0 + 0.5) / 3, (-1 + 0 + 0.5) / 3]


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 8))
        self.b = nn.Parameter(torch.zeros(4))


def _algo(collective, **overrides):  # noqa: ANN001, ANN202
    cfg = RunConfig(algorithm="sparseloco", steps=100, warmup_steps=0,
                    sparseloco_variant="authors", sparseloco_tile=2, sparseloco_topk=1,
                    **overrides)
    cls = algorithm_class("sparseloco")
    exchange = Exchange(collective, sender=f"p{id(collective)}", **wire(cls, cfg, cfg.codec))
    return cls(Small(), cfg, collective, exchange)


def _delta_w(rank: int) -> torch.Tensor:
    out = torch.zeros(2, 8)
    for (r, c), v in DELTA_W[rank].items():
        out[r, c] = v
    return out


@pytest.mark.parametrize("lr", [1.0, 0.5])
def test_one_outer_step_matches_the_hand_computed_reference(lr: float) -> None:
    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = _algo(collective, sparseloco_lr=lr)
        with torch.no_grad():
            algo.params[0].copy_(-_delta_w(rank))
            algo.params[1].copy_(-torch.tensor(DELTA_B[rank]))
        algo.tokens_since_sync = 100
        assert algo.sync().committed
        return [g.clone() for g in algo.global_params], [e.clone() for e in algo.error]

    results = InProcessGroup(3).run(member, timeout=120)
    avg_w = torch.zeros(2, 8)
    for (r, c), v in EXPECTED_W_AVG.items():
        avg_w[r, c] = v
    for globals_, _ in results:  # every replica takes the same step; the lr is applied once
        torch.testing.assert_close(globals_[0], -lr * avg_w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(globals_[1], -lr * torch.tensor(EXPECTED_B_AVG),
                                   rtol=1e-6, atol=1e-6)
    # what was not sent stays in each worker's accumulator: w0's 1 and -1 decoded to 0
    residual_w0 = torch.zeros(2, 8)
    residual_w0[0, 4], residual_w0[1, 7] = 1.0, -1.0
    torch.testing.assert_close(results[0][1][0], residual_w0, rtol=0, atol=1e-6)
    torch.testing.assert_close(results[1][1][0], torch.zeros(2, 8), rtol=0, atol=1e-6)


def test_quantizer_bins_by_hand() -> None:
    codes, levels = quantize(torch.tensor([6.0, 2.0, -2.0, 6.0]))
    assert codes.tolist() == [3, 2, 1, 3]
    assert levels[codes].tolist() == [6.0, 2.0, -2.0, 6.0]


@pytest.mark.parametrize(("shape", "nbytes"), [
    # 2 x 64 tiles of 64x64 (128 x 128), 64 kept each, 2 + 12 bits per kept value
    ((128, 128), 16 + 4 * 64 * 2 // 8 + 4 * 64 * 12 // 8),
    ((128,), 16 + 128 * 2 // 8),  # 1-D: every entry, 2 bits, no indices
    ((100, 7), 16 + 2 * 64 * 2 // 8 + 2 * 64 * 9 // 8),  # 50x7 tiles (divisors), 9-bit index
    ((3, 2, 64), 16 + 64 * 2 // 8 + 64 * 9 // 8),  # viewed as 6 x 64: one tile of 384
])
def test_payload_bytes_by_formula(shape: tuple[int, ...], nbytes: int) -> None:
    codec = TiledTwoBitCodec()
    payload = codec.encode(torch.randn(shape))
    assert len(payload) == nbytes == codec.max_payload_nbytes(shape)
    dense, mask = codec.decode_with_mask(payload, shape)
    assert dense.shape == shape and int(mask.sum()) == (
        math.prod(shape) if len(shape) == 1 else (nbytes - 16) * 8 // (2 + {
            (128, 128): 12, (100, 7): 9, (3, 2, 64): 9}[shape]))


def test_keeps_the_top_entries_of_each_tile() -> None:
    codec = TiledTwoBitCodec(tile=4, topk=3)
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1))
    _, mask = codec.decode_with_mask(codec.encode(x), (8, 12))
    for r in range(0, 8, 4):
        for c in range(0, 12, 4):
            tile, kept = x[r:r + 4, c:c + 4].reshape(-1), mask[r:r + 4, c:c + 4].reshape(-1)
            assert set(torch.nonzero(kept).reshape(-1).tolist()) == set(
                tile.abs().topk(3).indices.tolist())


def test_rejects_corrupt_payloads() -> None:
    codec = TiledTwoBitCodec(tile=4, topk=3)
    payload = bytearray(codec.encode(torch.randn(8, 8)))
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(bytes(payload[:-1]), (8, 8), torch.float32)
    repeated = bytearray(payload)
    repeated[-2:] = b"\x00\x00"  # the last tile's indices all 0: not increasing
    with pytest.raises(CodecError, match="increasing"):
        codec.decode(bytes(repeated), (8, 8), torch.float32)


def test_the_paper_variant_stays_the_default_and_the_planner_prices_both() -> None:
    from farlink.plan.payload import codec_cost

    cfg = RunConfig(algorithm="sparseloco")
    assert cfg.sparseloco_variant == "paper"
    authors = RunConfig(algorithm="sparseloco", sparseloco_variant="authors")
    spec = algorithm_class("sparseloco").wire_spec(authors)
    assert spec == "sparseloco:tiles:64:64"
    assert codec_cost(spec).bytes_per_param == pytest.approx(64 / 4096 * 14 / 8)
