"""Aggregation rules against numpy/scipy references, and against attacks they must withstand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from farlink.robust.aggregators import (
    AGGREGATORS,
    cap_weights,
    centered_clip,
    coordinate_median,
    krum,
    make_aggregator,
    norm_bounded,
    trimmed_mean,
    weighted_mean,
)
from farlink.robust.attacks import make_attack

torch.set_num_threads(1)

X = torch.tensor([[1.0, -2.0, 3.0], [2.0, 0.0, 1.0], [10.0, 5.0, -7.0], [4.0, 1.0, 2.0]])
W = torch.tensor([1.0, 2.0, 1.0, 1.0])


def test_mean_matches_numpy_weighted_average():
    ref = np.average(X.numpy(), axis=0, weights=W.numpy())
    np.testing.assert_allclose(weighted_mean(X, W).numpy(), ref, rtol=1e-6)


def test_median_matches_numpy_for_odd_and_even_n():
    for n in (3, 4):
        np.testing.assert_allclose(coordinate_median(X[:n], W[:n]).numpy(),
                                   np.median(X[:n].numpy(), axis=0), rtol=1e-6)


def test_trimmed_mean_equal_weights_matches_scipy():
    x = torch.randn(9, 5, 2, generator=torch.Generator().manual_seed(1))
    for f in (0.0, 0.1, 0.25, 0.4):
        ref = stats.trim_mean(x.numpy(), f, axis=0)
        np.testing.assert_allclose(trimmed_mean(x, torch.ones(9), f).numpy(), ref, rtol=1e-5)


def test_trimmed_mean_weighted_by_hand():
    # column 0 sorted: 1(w1) 2(w2) 4(w1) 10(w1); trim 1 each end -> (2*2 + 4*1) / 3
    # column 1: -2(w1) 0(w2) 1(w1) 5(w1) -> (0*2 + 1*1) / 3; column 2: -7 1(w2) 2(w1) 3 -> 4/3
    out = trimmed_mean(X, W, 0.25)
    np.testing.assert_allclose(out.numpy(), [8 / 3, 1 / 3, 4 / 3], rtol=1e-6)


def test_trimmed_mean_rejects_bad_fraction():
    with pytest.raises(ValueError):
        trimmed_mean(X, W, 0.5)
    with pytest.raises(ValueError):
        make_aggregator("trimmed_mean:0.7")


def _numpy_centered_clip(x, w, v, tau, iters):
    for _ in range(iters):
        d = x - v
        n = np.linalg.norm(d, axis=1, keepdims=True)
        v = v + (w[:, None] * d * np.minimum(1.0, tau / n)).sum(0) / w.sum()
    return v


def test_centered_clip_matches_numpy_iteration():
    x = X.double().numpy()
    v0 = np.median(x, axis=0)
    w = np.array([1.0, 2.0, 1.0, 1.0])  # all within 2x the median weight: cap changes nothing
    for tau in (0.5, 2.0, 100.0):
        ref = _numpy_centered_clip(x, w, v0, tau, 3)
        np.testing.assert_allclose(centered_clip(X.double(), W, tau=tau).numpy(), ref,
                                   rtol=1e-9)
    # tau far above every distance: plain weighted mean reached after one step
    np.testing.assert_allclose(centered_clip(X.double(), W, tau=1e9, iters=1).numpy(),
                               np.average(x, axis=0, weights=w), rtol=1e-9)


def test_centered_clip_reference_start():
    ref = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)
    got = centered_clip(X.double(), W, tau=1.0, iters=1, reference=ref)
    expect = _numpy_centered_clip(X.double().numpy(), W.double().numpy(), ref.numpy(), 1.0, 1)
    np.testing.assert_allclose(got.numpy(), expect, rtol=1e-9)


def test_norm_bounded_by_hand():
    x = torch.tensor([[3.0, 4.0], [0.0, 1.0], [30.0, 40.0]])  # norms 5, 1, 50 -> median 5
    out = norm_bounded(x, torch.ones(3))
    np.testing.assert_allclose(out.numpy(), ((np.array([3, 4]) * 2 + [0, 1]) / 3), rtol=1e-6)
    out2 = norm_bounded(x, torch.ones(3), factor=2.0)  # bound 10: [30,40] -> [6,8]
    np.testing.assert_allclose(out2.numpy(), (np.array([3, 4]) + [0, 1] + [6, 8]) / 3, rtol=1e-6)


def test_krum_by_hand():
    x = torch.tensor([[0.0], [1.5], [2.0], [100.0], [3.0]])
    # f=1: score = sum of the 2 nearest squared distances:
    # 0 -> 2.25 + 4 = 6.25, 1.5 -> 0.25 + 2.25 = 2.5, 2 -> 0.25 + 1 = 1.25, 3 -> 1 + 2.25, 100 -> big
    assert krum(x, torch.ones(5), f=1).item() == 2.0
    assert make_aggregator("krum:1")(x, torch.ones(5)).item() == 2.0


def test_cap_weights_limits_claimed_tokens():
    w = cap_weights(torch.tensor([100.0, 100.0, 100.0, 1e9]))
    assert w.tolist() == [100.0, 100.0, 100.0, 200.0]


def test_make_aggregator_names_and_errors():
    for name in AGGREGATORS:
        out = make_aggregator(name)(X, W)
        assert out.shape == X.shape[1:] and out.dtype == X.dtype
    assert make_aggregator("centered_clip:1.0")(X, W).shape == (3,)
    for bad in ("nope", "median:3", "trimmed_mean:abc", "krum:-1"):
        with pytest.raises(ValueError):
            make_aggregator(bad)


def test_bfloat16_and_multidim_shapes_survive():
    x = torch.randn(5, 3, 4).to(torch.bfloat16)
    for name in AGGREGATORS:
        out = make_aggregator(name)(x, torch.ones(5))
        assert out.shape == (3, 4) and out.dtype == torch.bfloat16


# --- robustness -------------------------------------------------------------------------------

ROBUST = {
    "scale:100": ["median", "trimmed_mean", "centered_clip", "norm_bounded", "krum"],
    "sign_flip": ["median", "trimmed_mean", "centered_clip", "krum"],  # norm_bounded: no
    "noise:30": ["median", "trimmed_mean", "centered_clip", "krum"],
}


def _round(n: int, n_bad: int, attack: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(2000, generator=gen)
    honest = [base + 0.1 * torch.randn(2000, generator=gen) for _ in range(n)]
    att = make_attack(attack, seed=seed)
    sent = [att({"w": h}, 0)["w"] if i < n_bad else h for i, h in enumerate(honest)]
    honest_mean = torch.stack(honest[n_bad:]).mean(0)
    return torch.stack(sent), torch.full((n,), 1000.0), honest_mean


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("n,n_bad", [(4, 1), (8, 2)])
@pytest.mark.parametrize("attack", sorted(ROBUST))
def test_robust_rules_stay_near_honest_mean(n, n_bad, attack):
    updates, weights, honest = _round(n, n_bad, attack, seed=n * 10 + n_bad)
    mean_err = _rel_err(weighted_mean(updates, weights), honest)
    assert mean_err > (0.4 if attack == "sign_flip" else 5.0)  # the attack does hurt the mean
    for name in ROBUST[attack]:
        err = _rel_err(make_aggregator(name)(updates, weights), honest)
        assert err < 0.1, f"{name} under {attack}: relative error {err:.3f}"


@pytest.mark.parametrize("n,n_bad", [(4, 1), (8, 2)])
def test_norm_bounded_limits_noise_to_its_share(n, n_bad):
    """Noise keeps its direction but loses its size: error <= (n_bad / n) x ~2 (bound + honest)."""
    updates, weights, honest = _round(n, n_bad, "noise:30", seed=5)
    assert _rel_err(weighted_mean(updates, weights), honest) > 5.0
    assert _rel_err(norm_bounded(updates, weights), honest) < 2.2 * n_bad / n


def test_claimed_tokens_cannot_buy_influence():
    updates, _, honest = _round(4, 1, "scale:100", seed=3)
    weights = torch.tensor([1e12, 1000.0, 1000.0, 1000.0])  # the attacker claims a huge batch
    assert _rel_err(weighted_mean(updates, weights), honest) > 50
    for name in ("trimmed_mean", "centered_clip", "norm_bounded"):
        assert _rel_err(make_aggregator(name)(updates, weights), honest) < 0.1, name


def test_centered_clip_defaults_median_start_median_radius_three_iterations():
    """farlink's defaults, each pinned: start at the coordinate median, tau = the median
    distance of the updates from it, 3 iterations (see the module doc for the paper's)."""
    x = X.double().numpy()
    w = W.double().numpy()
    v0 = np.median(x, axis=0)
    distances = np.sort(np.linalg.norm(x - v0, axis=1))
    tau = distances[(len(distances) - 1) // 2]  # the lower median for an even count
    expected = _numpy_centered_clip(x, w, v0, tau, 3)
    np.testing.assert_allclose(centered_clip(X.double(), W).numpy(), expected, rtol=1e-9)
    for other in (_numpy_centered_clip(x, w, v0, tau, 1),        # not 1 iteration
                  _numpy_centered_clip(x, w, v0, 2 * tau, 3),    # not another radius
                  _numpy_centered_clip(x, w, x.mean(0), tau, 3)):  # not another start
        assert np.abs(other - expected).max() > 1e-3


def test_centered_clip_paper_form_one_step_from_the_previous_aggregate():
    """Karimireddy et al.: v = v_prev + mean_i clip(x_i - v_prev, tau), one iteration, by hand."""
    previous = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    x = torch.tensor([[1.0, 0.0, 1.0], [4.0, 4.0, 1.0], [1.0, 0.5, 1.0]], dtype=torch.float64)
    # offsets: 0; (3, 4, 0) of norm 5 clipped to tau = 1 -> (0.6, 0.8, 0); (0, 0.5, 0) kept
    got = centered_clip(x, torch.ones(3), tau=1.0, iters=1, reference=previous)
    expected = previous + torch.tensor([0.6, 0.8 + 0.5, 0.0], dtype=torch.float64) / 3
    torch.testing.assert_close(got, expected)


def test_per_tensor_suffix():
    rule = make_aggregator("krum:1+per_tensor")
    assert rule(torch.tensor([[0.0], [1.5], [2.0], [100.0], [3.0]]), torch.ones(5)).item() == 2.0
    assert make_aggregator("mean+per_tensor") is weighted_mean  # the mean splits exactly
    with pytest.raises(ValueError):
        make_aggregator("nope+per_tensor")
