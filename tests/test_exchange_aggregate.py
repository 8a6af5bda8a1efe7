"""The exchange hands robust rules each peer's whole update (real in-process gather), and
carries pre-encoded payloads unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from farlink.codecs import make_codec, make_compressor
from farlink.comm.inprocess import InProcessGroup
from farlink.robust.aggregators import make_aggregator
from farlink.sync.exchange import Encoded, Exchange

# Five peers, two tensors. Tensor a alone: Krum (f=1) picks peer 0's a; tensor b alone: peer 1's.
# Over the whole update peer 3 is the most central.
A = [[-0.3], [2.7], [-1.3], [0.7], [1.8]]
B = [[0.2], [-1.5], [-1.8], [-0.9], [0.4]]


def _round(aggregator: str, updates=None):  # noqa: ANN001, ANN202
    updates = updates or [{"a": torch.tensor(a), "b": torch.tensor(b)} for a, b in zip(A, B)]

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        ex = Exchange(collective, make_compressor("none"), sender=f"p{rank}",
                      aggregator=make_aggregator(aggregator))
        collective.begin_round()
        return ex.average(updates[rank], 1.0, 0).tensors

    return InProcessGroup(len(updates)).run(member)


def _krum_by_hand(points: np.ndarray, f: int) -> int:
    d2 = ((points[:, None, :] - points[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d2, np.inf)
    return int(np.sort(d2, axis=1)[:, : len(points) - f - 2].sum(1).argmin())


def test_krum_picks_one_peers_whole_update() -> None:
    whole = np.hstack([np.array(A), np.array(B)])
    chosen = _krum_by_hand(whole, 1)
    assert chosen == 3
    assert (_krum_by_hand(np.array(A), 1), _krum_by_hand(np.array(B), 1)) == (0, 1)
    for out in _round("krum:1"):
        assert (out["a"].item(), out["b"].item()) == pytest.approx((A[chosen][0], B[chosen][0]))
    for out in _round("krum:1+per_tensor"):  # the option: a from peer 0, b from peer 1
        assert (out["a"].item(), out["b"].item()) == pytest.approx((A[0][0], B[1][0]))


def test_centered_clip_bounds_the_whole_update() -> None:
    x = np.hstack([np.array(A), np.array(B)])
    v = np.median(x, axis=0)
    tau = 1.0
    for _ in range(3):
        d = x - v
        norms = np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-300)
        v = v + (d * np.minimum(1.0, tau / norms)).mean(0)
    for out in _round("centered_clip:1.0"):
        np.testing.assert_allclose([out["a"].item(), out["b"].item()], v, rtol=1e-6)


def test_encoded_payloads_are_sent_unchanged() -> None:
    codec = make_codec("int8")
    tensor = torch.linspace(-1, 1, 50)
    payload = codec.encode(tensor * 3)  # deliberately not the encoding of `tensor`
    decoded = codec.decode(payload, tensor.shape, torch.float32)

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        ex = Exchange(collective, make_compressor("int8"), sender=f"p{rank}")
        collective.begin_round()
        return ex.average({"t": Encoded(payload, decoded)}, 1.0, 0).tensors["t"]

    for out in InProcessGroup(2).run(member):
        torch.testing.assert_close(out, decoded, rtol=0, atol=0)
