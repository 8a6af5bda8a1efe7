"""A replica group's checkpoint resumed with another number of ranks: its parts cut again, exactly.

Users move between node sizes: a run checkpointed by replica groups of 2 ranks may go on on
machines that fit 1, 4 or 8. Each rank's part of a replica group's checkpoint holds its own state
(:mod:`farlink.train. checkpoint`), and every tensor in it is one of two kinds:

* **a shard**: a contiguous range of the whole tensor flattened in row-major order. FSDP2 shards
  dim 0 (``torch.chunk``), so its shard of a contiguous tensor is such a range; a DDP replica
  group's ``1/K`` slice (:meth:`~farlink.parallel.sharding.ReplicaGroup.part_of`) is one by
  construction. The two split at different sizes (``chunk`` rounds up, ``tensor_split`` spreads the
  remainder), so the new sizes are never computed here: they are read from the new ranks' live
  state.
* **a rank's own whole value**: the same shape on every rank (a DDP rank's whole replica and
  its AdamW state, counters, torch's RNG state).

A tensor whose parts all have the shape every new rank holds (or are all scalars) is a whole value:
new rank ``r`` takes old rank ``r``'s (the last old rank's when there are more new ranks). One
whose parts add up to what the new ranks hold together is a shard: the parts are joined and each
new rank takes its range. With different rank counts and a non-empty tensor the two cannot be
confused (``K_old * n == K_new * n`` only if the counts are equal), and anything else is refused
with what to do. What a new rank holds comes from its algorithm's ``state_shapes()``, which also
sizes the states made only later (an optimizer's moments before its first step, a codec's residuals
before the first round) by the parameter they belong to. No arithmetic touches a value, so the
resumed replica group holds bit for bit the parameters, optimizer states and residuals that were
saved; a replica group of K ranks trains them as one of K' would, up to the order of FSDP's
reductions.
"""

from __future__ import annotations

import math

import torch


class ReshardError(ValueError):
    """A checkpoint's parts do not fit the new ranks' state (another model or algorithm)."""


Shapes = dict[str, tuple[int, ...]]


def shapes_of(state: dict[str, torch.Tensor]) -> Shapes:
    """What a rank holds: each tensor's shape (gathered from every new rank of a replica group)."""
    return {key: tuple(tensor.shape) for key, tensor in state.items()}


def wanted_shape(key: str, shapes: Shapes) -> tuple[int, ...] | None:
    """What a rank holds of ``key``: its shape in ``shapes`` (an algorithm's
    ``state_shapes()``), or that of the prefix standing for states made later (an optimizer's
    ``inner.I.``, ``outer.I.``)."""
    if key in shapes:
        return shapes[key]
    prefix, _, rest = key.partition(".")
    index = rest.partition(".")[0]
    return shapes.get(f"{prefix}.{index}.")


def reshard(parts: list[dict[str, torch.Tensor]], rank: int,
            layout: list[Shapes]) -> dict[str, torch.Tensor]:
    """New rank ``rank``'s state from the old ranks' ``parts`` (in rank order), where
    ``layout[r]`` is what new rank ``r`` holds (its algorithm's ``state_shapes()``). A tensor
    the parts do not all hold, or the new ranks would not, is refused: its kind cannot be
    told."""
    out = {}
    for key in sorted(parts[0]):
        held = [part.get(key) for part in parts]
        wanted = [wanted_shape(key, shapes) for shapes in layout]
        if any(t is None for t in held) or any(shape is None for shape in wanted):
            raise ReshardError(f"{key!r} is not held by every rank of the checkpoint and of this "
                               f"replica group; resume with --ranks-per-worker {len(parts)}")
        out[key] = _cut(key, held, rank, wanted)
    return out


def _cut(key: str, held: list[torch.Tensor], rank: int,
         wanted: list[tuple[int, ...]]) -> torch.Tensor:
    mine = held[min(rank, len(held) - 1)]
    if all(t.dim() == 0 for t in held):  # a counter, an optimizer's step
        return mine.clone()
    if all(tuple(t.shape) == wanted[rank] for t in held) and len(set(wanted)) == 1:
        return mine.clone()  # each rank's own whole value
    sizes = [math.prod(shape) for shape in wanted]
    if sum(t.numel() for t in held) == sum(sizes):  # a shard: a range of the flattened whole
        whole = torch.cat([t.reshape(-1) for t in held])
        start = sum(sizes[:rank])
        return whole[start:start + sizes[rank]].clone().view(wanted[rank])
    raise ReshardError(
        f"{key!r}: the checkpoint's {len(held)} parts (shapes "
        f"{[tuple(t.shape) for t in held]}) are neither a whole value on each rank nor shards "
        f"of what {len(wanted)} ranks hold (shapes {wanted}); resume with --ranks-per-worker "
        f"{len(held)}")
