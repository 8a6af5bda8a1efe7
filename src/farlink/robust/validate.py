"""Checks an update must pass before it may touch the parameters.

Bytes that decode are not yet a sane update: a peer (faulty or hostile) can send the wrong shape,
NaN/Inf, or a vector a thousand times longer than anyone else's. Each check raises
:class:`UpdateRejected` with a ``kind`` (``shape``, ``dtype``, ``nonfinite``, ``norm``,
``relative_norm``) so a ledger can count reasons, and a message saying what was wrong.

The relative rule compares each update's norm with the median norm of the round's updates that
passed the other checks; it assumes honest peers are the majority (otherwise no rule based on the
round's own updates can tell who is honest), and it is skipped when the median norm is zero.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

log = logging.getLogger(__name__)

DEFAULT_RELATIVE_BOUND = 10.0


class UpdateRejected(ValueError):
    """An update that is well-formed bytes but not a sane update (NaN, absurd norm, ...)."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def reason(self) -> str:
        """``"kind: message"``: the form ledgers and logs use."""
        return f"{self.kind}: {self}"


def check_update(
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int, ...],
    max_norm: float | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Raise :class:`UpdateRejected` unless ``tensor`` is a finite float tensor of ``shape``."""
    if tuple(tensor.shape) != tuple(shape):
        raise UpdateRejected(
            f"{name}: shape {tuple(tensor.shape)} != expected {tuple(shape)}", "shape")
    if not tensor.is_floating_point():
        raise UpdateRejected(f"{name}: dtype {tensor.dtype} is not floating point", "dtype")
    if dtype is not None and tensor.dtype != dtype:
        raise UpdateRejected(f"{name}: dtype {tensor.dtype} != expected {dtype}", "dtype")
    if not torch.isfinite(tensor).all():
        raise UpdateRejected(f"{name}: contains NaN or Inf", "nonfinite")
    if max_norm is not None:
        norm = float(tensor.float().norm())
        if norm > max_norm:
            raise UpdateRejected(f"{name}: norm {norm:.3g} exceeds bound {max_norm:.3g}", "norm")


def _norm(update: torch.Tensor | Mapping[str, torch.Tensor]) -> float:
    if isinstance(update, Mapping):
        return float(sum(float(t.float().pow(2).sum()) for t in update.values())) ** 0.5
    return float(update.float().norm())


def _relative_screen(
    candidates: dict[str, float], relative_bound: float | None, label: str
) -> dict[str, str]:
    """Reasons for the candidates whose norm exceeds ``relative_bound`` x the median norm."""
    if relative_bound is None or not candidates:
        return {}
    norms = torch.tensor(sorted(candidates.values()), dtype=torch.float64)
    median = float(norms.median()) if len(norms) % 2 else float(
        norms[len(norms) // 2 - 1 : len(norms) // 2 + 1].mean())
    if median <= 0.0:
        return {}
    bound = relative_bound * median
    return {
        peer: f"relative_norm: {label}: norm {n:.3g} exceeds {relative_bound:g} x median "
              f"{median:.3g}"
        for peer, n in candidates.items() if n > bound
    }


def screen_updates(
    updates: Mapping[str, torch.Tensor],
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    max_norm: float | None = None,
    relative_bound: float | None = DEFAULT_RELATIVE_BOUND,
    name: str = "update",
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split one tensor's per-peer updates into ``(accepted, rejected: peer -> reason)``.

    ``shape`` defaults to the most common shape among the updates (so a lone odd one is the one
    rejected). Every rejection is logged at WARNING with its reason.
    """
    if shape is None and updates:
        shapes = [tuple(t.shape) for t in updates.values()]
        shape = max(set(shapes), key=shapes.count)
    accepted: dict[str, torch.Tensor] = {}
    rejected: dict[str, str] = {}
    norms: dict[str, float] = {}
    for peer, tensor in updates.items():
        try:
            check_update(name, tensor, tuple(shape or ()), max_norm, dtype)
        except UpdateRejected as exc:
            rejected[peer] = exc.reason
            continue
        accepted[peer] = tensor
        norms[peer] = _norm(tensor)
    for peer, reason in _relative_screen(norms, relative_bound, name).items():
        rejected[peer] = reason
        del accepted[peer]
    for peer, reason in rejected.items():
        log.warning("rejected update from %s: %s", peer, reason)
    return accepted, rejected


def screen_peer_updates(
    updates: Mapping[str, Mapping[str, torch.Tensor]],
    shapes: Mapping[str, Sequence[int]],
    dtype: torch.dtype | None = None,
    max_norm: float | None = None,
    relative_bound: float | None = DEFAULT_RELATIVE_BOUND,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """Like :func:`screen_updates` for whole updates (``peer -> {tensor name -> tensor}``).

    A peer is rejected as a whole if any tensor fails, if its tensor names differ from
    ``shapes``, or if its global norm (over all tensors) exceeds ``max_norm`` or
    ``relative_bound`` x the median global norm: accepting half of a bad update would mix it in.
    """
    accepted: dict[str, dict[str, torch.Tensor]] = {}
    rejected: dict[str, str] = {}
    norms: dict[str, float] = {}
    for peer, tensors in updates.items():
        missing = set(shapes) - set(tensors)
        extra = set(tensors) - set(shapes)
        if missing or extra:
            rejected[peer] = (f"shape: tensor names differ (missing {sorted(missing)[:3]}, "
                              f"unexpected {sorted(extra)[:3]})")
            continue
        try:
            for name, tensor in tensors.items():
                check_update(name, tensor, tuple(shapes[name]), None, dtype)
        except UpdateRejected as exc:
            rejected[peer] = exc.reason
            continue
        norm = _norm(tensors)
        if max_norm is not None and norm > max_norm:
            rejected[peer] = f"norm: update: norm {norm:.3g} exceeds bound {max_norm:.3g}"
            continue
        accepted[peer] = dict(tensors)
        norms[peer] = norm
    for peer, reason in _relative_screen(norms, relative_bound, "update").items():
        rejected[peer] = reason
        del accepted[peer]
    for peer, reason in rejected.items():
        log.warning("rejected update from %s: %s", peer, reason)
    return accepted, rejected


def reason_kind(reason: str) -> str:
    """The category of a rejection reason (the text before the first colon)."""
    return reason.split(":", 1)[0].strip() or "invalid"
