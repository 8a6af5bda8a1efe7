"""DeMo against an independent re-implementation of the reference step (bloc97/DeMo), written
here from the paper and the reference with scipy's DCT, and its error feedback on shapes that
are not multiples of the chunk."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch
from torch import nn

from farlink.comm.inprocess import InProcessGroup
from farlink.compose import wire
from farlink.config import RunConfig
from farlink.sync.demo import DeMo
from farlink.sync.exchange import Exchange

# (64, 128) and (64,) are whole chunks; the others are not (a vocabulary of 100 tokens, say)
SHAPES = [(64, 128), (96, 128), (128, 96), (100,), (64,)]


class Params(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s, generator=gen)) for s in shapes)


def _demo(collective, shapes, **overrides) -> DeMo:  # noqa: ANN001
    cfg = RunConfig(algorithm="demo", steps=100, warmup_steps=0, **overrides)
    exchange = Exchange(collective, sender=f"p{id(collective)}", **wire(DeMo, cfg, cfg.codec))
    return DeMo(Params(shapes), cfg, collective, exchange)


def _grad(rank: int, step: int, index: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + index)
    return torch.randn(shape, generator=gen)


# --- the reference step, independently --------------------------------------------------------
def _tiles(x: np.ndarray, chunk: int) -> tuple[np.ndarray, tuple]:
    """Zero-padded chunks: 1-d -> [n, c]; matrices -> [n_r * n_c, cr, cc] (row-major grid)."""
    if x.ndim == 1:
        c = min(chunk, x.size)
        n = math.ceil(x.size / c)
        return np.pad(x, (0, n * c - x.size)).reshape(n, c), (x.shape, c)
    rows, cols = x.shape
    cr, cc = min(chunk, rows), min(chunk, cols)
    nr, nc = math.ceil(rows / cr), math.ceil(cols / cc)
    padded = np.pad(x, ((0, nr * cr - rows), (0, nc * cc - cols)))
    tiles = padded.reshape(nr, cr, nc, cc).transpose(0, 2, 1, 3).reshape(nr * nc, cr, cc)
    return tiles, (x.shape, (nr, nc, cr, cc))


def _untile(tiles: np.ndarray, geometry: tuple) -> np.ndarray:
    shape, g = geometry
    if len(shape) == 1:
        return tiles.reshape(-1)[: shape[0]]
    nr, nc, cr, cc = g
    full = tiles.reshape(nr, nc, cr, cc).transpose(0, 2, 1, 3).reshape(nr * cr, nc * cc)
    return full[: shape[0], : shape[1]]


def _dct(tiles: np.ndarray) -> np.ndarray:
    axes = tuple(range(1, tiles.ndim))
    return scipy.fft.dctn(tiles, type=2, norm="ortho", axes=axes)


def _idct(coeffs: np.ndarray) -> np.ndarray:
    axes = tuple(range(1, coeffs.ndim))
    return scipy.fft.idctn(coeffs, type=2, norm="ortho", axes=axes)


def _compress(delta: np.ndarray, chunk: int, topk: int):  # noqa: ANN202
    tiles, geometry = _tiles(delta, chunk)
    coeffs = _dct(tiles).reshape(len(tiles), -1)
    k = min(topk, coeffs.shape[1])
    idx = np.argsort(-np.abs(coeffs), axis=1, kind="stable")[:, :k]
    return idx, np.take_along_axis(coeffs, idx, axis=1), tiles.shape, geometry


def _decompress(idx: list[np.ndarray], val: list[np.ndarray], tile_shape, geometry):  # noqa: ANN001
    """scatter_reduce('mean', include_self=False): each coefficient over the peers that sent it."""
    n = tile_shape[0]
    total = np.zeros((n, math.prod(tile_shape[1:])))
    count = np.zeros_like(total)
    for i, v in zip(idx, val):
        np.add.at(total, (np.arange(n)[:, None], i), v)
        np.add.at(count, (np.arange(n)[:, None], i), 1.0)
    mean = np.where(count > 0, total / np.maximum(count, 1), 0.0)
    return _untile(_idct(mean.reshape(tile_shape)), geometry)


def reference_steps(params, grads_per_rank, lrs, beta, wd, chunk, topk):  # noqa: ANN001, ANN201
    """The reference optimizer over len(lrs) steps for len(grads_per_rank) peers (float64)."""
    world = len(grads_per_rank)
    params = [p.astype(np.float64) for p in params]
    deltas = [[np.zeros_like(p) for p in params] for _ in range(world)]
    history = []
    for step, lr in enumerate(lrs):
        gathered = []
        for rank in range(world):
            sent = []
            for i, p in enumerate(params):
                d = deltas[rank][i]
                d *= beta
                d += lr * grads_per_rank[rank][step][i]
                idx, val, tile_shape, geometry = _compress(d, chunk, topk)
                d -= _decompress([idx], [val], tile_shape, geometry)
                sent.append((idx, val, tile_shape, geometry))
            gathered.append(sent)
        for i in range(len(params)):
            parts = [gathered[r][i] for r in range(world)]
            avg = _decompress([p[0] for p in parts], [p[1] for p in parts], parts[0][2],
                              parts[0][3])
            params[i] = params[i] * (1 - lr * wd) - lr * np.sign(avg)
        history.append([p.copy() for p in params])
    return history


@pytest.mark.parametrize("world", [1, 3])
def test_demo_step_matches_an_independent_reference(world: int) -> None:
    steps, chunk, topk = 4, 64, 8

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = _demo(collective, SHAPES, demo_chunk=chunk, demo_topk=topk, demo_lr=0.01,
                     demo_beta=0.9, weight_decay=0.1)
        out, lrs, start = [], [], [p.detach().double().numpy().copy() for p in algo.params]
        for step in range(steps):
            for i, (p, s) in enumerate(zip(algo.params, SHAPES)):
                p.grad = _grad(rank, step, i, s)
            lrs.append(algo.current_lr())
            assert algo.step(16).committed
            out.append([p.detach().double().numpy().copy() for p in algo.params])
        return start, lrs, out

    results = InProcessGroup(world).run(member, timeout=120)
    start, lrs, _ = results[0]
    grads = [[[_grad(r, t, i, s).double().numpy() for i, s in enumerate(SHAPES)]
              for t in range(steps)] for r in range(world)]
    expected = reference_steps(start, grads, lrs, beta=0.9, wd=0.1, chunk=chunk, topk=topk)
    for _, _, got in results:
        for step in range(steps):
            for shape, g, e in zip(SHAPES, got[step], expected[step]):
                np.testing.assert_allclose(g, e, rtol=0, atol=1e-5,
                                           err_msg=f"step {step}, shape {shape}")


def test_peers_receive_exactly_what_was_subtracted_from_the_momentum() -> None:
    """On a single peer the exchange's average is that peer's decoded payload, so it must equal
    what the step took out of the momentum, whatever the shape."""
    shapes = [(96, 128), (128, 96), (100,)]

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        # lr 1 at the first step: m = beta * 0 + 1 * g, the same in either momentum form
        algo = _demo(collective, shapes, demo_lr=1.0)
        grads = [_grad(0, 0, i, s) for i, s in enumerate(shapes)]
        for p, g in zip(algo.params, grads):
            p.grad = g.clone()
        algo.step(16)
        received = algo.last_exchange.tensors
        for name, g, m, shape in zip(algo.names, grads, algo.momentum, shapes):
            subtracted = g - m
            error = (received[name] - subtracted).norm() / subtracted.norm()
            assert error < 1e-6, f"{shape}: peers received something else (rel. error {error:.3g})"

    InProcessGroup(1).run(member)


def test_demo_rejects_a_codec_it_cannot_send() -> None:
    group = InProcessGroup(1)
    with pytest.raises(ValueError, match="DCT top-k"):
        _demo(group.member(0), [(4,)], codec="int8")
    with pytest.raises(ValueError, match="own error feedback"):
        _demo(group.member(0), [(4,)], codec="dct_topk:64:32+ef")
