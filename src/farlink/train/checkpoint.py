"""Atomic checkpoints: safetensors for tensors, JSON for everything else.

A checkpoint is a directory ``step-NNNNNN`` written under a temporary name and renamed into place,
then published by atomically replacing the ``LATEST`` pointer file. A crash at any instant leaves
either the previous checkpoint or the new one, never a torn one; older checkpoints are pruned only
after the new one is published.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TENSORS = "state.safetensors"
META = "meta.json"
POINTER = "LATEST"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing or unreadable."""


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict, keep: int = 2
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-{step:07d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / TENSORS))
    (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_write_text(root / POINTER, final.name)
    existing = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in existing[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / POINTER
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / TENSORS).is_file() and (path / META).is_file() else None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    try:
        tensors = load_file(str(path / TENSORS))
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    return tensors, meta
