"""Checks an update must pass before it may touch the parameters."""

from __future__ import annotations

import torch


class UpdateRejected(ValueError):
    """An update that is well-formed bytes but not a sane update (NaN, absurd norm, ...)."""


def check_update(
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int, ...],
    max_norm: float | None = None,
) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise UpdateRejected(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(shape)}")
    if not tensor.is_floating_point():
        raise UpdateRejected(f"{name}: dtype {tensor.dtype} is not floating point")
    if not torch.isfinite(tensor).all():
        raise UpdateRejected(f"{name}: contains NaN or Inf")
    if max_norm is not None:
        norm = float(tensor.float().norm())
        if norm > max_norm:
            raise UpdateRejected(f"{name}: norm {norm:.3g} exceeds bound {max_norm:.3g}")
