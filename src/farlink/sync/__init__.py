"""Outer algorithms behind one interface, one file each, named in :data:`ALGORITHMS` (the
only list of them: the CLI's help, the config's errors and the docs print it). None of them
imports a communication backend.

Adding an algorithm is one file (a :class:`SyncAlgorithm` subclass with its ``Options``, its
``capabilities`` and its optimizers) plus one line in :data:`ALGORITHMS`: ``RunConfig`` inherits
its options (so they become flags and TOML keys) and every other part asks its capabilities.
"""

from __future__ import annotations

import importlib

from farlink.sync.base import Capabilities, StepOutcome, SyncAlgorithm, SyncOptions

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


def capabilities(name: str) -> Capabilities:
    """What algorithm ``name`` can do (ValueError naming the choices if it is unknown)."""
    return algorithm_class(name).capabilities


def algorithm_options() -> tuple[type[SyncOptions], ...]:
    """Every algorithm's options model, most derived first and without repeats: the bases
    ``RunConfig`` composes."""
    found: list[type[SyncOptions]] = []
    for name in ALGORITHMS:
        options = algorithm_class(name).Options
        if options not in found:
            found.append(options)
    # a model may not precede its own base in a class's bases: keep subclasses first
    return tuple(sorted(found, key=lambda o: -len(o.__mro__)))


__all__ = ["ALGORITHMS", "Capabilities", "StepOutcome", "SyncAlgorithm", "SyncOptions",
           "algorithm_class", "algorithm_options", "capabilities"]
