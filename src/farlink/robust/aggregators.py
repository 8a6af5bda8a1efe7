"""Rules that turn the peers' updates of one round into one update.

Every rule takes the stacked updates of one tensor (``[n_peers, ...]``) and their weights (tokens
each update was computed on) and returns one tensor of the update's shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Aggregator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def weighted_mean(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Token-weighted average: the plain (non-robust) DiLoCo rule."""
    w = weights.to(updates.dtype)
    total = w.sum()
    if total <= 0:
        return torch.zeros_like(updates[0])
    shape = (-1,) + (1,) * (updates.dim() - 1)
    return (updates * w.reshape(shape)).sum(0) / total


AGGREGATORS: dict[str, Aggregator] = {"mean": weighted_mean}


def make_aggregator(name: str) -> Aggregator:
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}; choose from {', '.join(AGGREGATORS)}")
    return AGGREGATORS[name]
