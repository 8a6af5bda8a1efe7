"""Atomic, verified checkpoints: safetensors for tensors, JSON for everything else.

A checkpoint is a directory ``step-NNNNNN`` written under a temporary name, synced to disk and
renamed into place, then published by atomically replacing the ``LATEST`` pointer file. A crash at
any instant leaves either the previous checkpoint or the new one, never a torn one; older
checkpoints are pruned only after the new one is published.

A crash is not the only way to lose a checkpoint: a flipped bit on disk or a file cut short by a
copy loads into a plausible but wrong state. So ``meta.json`` carries the SHA-256 of every file of
its checkpoint and of its own content, and :func:`load_newest_intact` checks them, sets a
checkpoint that fails aside (``corrupt-step-NNNNNN``, kept for inspection) and falls back to the
newest one that verifies. Two checkpoints are kept: the fallback costs at most one round of this
worker's own progress, which a live peer's state replaces at its next quorum (peers heal a replica
that is behind), so no committed round is lost while one peer holds it.

A full disk stops a save with :class:`DiskFull`, naming the directory, after removing what the
save had written so far; the previous checkpoint stays the newest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as serialize_tensors

log = logging.getLogger(__name__)

TENSORS = "state.safetensors"
META = "meta.json"
POINTER = "LATEST"
DIGESTS = "sha256"  # meta key: {file name: SHA-256 hex of that file}
META_DIGEST = "meta_sha256"  # meta key: SHA-256 of the rest of the meta, canonically encoded
TEMP_PREFIX = ".tmp-"
CORRUPT_PREFIX = "corrupt-"
EXIT_DISK_FULL = 28  # a worker's exit status after DiskFull (ENOSPC's number)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing or unreadable."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files do not match the digests its meta recorded."""


class DiskFull(CheckpointError):
    """No space left for a checkpoint; the partial files were removed."""

    def __init__(self, root: Path, what: str = "checkpoint") -> None:
        free = shutil.disk_usage(root).free if root.exists() else 0
        super().__init__(f"disk full writing {what} under {root} "
                         f"({free / 1e6:.1f} MB free)")
        self.root = root


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _meta_digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    return _sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}{TEMP_PREFIX}{os.getpid()}")
    try:
        _write_synced(tmp, text.encode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(root: Path) -> list[Path]:
    """Delete temporary files of saves whose process died mid-write (SIGKILL, power loss):
    they are never published and would otherwise fill the disk one crash at a time."""
    removed = []
    for tmp in root.glob(f"*{TEMP_PREFIX}*") if root.is_dir() else []:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            continue
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def checkpoint_path(root: Path, step: int) -> Path:
    """Where checkpoint ``step`` is published under ``root``."""
    return root / f"step-{step:07d}"


def save_checkpoint(
    root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict, keep: int = 2
) -> Path:
    """Write, sync and publish checkpoint ``step``; its meta gains the digests of its files."""
    final = checkpoint_path(root, step)
    tmp = root / f"{TEMP_PREFIX}{step:07d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(root)
        tmp.mkdir()
        blob = serialize_tensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        _write_synced(tmp / TENSORS, blob)
        meta = {**meta, DIGESTS: {TENSORS: _sha256(blob)}}
        del blob
        meta[META_DIGEST] = _meta_digest(meta)
        _write_synced(tmp / META, json.dumps(meta, indent=1, sort_keys=True).encode())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _atomic_write_text(root / POINTER, final.name)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise DiskFull(root) from exc
        raise
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
    """Tensors and meta of one checkpoint, after checking every digest its meta recorded
    (checkpoints written before digests existed load unchecked, with a warning)."""
    try:
        meta = json.loads((path / META).read_text())
        blob = (path / TENSORS).read_bytes()
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise CheckpointCorrupt(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(meta, dict):
        raise CheckpointCorrupt(f"checkpoint {path}: {META} is not an object")
    if META_DIGEST in meta or DIGESTS in meta:
        if meta.get(META_DIGEST) != _meta_digest(meta):
            raise CheckpointCorrupt(f"checkpoint {path}: {META} does not match its digest")
        recorded = meta.get(DIGESTS, {}).get(TENSORS)
        if recorded != _sha256(blob):
            raise CheckpointCorrupt(
                f"checkpoint {path}: {TENSORS} does not match its digest "
                f"({len(blob):,} bytes, SHA-256 {_sha256(blob)[:12]}..., "
                f"recorded {str(recorded)[:12]}...)")
    else:
        log.warning("checkpoint %s predates digests; loading it unchecked", path)
    try:
        tensors = load_tensors(blob)
    except Exception as exc:  # safetensors raises its own error type for a malformed file
        raise CheckpointCorrupt(f"cannot read checkpoint {path}: {exc}") from exc
    return tensors, meta


@dataclass
class Restored:
    """What :func:`load_newest_intact` found: the checkpoint it loaded (None: none verified)
    and the newer ones it set aside, with the reason each failed."""

    path: Path | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    rejected: list[tuple[Path, str]] = field(default_factory=list)


def _candidates(root: Path) -> list[Path]:
    """Published checkpoint directories under ``root``, newest first."""
    return sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True) \
        if root.is_dir() else []


def _verified(path: Path, rejected: list[tuple[Path, str]]) -> Restored | None:
    """``path`` loaded if it verifies; else set aside as ``corrupt-step-NNNNNN`` (neither tried
    again nor counted among the checkpoints kept), noted in ``rejected``, and None."""
    try:
        tensors, meta = load_checkpoint(path)
    except CheckpointCorrupt as exc:
        aside = path.with_name(CORRUPT_PREFIX + path.name)
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        rejected.append((aside, str(exc)))
        log.warning("%s; set aside as %s", exc, aside.name)
        return None
    return Restored(path, tensors, meta)


def load_newest_intact(root: Path) -> Restored:
    """Load the newest checkpoint under ``root`` that verifies, newest first by step; each
    newer one that fails is set aside and reported in :attr:`Restored.rejected`."""
    rejected: list[tuple[Path, str]] = []
    for path in _candidates(root):
        if (restored := _verified(path, rejected)) is not None:
            restored.rejected = rejected
            return restored
    return Restored(rejected=rejected)


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint directory ``step-NNNNNNN``."""
    return int(path.name.split("-", 1)[1])


def intact_checkpoints(root: Path) -> tuple[dict[int, Restored], list[tuple[Path, str]]]:
    """Every checkpoint under ``root`` that verifies, by step, and the ones set aside. The ranks
    of a site resume from the newest step all of them hold intact, which need not be the newest
    of each (a rank killed mid-write lacks it)."""
    rejected: list[tuple[Path, str]] = []
    found = {checkpoint_step(path): restored for path in _candidates(root)
             if (restored := _verified(path, rejected)) is not None}
    return found, rejected
