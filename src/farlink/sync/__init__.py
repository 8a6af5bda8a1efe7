"""Outer algorithms behind one interface: ``ddp``, ``local_sgd``, ``diloco``,
``streaming_diloco``, ``demo``,
``hierarchical_diloco``. None of them imports a communication backend."""

from __future__ import annotations

import importlib

from farlink.sync.base import StepOutcome, SyncAlgorithm

ALGORITHMS: dict[str, str] = {
    "ddp": "farlink.sync.ddp:DDP",
    "local_sgd": "farlink.sync.diloco:LocalSGD",
    "diloco": "farlink.sync.diloco:DiLoCo",
    "streaming_diloco": "farlink.sync.streaming:StreamingDiLoCo",
    "demo": "farlink.sync.demo:DeMo",
    "sparseloco": "farlink.sync.sparseloco:SparseLoCo",
    "hierarchical_diloco": "farlink.sync.hierarchical:HierarchicalDiLoCo",
}


def algorithm_class(name: str) -> type[SyncAlgorithm]:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    module, _, attr = ALGORITHMS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["ALGORITHMS", "StepOutcome", "SyncAlgorithm", "algorithm_class"]
