"""Update screening: every bad update is rejected with a reason, every sane one is kept."""

from __future__ import annotations

import pytest
import torch

from farlink.robust.validate import UpdateRejected, check_update, screen_norms

torch.set_num_threads(1)


def test_check_update_kinds():
    ok = torch.ones(3)
    check_update("w", ok, (3,))
    cases = [
        (torch.ones(4), (3,), {}, "shape"),
        (torch.ones(3, dtype=torch.int64), (3,), {}, "dtype"),
        (torch.ones(3, dtype=torch.float16), (3,), {"dtype": torch.float32}, "dtype"),
        (torch.tensor([1.0, float("nan"), 0.0]), (3,), {}, "nonfinite"),
        (torch.tensor([1.0, float("-inf"), 0.0]), (3,), {}, "nonfinite"),
        (torch.full((3,), 10.0), (3,), {"max_norm": 5.0}, "norm"),
    ]
    for tensor, shape, kw, kind in cases:
        with pytest.raises(UpdateRejected) as info:
            check_update("w", tensor, shape, **kw)
        assert info.value.kind == kind and info.value.reason.startswith(kind + ": w")


def _peers(n: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": {"w": torch.randn(5, 4, generator=gen), "b": torch.randn(4, generator=gen)}
            for i in range(n)}


def test_screen_norms_rejects_whole_updates_past_ratio_x_median():
    ups = _peers(5)
    ups["scaled"] = {k: v * 100 for k, v in ups["p0"].items()}
    ups["big"] = {k: v * 1.5 for k, v in ups["p1"].items()}  # well under 10x the median
    rejected = screen_norms(ups, 10.0)
    assert list(rejected) == ["scaled"] and "median" in rejected["scaled"]
    # by hand: the norm over both tensors, against torch's (lower) median of the 7 norms
    norms = sorted(float(torch.cat([u["w"].reshape(-1), u["b"]]).double().norm())
                   for u in ups.values())
    assert f"{norms[3]:.3g}" in rejected["scaled"]
    assert screen_norms(ups, None) == {}


def test_screen_norms_needs_three_peers_and_a_nonzero_median():
    two = _peers(2)
    two["p1"] = {k: v * 1000 for k, v in two["p1"].items()}
    assert screen_norms(two, 10.0) == {}  # two peers: no majority to compare with
    zeros = {p: {"w": torch.zeros(3)} for p in "abc"}
    zeros["d"] = {"w": torch.ones(3)}
    assert screen_norms(zeros, 10.0) == {}
