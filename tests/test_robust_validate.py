"""Update screening: every bad update is rejected with a reason, every sane one is kept."""

from __future__ import annotations

import logging

import pytest
import torch

from farlink.robust.validate import (
    UpdateRejected,
    check_update,
    reason_kind,
    screen_peer_updates,
    screen_updates,
)

torch.set_num_threads(1)


def _honest(n: int, seed: int = 0, shape=(50,)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(shape, generator=gen) for i in range(n)}


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


def test_screen_updates_rejects_each_kind_and_logs(caplog):
    updates = _honest(6)
    updates["nan"] = torch.full((50,), float("nan"))
    updates["shape"] = torch.ones(49)
    updates["huge"] = updates["p0"] * 11  # 11x a typical norm: over the 10x median rule
    updates["int"] = torch.ones(50, dtype=torch.int32)
    with caplog.at_level(logging.WARNING, logger="farlink.robust.validate"):
        accepted, rejected = screen_updates(updates, name="layer.w")
    assert sorted(accepted) == [f"p{i}" for i in range(6)]
    assert {p: reason_kind(r) for p, r in rejected.items()} == {
        "nan": "nonfinite", "shape": "shape", "huge": "relative_norm", "int": "dtype"}
    assert "layer.w" in rejected["huge"] and "median" in rejected["huge"]
    for peer in rejected:
        assert any(peer in rec.getMessage() for rec in caplog.records)


def test_relative_bound_uses_the_median_of_sane_updates():
    updates = _honest(4)
    updates["big"] = updates["p1"] * 9  # below 10x: kept
    accepted, rejected = screen_updates(updates)
    assert "big" in accepted and not rejected
    _, rejected = screen_updates(updates, relative_bound=5.0)
    assert list(rejected) == ["big"]
    accepted, rejected = screen_updates(updates, relative_bound=None)
    assert len(accepted) == 5


def test_absolute_max_norm_and_zero_median():
    updates = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.ones(4)}
    accepted, rejected = screen_updates(updates)  # median norm 0: relative rule skipped
    assert len(accepted) == 3 and not rejected
    accepted, rejected = screen_updates(updates, max_norm=2.0)
    assert len(accepted) == 3
    _, rejected = screen_updates(updates, max_norm=1.9)
    assert reason_kind(rejected["c"]) == "norm"


def test_expected_shape_defaults_to_the_common_one():
    updates = {"a": torch.ones(3), "b": torch.ones(3), "c": torch.ones(2, 2)}
    accepted, rejected = screen_updates(updates)
    assert set(accepted) == {"a", "b"} and reason_kind(rejected["c"]) == "shape"
    _, rejected = screen_updates(updates, shape=(2, 2))
    assert set(rejected) == {"a", "b"}


def test_screen_peer_updates_rejects_whole_peers():
    shapes = {"w": (5, 4), "b": (4,)}
    gen = torch.Generator().manual_seed(3)
    ups = {f"p{i}": {"w": torch.randn(5, 4, generator=gen), "b": torch.randn(4, generator=gen)}
           for i in range(5)}
    ups["partial"] = {"w": torch.randn(5, 4)}
    ups["nan_b"] = {"w": torch.randn(5, 4), "b": torch.tensor([0.0, 1.0, float("nan"), 0.0])}
    ups["scaled"] = {k: v * 100 for k, v in ups["p0"].items()}
    accepted, rejected = screen_peer_updates(ups, shapes)
    assert sorted(accepted) == [f"p{i}" for i in range(5)]
    assert {p: reason_kind(r) for p, r in rejected.items()} == {
        "partial": "shape", "nan_b": "nonfinite", "scaled": "relative_norm"}
    _, rejected = screen_peer_updates(ups, shapes, max_norm=1.0)
    assert all(reason_kind(r) in ("norm", "shape", "nonfinite") for r in rejected.values())
    assert len(rejected) == len(ups)
