"""Checks an update must pass before it may touch the parameters.

Bytes that decode are not yet a sane update: a peer (faulty or hostile) can send the wrong shape,
NaN/Inf, or a vector a thousand times longer than anyone else's. :func:`check_update` raises
:class:`UpdateRejected` with a ``kind`` (``shape``, ``dtype``, ``nonfinite``, ``norm``) so a
ledger can count reasons, and a message saying what was wrong; :func:`screen_norms` is the
round-relative rule. :class:`~farlink.sync.exchange.Exchange` runs both on every gathered round.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


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


def screen_norms(updates: Mapping[str, Mapping[str, torch.Tensor]],
                 ratio: float | None) -> dict[str, str]:
    """Peers whose whole update (every tensor together) is longer than ``ratio`` x the round's
    median norm, with the reason; the exchange drops them before aggregating.

    The median is torch's (the lower middle value for an even count), over the updates that
    passed :func:`check_update`. It assumes honest peers are the majority (no rule based on
    the round's own updates can tell who is honest otherwise), so it needs 3 peers at least,
    and it is skipped when the median is zero.
    """
    if ratio is None or len(updates) < 3:
        return {}
    norms = {p: float(torch.sqrt(sum((t.double() ** 2).sum() for t in u.values())))
             for p, u in updates.items()}
    median = float(torch.tensor(list(norms.values())).median())
    if median <= 0:
        return {}
    return {p: f"update norm {n:.3g} > {ratio:g} x round median {median:.3g}"
            for p, n in norms.items() if n > ratio * median}


def reason_kind(reason: str) -> str:
    """The category of a rejection reason (the text before the first colon)."""
    return reason.split(":", 1)[0].strip() or "invalid"
