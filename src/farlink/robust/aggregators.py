"""Rules that turn the peers' updates of one round into one update.

Every rule takes the stacked updates (``[n_peers, ...]``) and their weights (tokens each update
was computed on) and returns one tensor of the update's shape. The exchange hands a rule each
peer's *whole* update flattened into one vector, because the rules' guarantees are about whole
updates: Krum must pick one peer's update, not tensor ``a`` from one peer and tensor ``b`` from
another, and centered clipping bounds the norm of a peer's whole contribution. ``NAME+per_tensor``
(a :class:`PerTensor` rule) applies the rule to each named tensor separately instead, which is
cheaper in memory and lets a peer that is an outlier in one tensor still count in the others.

``mean`` is plain DiLoCo. The others bound what a minority of bad peers can do:

- ``median``: coordinate-wise median (one vote per peer: claimed tokens are attacker-controlled);
- ``trimmed_mean[:f]``: per coordinate, drop the ``floor(f n)`` largest and smallest values and
  take the token-weighted mean of the rest (f = 0.25 by default);
- ``centered_clip[:tau]``: Karimireddy, He & Jaggi (ICML 2021), ``v <- v + sum_i w_i
  clip(x_i - v, tau) / sum_i w_i``. The paper starts from the previous round's aggregate
  (worker momentum makes that a good centre), takes one iteration (L = 1 in its experiments)
  and uses a fixed radius ``tau`` tuned per task. farlink's defaults differ, because a round's
  update here (a DiLoCo pseudo-gradient, a DeMo step) has no stable scale across rounds or runs
  and a newcomer has no previous aggregate: the start is the round's coordinate median, ``tau``
  is the median distance of the updates from that start (the lower middle one for an even
  count; scale-free), and 3 iterations move the
  centre from the median towards the honest mean. ``centered_clip:TAU`` fixes the radius;
  :func:`centered_clip` with ``reference=`` and ``iters=1`` is the paper's form;
- ``norm_bounded[:c]``: scale each update down to at most ``c`` x the median norm, then the
  weighted mean; limits magnitude attacks (scaling, noise), not direction (sign flips);
- ``krum[:f]``: Blanchard et al. (NeurIPS 2017), the update whose ``n - f - 2`` nearest
  neighbours are closest.

Robust rules cap each weight at ``WEIGHT_CAP`` x the median weight, so a peer cannot buy
influence by claiming more tokens than its peers. (The exchange has bounded every claim before,
at 1.5 x the round's median for every rule: :mod:`farlink.robust.weights`.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

Aggregator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PerTensor:
    """A rule applied to each named tensor separately (``NAME+per_tensor``)."""

    def __init__(self, rule: Aggregator) -> None:
        self.rule = rule

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.rule(updates, weights)

WEIGHT_CAP = 2.0


def _check(updates: torch.Tensor, weights: torch.Tensor) -> None:
    if updates.dim() < 1 or updates.shape[0] == 0:
        raise ValueError("aggregation needs at least one update")
    if weights.shape != (updates.shape[0],):
        raise ValueError(f"weights shape {tuple(weights.shape)} != ({updates.shape[0]},)")


def _bcast(w: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return w.reshape((-1,) + (1,) * (like.dim() - 1))


def cap_weights(weights: torch.Tensor, cap: float = WEIGHT_CAP) -> torch.Tensor:
    """Weights clipped to ``[0, cap x median]`` (all ones if every weight is zero)."""
    w = weights.double().clamp(min=0.0)
    med = float(w.median())
    if med <= 0.0:
        return torch.ones_like(w) if float(w.sum()) <= 0 else w
    return w.clamp(max=cap * med)


def weighted_mean(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Token-weighted average: the plain (non-robust) DiLoCo rule."""
    _check(updates, weights)
    w = weights.to(device=updates.device, dtype=updates.dtype)
    total = w.sum()
    if total <= 0:
        return torch.zeros_like(updates[0])
    shape = (-1,) + (1,) * (updates.dim() - 1)
    return (updates * w.reshape(shape)).sum(0) / total


def _mean64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    total = w.sum()
    if float(total) <= 0:
        return torch.zeros_like(x[0])
    return (x * _bcast(w, x)).sum(0) / total


