"""Emulated misbehaving peers, for benchmarks and tests of the robust path.

These are *emulations*: a function that rewrites the update an honest worker computed, before it
is encoded and sent, so a benchmark can run "k of n peers are hostile" with real training, real
codecs and real aggregation. They model classic attacks from the Byzantine-robust learning
literature, not an adaptive adversary that knows the aggregation rule.

``make_attack(spec)`` with ``spec`` one of:

- ``none``: the honest update;
- ``sign_flip``: ``-x`` (pushes training backwards);
- ``scale[:k]``: ``k x`` (default 100);
- ``noise[:std]``: ``x + N(0, std^2)`` per coordinate (default std 1.0), seeded per round;
- ``nan``: every value NaN (a broken worker; validation must catch it);
- ``free_rider``: zeros, while still claiming the tokens of an honest update;
- ``free_rider:stale``: replays its first update every round instead of computing a new one.

The claimed tokens are the caller's business: an attack only rewrites tensors, so a free rider
claims what the honest worker would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Update = dict[str, torch.Tensor]
Attack = Callable[[Update, int], Update]


def no_attack(update: Update, round_id: int) -> Update:
    return update


def sign_flip(update: Update, round_id: int) -> Update:
    return {k: -v for k, v in update.items()}


def nan_update(update: Update, round_id: int) -> Update:
    return {k: torch.full_like(v, float("nan")) for k, v in update.items()}


class Scale:
    def __init__(self, factor: float = 100.0) -> None:
        self.factor = factor

    def __call__(self, update: Update, round_id: int) -> Update:
        return {k: v * self.factor for k, v in update.items()}


class GaussianNoise:
    """Adds noise drawn from a generator seeded by ``(seed, round_id)``: reruns are identical."""

    def __init__(self, std: float = 1.0, seed: int = 0) -> None:
        if std < 0:
            raise ValueError(f"noise std must be >= 0, got {std}")
        self.std, self.seed = std, seed

    def __call__(self, update: Update, round_id: int) -> Update:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + round_id)
        out = {}
        for k in sorted(update):
            v = update[k]
            noise = torch.randn(v.shape, generator=gen, dtype=torch.float32) * self.std
            out[k] = v + noise.to(device=v.device, dtype=v.dtype)  # same noise on any device
        return {k: out[k] for k in update}


class FreeRider:
    """Contributes nothing new: zeros, or (``stale``) the first update it ever made."""

    def __init__(self, stale: bool = False) -> None:
        self.stale = stale
        self._first: Update | None = None

    def __call__(self, update: Update, round_id: int) -> Update:
        if not self.stale:
            return {k: torch.zeros_like(v) for k, v in update.items()}
        if self._first is None:
            self._first = {k: v.detach().clone() for k, v in update.items()}
        return {k: v.clone() for k, v in self._first.items()}


ATTACKS = ("none", "sign_flip", "scale", "noise", "nan", "free_rider")


def make_attack(spec: str, seed: int = 0) -> Attack:
    """Parse ``NAME[:ARG]`` (see module docstring); unknown names raise ValueError."""
    name, _, arg = (spec or "none").strip().lower().partition(":")
    try:
        if name == "none" and not arg:
            return no_attack
        if name == "sign_flip" and not arg:
            return sign_flip
        if name == "nan" and not arg:
            return nan_update
        if name == "scale":
            return Scale(float(arg) if arg else 100.0)
        if name == "noise":
            return GaussianNoise(float(arg) if arg else 1.0, seed)
        if name == "free_rider" and arg in ("", "zeros", "stale"):
            return FreeRider(stale=arg == "stale")
    except ValueError as exc:
        raise ValueError(f"bad attack parameter in {spec!r}: {exc}") from exc
    raise ValueError(f"unknown attack {spec!r}; choose from {', '.join(ATTACKS)} "
                     f"(scale:K, noise:STD, free_rider:stale)")
