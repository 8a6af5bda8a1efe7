"""What a pipeline trainer accepts from a stage peer: finite numbers of the expected shapes.

A stage peer's answer feeds the next stage, the optimizer steps of every peer (through the
gradients it returns and the tied embedding) and the stage averages, so one NaN, one inf or one
wrong-shaped tensor from a buggy or hostile peer would spread to every honest peer. The trainer
checks each answer with these pure functions before it uses it: a refused answer is dropped,
its peer named and taken out, and the work goes to another peer of the stage
(:mod:`farlink.parallel.pipeline`); stage averages leave such members out
(:mod:`farlink.parallel.stage_sync`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

import torch

#: an expected shape; None in a dimension accepts any size there
Shape = tuple[int | None, ...]


def tensor_problem(name: str, tensor: torch.Tensor | None, shape: Shape | None) -> str | None:
    """Why ``tensor`` (the answer's ``name``) is unusable, or None: missing, of another shape
    than ``shape`` (None: any shape), or holding NaN/inf."""
    if tensor is None:
        return f"no {name!r} in its answer"
    if shape is not None and (tensor.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(tensor.shape, shape))):
        wanted = "x".join("*" if d is None else str(d) for d in shape)
        return f"{name!r} of shape {'x'.join(map(str, tensor.shape))}, expected {wanted}"
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        return f"{name!r} holds {bad} non-finite values (NaN/inf)"
    return None


def answer_problem(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, Shape | None],
                   meta: Mapping | None = None, loss: bool = False) -> str | None:
    """Why a stage peer's answer is unusable, or None: every tensor of ``expected`` present,
    of its shape and finite; with ``loss``, a finite number under ``meta["loss"]``."""
    for name, shape in expected.items():
        problem = tensor_problem(name, tensors.get(name), shape)
        if problem is not None:
            return problem
    if loss:
        value = (meta or {}).get("loss")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"a loss of {value!r}, not a number"
        if not math.isfinite(value):
            return f"a non-finite loss ({value})"
    return None


def _signature(state: Mapping[str, torch.Tensor]) -> tuple:
    return tuple(sorted((name, tuple(t.shape)) for name, t in state.items()))


def usable_states(states: Mapping[str, Mapping[str, torch.Tensor]],
                  reference: Mapping[str, torch.Tensor] | None = None,
                  ) -> tuple[dict[str, Mapping[str, torch.Tensor]], dict[str, str]]:
    """The members of a stage average whose weights may enter it, and why each other one may
    not: every tensor finite, and the names and shapes of ``reference`` (the stage's θ), or
    without one, those most members share (a lone odd member cannot set them)."""
    left_out: dict[str, str] = {}
    finite = {}
    for peer, state in states.items():
        bad = [n for n, t in state.items() if not bool(torch.isfinite(t).all())]
        if bad:
            left_out[peer] = f"non-finite weights in {len(bad)} tensors (first {bad[0]!r})"
        else:
            finite[peer] = state
    if reference is not None:
        wanted = _signature(reference)
    elif finite:
        wanted = Counter(_signature(s) for s in finite.values()).most_common(1)[0][0]
    else:
        wanted = None
    kept = {}
    for peer, state in finite.items():
        if _signature(state) == wanted:
            kept[peer] = state
        else:
            left_out[peer] = "weights of other names or shapes than the stage's"
    return kept, left_out