def coordinate_median(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-coordinate median (the mean of the two middle values when n is even)."""
    _check(updates, weights)
    x = updates.double()
    n = x.shape[0]
    s = x.sort(dim=0).values
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return med.to(updates.dtype)


def trimmed_mean(updates: torch.Tensor, weights: torch.Tensor, trim: float = 0.25) -> torch.Tensor:
    """Per coordinate, drop ``floor(trim n)`` values at each end, weighted mean of the rest."""
    _check(updates, weights)
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim fraction must be in [0, 0.5), got {trim}")
    n = updates.shape[0]
    k = math.floor(trim * n)
    x = updates.double()
    s, order = x.sort(dim=0)
    w = cap_weights(weights).to(x.device)
    ws = w[order]  # the weight of each sorted value
    kept, kept_w = s[k : n - k], ws[k : n - k]
    total = kept_w.sum(0)
    out = torch.where(total > 0, (kept * kept_w).sum(0) / total.clamp(min=1e-300),
                      kept.mean(0))
    return out.to(updates.dtype)


def centered_clip(
    updates: torch.Tensor,
    weights: torch.Tensor,
    tau: float | None = None,
    iters: int = 3,
    reference: torch.Tensor | None = None,
) -> torch.Tensor:
    """Centered clipping from ``reference`` (default: the coordinate median).

    Each step moves the centre by the weighted mean of the updates' offsets, each offset clipped
    to norm ``tau``, so a bad update moves the centre by at most ``tau`` x its weight share per
    step, however far away it is.
    """
    _check(updates, weights)
    x = updates.double().reshape(updates.shape[0], -1)
    w = cap_weights(weights).to(x.device)
    if reference is not None:
        v = reference.double().reshape(-1).clone()
    else:
        v = coordinate_median(updates.double(), weights).reshape(-1)
    if tau is None:
        tau = float((x - v).norm(dim=1).median())
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if float(w.sum()) <= 0 or tau == 0.0:
        return v.reshape(updates.shape[1:]).to(updates.dtype)
    for _ in range(iters):
        d = x - v
        norms = d.norm(dim=1, keepdim=True)
        scale = torch.clamp(tau / norms.clamp(min=1e-300), max=1.0)
        v = v + (d * scale * w[:, None]).sum(0) / w.sum()
    return v.reshape(updates.shape[1:]).to(updates.dtype)


def norm_bounded(updates: torch.Tensor, weights: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """Weighted mean after scaling every update down to at most ``factor`` x the median norm."""
    _check(updates, weights)
    if factor <= 0:
        raise ValueError(f"norm bound factor must be > 0, got {factor}")
    x = updates.double()
    norms = x.reshape(x.shape[0], -1).norm(dim=1)
    bound = factor * float(coordinate_median(norms[:, None], weights)[0])
    scale = torch.clamp(bound / norms.clamp(min=1e-300), max=1.0)
    return _mean64(x * _bcast(scale, x), cap_weights(weights)).to(updates.dtype)


def krum(updates: torch.Tensor, weights: torch.Tensor, f: int | None = None) -> torch.Tensor:
    """The update with the smallest summed squared distance to its ``n - f - 2`` neighbours.

    ``f`` (assumed bad peers) defaults to the most Krum tolerates, ``(n - 3) // 2``. Weights are
    not used: Krum picks one peer's update.
    """
    _check(updates, weights)
    n = updates.shape[0]
    if f is None:
        f = max((n - 3) // 2, 0)
    if n <= 2:
        return coordinate_median(updates, weights)
    m = max(n - f - 2, 1)
    if f < 0:
        raise ValueError(f"krum needs f >= 0 assumed bad peers, got {f}")
    x = updates.double().reshape(n, -1)
    d2 = torch.cdist(x, x).pow(2)
    d2.fill_diagonal_(float("inf"))
    scores = d2.sort(dim=1).values[:, :m].sum(1)
    return updates[int(scores.argmin())].clone()


AGGREGATORS: dict[str, Aggregator] = {
    "mean": weighted_mean,
    "median": coordinate_median,
    "trimmed_mean": trimmed_mean,
    "centered_clip": centered_clip,
    "norm_bounded": norm_bounded,
    "krum": krum,
}

# name -> (keyword that ``name:ARG`` sets, how to parse ARG)
_PARAMETERS: dict[str, tuple[str, Callable[[str], object]]] = {
    "trimmed_mean": ("trim", float),
    "centered_clip": ("tau", float),
    "norm_bounded": ("factor", float),
    "krum": ("f", int),
}


def make_aggregator(name: str) -> Aggregator:
    """``NAME`` or ``NAME:ARG`` (e.g. ``trimmed_mean:0.2``, ``centered_clip:1.0``, ``krum:1``),
    optionally ``+per_tensor`` (each named tensor aggregated on its own, see the module doc)."""
    spec = name.strip().lower()
    if spec.endswith("+per_tensor"):
        rule = make_aggregator(spec.removesuffix("+per_tensor"))
        return rule if rule is weighted_mean else PerTensor(rule)  # the mean splits exactly
    base, _, arg = spec.partition(":")
    if base not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {base!r}; choose from {', '.join(AGGREGATORS)}")
    if not arg:
        return AGGREGATORS[base]
    if base not in _PARAMETERS:
        raise ValueError(f"aggregator {base!r} takes no parameter (got {arg!r})")
    keyword, parse = _PARAMETERS[base]
    try:
        value = parse(arg)
    except ValueError as exc:
        raise ValueError(f"bad parameter {arg!r} for {base}: {exc}") from exc
    rule = functools.partial(AGGREGATORS[base], **{keyword: value})
    # validate the parameter now, on a tiny input, rather than in the middle of a run
    rule(torch.zeros(5, 1), torch.ones(5))
    return rule
