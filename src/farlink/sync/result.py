"""What one round of an exchange gives back, whichever path made it (dense all-reduce,
compressed all-reduce, all-gather): its own module so the paths need not import each other."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ExchangeResult:
    """The aggregate of one round, and who it came from."""

    tensors: dict[str, torch.Tensor]
    total_weight: float
    accepted: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)  # each accepted peer's bounded weight
    claimed: dict[str, float] = field(default_factory=dict)  # what each accepted peer claimed
    capped: dict[str, str] = field(default_factory=dict)  # peer -> why its claim was bounded
    path: str = ""  # which path produced it: dense, allreduce or gathered
    # tokens each accepted peer is credited with once the round commits (absent: its bounded
    # weight); 0 for a marked update (free rider, replay, inflated claim)
    credited: dict[str, float] = field(default_factory=dict)
    marks: dict[str, str] = field(default_factory=dict)  # peer -> why it is credited nothing
    scores: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> score, rating
    #: compressed all-reduce: owner that died mid-round -> the member that redid its shard
    reassigned: dict[str, str] = field(default_factory=dict)
