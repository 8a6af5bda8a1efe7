"""Emulated misbehaving peers, for benchmarks and tests of the robust path.

These are *emulations*: a function that rewrites the update an honest worker computed, before it
is encoded and sent, so a benchmark can run "k of n peers are hostile" with real training, real
codecs and real aggregation. They model classic attacks from the Byzantine-robust learning
literature, and adaptive ones that hide inside the honest updates' spread (ALIE, IPM).

``make_attack(spec)`` with ``spec`` one of:

- ``none``: the honest update;
- ``sign_flip``: ``-x`` (pushes training backwards);
- ``scale[:k]``: ``k x`` (default 100);
- ``noise[:std]``: ``x + N(0, std^2)`` per coordinate (default std 1.0), seeded per round;
- ``nan``: every value NaN (a broken worker; validation must catch it);
- ``free_rider``: zeros, while still claiming the tokens of an honest update;
- ``free_rider:stale``: replays its first update every round instead of computing a new one;
- ``alie[:z]``: "A Little Is Enough" (Baruch et al., NeurIPS 2019): ``mu - z sigma`` per
  coordinate (default z 1.0), inside the honest updates' spread so no distance screen sees it;
- ``ipm[:eps]``: inner-product manipulation (Xie et al., UAI 2020): ``-eps mu`` (default 0.5),
  small and against the honest direction;
- ``copycat``: resends another peer's update (the last one it received) as its own;
- ``inflate[:k]``: the honest update, claiming ``k`` x the tokens it trained on (default 10).

The adaptive attacks (ALIE, IPM, copycat) see what a real member sees: the updates it received
in the previous round (the exchange hands them to :meth:`Adaptive.observe`), and its own honest
update of this round. ``mu`` is its own honest update (an unbiased estimate of the honest mean,
computed from the same parameters on the same kind of data) and ``sigma`` the per-coordinate
spread of the updates it received last round; in the first round ``sigma`` is 0.

The claimed tokens are the caller's business: an attack rewrites tensors, and only
``inflate`` sets :attr:`claim_factor`, which the exchange multiplies the claim by.
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


class Adaptive:
    """An attacker that learns from the updates it receives (:meth:`observe`, called by the
    exchange with the other peers' decoded updates of each round it took part in)."""

    def __init__(self) -> None:
        self.received: list[Update] = []

    def observe(self, updates: dict[str, Update], round_id: int) -> None:
        self.received = [{k: v.detach().clone() for k, v in u.items()} for u in updates.values()]

    def spread(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Per-coordinate standard deviation of ``name`` over the updates received last round
        (zeros before any arrived)."""
        values = [u[name] for u in self.received if name in u and u[name].shape == like.shape]
        if len(values) < 2:
            return torch.zeros_like(like)
        return torch.stack([v.to(like) for v in values]).std(dim=0)


class Alie(Adaptive):
    """``mu - z sigma``: shifted by ``z`` standard deviations, inside the honest spread."""

    def __init__(self, z: float = 1.0) -> None:
        super().__init__()
        self.z = z

    def __call__(self, update: Update, round_id: int) -> Update:
        return {k: v - self.z * self.spread(k, v) for k, v in update.items()}


class Ipm(Adaptive):
    """``-eps mu``: the inner product with the honest mean turns negative once the attackers'
    share times ``eps`` outweighs the honest share."""

    def __init__(self, eps: float = 0.5) -> None:
        super().__init__()
        self.eps = eps

    def __call__(self, update: Update, round_id: int) -> Update:
        return {k: -self.eps * v for k, v in update.items()}


class Copycat(Adaptive):
    """Resends the first other peer's update it received last round; zeros before any."""

    def __call__(self, update: Update, round_id: int) -> Update:
        if not self.received:
            return {k: torch.zeros_like(v) for k, v in update.items()}
        copy = self.received[0]
        return {k: copy[k].to(v).clone() if k in copy else torch.zeros_like(v)
                for k, v in update.items()}


class Inflate:
    """The honest update, with a claim of ``factor`` x its tokens (:attr:`claim_factor`)."""

    def __init__(self, factor: float = 10.0) -> None:
        if not factor > 0:
            raise ValueError(f"inflation factor must be > 0, got {factor}")
        self.claim_factor = factor

    def __call__(self, update: Update, round_id: int) -> Update:
        return update


ATTACKS = ("none", "sign_flip", "scale", "noise", "nan", "free_rider", "alie", "ipm", "copycat",
           "inflate")


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
        if name == "alie":
            return Alie(float(arg) if arg else 1.0)
        if name == "ipm":
            return Ipm(float(arg) if arg else 0.5)
        if name == "copycat" and not arg:
            return Copycat()
        if name == "inflate":
            return Inflate(float(arg) if arg else 10.0)
    except ValueError as exc:
        raise ValueError(f"bad attack parameter in {spec!r}: {exc}") from exc
    raise ValueError(f"unknown attack {spec!r}; choose from {', '.join(ATTACKS)} "
                     f"(scale:K, noise:STD, free_rider:stale, alie:Z, ipm:EPS, "
                     "inflate:K)")
