"""Held-out loss, the measure every sync algorithm is compared on (perplexity = exp(loss)).

Weighted by tokens so a short final batch counts for what it holds; restores the model's
training mode so it can be called in the middle of a run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean per-token cross-entropy of ``model`` (returning ``(logits, loss)``) over ``batches``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for inputs, targets in batches:
            _, loss = model(inputs.to(device), targets.to(device))
            if loss is None:
                raise ValueError("model returned no loss for given targets")
            total += float(loss) * targets.numel()
            count += targets.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate() needs at least one batch")
    return total / count


def perplexity(loss: float) -> float:
    return math.exp(loss)
