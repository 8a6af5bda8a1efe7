"""Where and how an inner step computes: the device, the precision, the micro-batches.

``--device`` picks the accelerator (``auto``: CUDA when torch sees one, else the CPU; ``cuda``
spreads local workers over the GPUs present, worker i on GPU ``i % count``; ``cuda:N`` pins
them all to one). A run that asks for CUDA on a machine without it fails when its config is
checked, before any process starts, and says what the machine has.

``--precision bf16`` runs forward and backward under ``torch.autocast(dtype=bfloat16)``: matrix
products in bf16, weights, gradients, optimizer states and pseudo-gradients in fp32 (mixed
precision as in nanoGPT and torchtitan; bf16 keeps fp32's range, so no loss scaling). It works
on the CPU too.

``--grad-accum K`` runs K micro-batches of ``batch_size`` sequences per inner step and adds
their gradients, each loss scaled by 1/K: the step's gradient is the one of a single batch of
``K x batch_size`` sequences (the same windows, in the same order), so the batch an algorithm
sees no longer depends on what fits in one device's memory.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

_DEVICE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def _parse(spec: str) -> tuple[str, int | None]:
    match = _DEVICE.match(spec.strip().lower())
    if match is None or (match.group(1) != "cuda" and match.group(2) is not None):
        raise ValueError(f"device {spec!r} unknown; choose auto, cpu, cuda or cuda:N")
    index = match.group(2)
    return match.group(1), None if index is None else int(index)


def check_device(spec: str) -> None:
    """Raise ValueError unless ``spec`` names a device this machine has."""
    kind, index = _parse(spec)
    if kind != "cuda":
        return
    if not torch.cuda.is_available():
        built = (f"built with CUDA {torch.version.cuda}" if torch.version.cuda
                 else "a CPU-only build")
        raise ValueError(f"device {spec!r}: no CUDA device here (torch {torch.__version__}, "
                         f"{built}, sees none); use --device cpu, or auto to take a GPU only "
                         "where there is one")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(f"device {spec!r}: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")


def resolve_device(spec: str, worker: int = 0) -> torch.device:
    """The torch device worker ``worker`` of a run computes on (``spec`` as ``--device``)."""
    check_device(spec)
    kind, index = _parse(spec)
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", worker % torch.cuda.device_count() if index is None else index)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context a forward pass of ``precision`` runs in on ``device`` (fp32: none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"precision {precision!r} unknown; choose fp32 or bf16")


Batch = tuple[torch.Tensor, torch.Tensor]


def accumulate_gradients(model: nn.Module, micro_batches: Iterator[Batch] | list[Batch],
                         device: torch.device, precision: str = "fp32") -> tuple[float, int]:
    """Forward and backward over ``micro_batches`` (each ``(inputs, targets)`` on any device),
    gradients added into ``.grad``; returns (mean loss over the micro-batches, tokens).

    Each micro-batch's loss is divided by their number, so equal-sized micro-batches give the
    gradient of their concatenation. The caller zeroes gradients (the inner step does)."""
    batches = list(micro_batches)
    if not batches:
        raise ValueError("an inner step needs at least one micro-batch")
    total, tokens = torch.zeros((), device=device), 0
    for inputs, targets in batches:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with autocast(device, precision):
            _, loss = model(inputs, targets)
        (loss / len(batches)).backward()
        total += loss.detach().float()
        tokens += inputs.numel()
    return float(total) / len(batches), tokens


def micro_batches(next_batch: Callable[[], Batch], count: int) -> list[Batch]:
    """``count`` consecutive batches of a sampler: one inner step's micro-batches."""
    return [next_batch() for _ in range(count)]
