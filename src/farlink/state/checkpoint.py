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

A state holding NaN or Inf is never written (:class:`NonFiniteState`, naming the tensors; the
last good checkpoint stays the newest), and one found on load (written before this check) is
refused with the file and what to do: resuming from it would only train NaN again.

A full disk stops a save with :class:`DiskFull`, naming the directory, after removing what the
save had written so far; the previous checkpoint stays the newest.

A replica group of several ranks (FSDP2 or DDP inside) writes one checkpoint per step with
``torch.distributed.checkpoint`` (DCP): :func:`save_sharded_checkpoint` is a collective of the
replica group's ranks, each writing its own part into the same directory, after which rank 0
records the SHA-256 of every file DCP wrote and publishes the directory as above. A rank killed
mid-write leaves only a temporary directory, so a published step is always whole; on load every
digest is checked the same way and each rank reads back only its own part, or, resumed with another
number of ranks, every part (:func:`load_checkpoint_parts`), which :mod:`farlink.parallel.reshard`
cuts again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as serialize_tensors

from farlink.state.files import TEMP_PREFIX, atomic_write, write_synced

log = logging.getLogger(__name__)

TENSORS = "state.safetensors"
META = "meta.json"
SHARDED = "sharded"  # meta key: True when DCP wrote the tensors, each rank its part
POINTER = "LATEST"
DIGESTS = "sha256"  # meta key: {file name: SHA-256 hex of that file}
META_DIGEST = "meta_sha256"  # meta key: SHA-256 of the rest of the meta, canonically encoded
CORRUPT_PREFIX = "corrupt-"
EXIT_DISK_FULL = 28  # a worker's exit status after DiskFull (ENOSPC's number)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing or unreadable."""


class NonFiniteState(CheckpointError):
    """Model or optimizer state holding NaN or Inf: never written, never resumed from."""


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors that hold a NaN or an Inf."""
    return [k for k, v in tensors.items()
            if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(root: Path, pattern: str = f"*{TEMP_PREFIX}*") -> list[Path]:
    """Delete temporary files of saves whose process died mid-write (SIGKILL, power loss):
    they are never published and would otherwise fill the disk one crash at a time. Only
    names matching ``pattern`` are touched, and one whose ``-PID`` process lives is kept."""
    removed = []
    for tmp in root.glob(pattern) if root.is_dir() else []:
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
    """Write, sync and publish checkpoint ``step``; its meta gains the digests of its files.
    A state holding NaN/Inf raises :class:`NonFiniteState` and writes nothing."""
    final = checkpoint_path(root, step)
    bad = nonfinite_tensors(tensors)
    if bad:
        kept = latest_checkpoint(root)
        raise NonFiniteState(
            f"not writing checkpoint {final}: {_listed(bad)} hold NaN or Inf (the model or "
            "optimizer state is poisoned); "
            + (f"{kept} stays the newest checkpoint" if kept else "no checkpoint is kept yet")
            + ". Fix: find what made it diverge (learning rate, a bad peer named in the log), "
            "then resume from the last good checkpoint")
    tmp = root / f"{TEMP_PREFIX}{step:07d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(root)
        tmp.mkdir()
        blob = serialize_tensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        write_synced(tmp / TENSORS, blob)
        meta = {**meta, DIGESTS: {TENSORS: _sha256(blob)}}
        del blob
        meta[META_DIGEST] = _meta_digest(meta)
        write_synced(tmp / META, json.dumps(meta, indent=1, sort_keys=True).encode())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write(root / POINTER, final.name, sync=True)
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
    return path if (path / META).is_file() else None


def _verified_meta(path: Path) -> dict:
    """The meta of checkpoint ``path`` once every digest it records matched (checkpoints
    written before digests existed pass unchecked, with a warning)."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise CheckpointCorrupt(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(meta, dict):
        raise CheckpointCorrupt(f"checkpoint {path}: {META} is not an object")
    if META_DIGEST not in meta and DIGESTS not in meta:
        log.warning("checkpoint %s predates digests; loading it unchecked", path)
        return meta
    if meta.get(META_DIGEST) != _meta_digest(meta):
        raise CheckpointCorrupt(f"checkpoint {path}: {META} does not match its digest")
    recorded = meta.get(DIGESTS, {})
    expected = recorded if meta.get(SHARDED) else {TENSORS: recorded.get(TENSORS)}
    for name, digest in expected.items():
        try:
            data = (path / name).read_bytes()
        except OSError as exc:
            raise CheckpointCorrupt(f"cannot read checkpoint {path}: {exc}") from exc
        if digest != _sha256(data):
            raise CheckpointCorrupt(
                f"checkpoint {path}: {name} does not match its digest "
                f"({len(data):,} bytes, SHA-256 {_sha256(data)[:12]}..., "
                f"recorded {str(digest)[:12]}...)")
    return meta


def read_verified_meta(path: Path) -> dict:
    """A checkpoint's meta, after checking every digest it records (files and itself)."""
    return _verified_meta(path)


def load_checkpoint(path: Path, rank: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and meta of one checkpoint, after checking every digest its meta recorded. Of a
    replica group's checkpoint (DCP), the tensors of rank ``rank``."""
    meta = _verified_meta(path)
    if meta.get(SHARDED):
        return load_rank_part(path, rank), meta
    try:
        blob = (path / TENSORS).read_bytes()
        tensors = load_tensors(blob)
    except Exception as exc:  # safetensors raises its own error type for a malformed file
        raise CheckpointCorrupt(f"cannot read checkpoint {path}: {exc}") from exc
    bad = nonfinite_tensors(tensors)
    if bad:
        raise NonFiniteState(
            f"checkpoint {path / TENSORS} holds NaN or Inf in {_listed(bad)}; resuming from "
            f"it would train NaN. Fix: move {path} out of {path.parent} to resume from the "
            "checkpoint before it, or start the run again without --resume")
    return tensors, meta


def load_checkpoint_parts(path: Path) -> tuple[list[dict[str, torch.Tensor]], dict]:
    """Every rank's tensors of one checkpoint, in rank order, after checking every digest: a
    replica group's checkpoint read whole, to be cut again for another number of ranks
    (:mod:`farlink.parallel.reshard`); one part for a checkpoint of a single process."""
    meta = _verified_meta(path)
    if not meta.get(SHARDED):
        return [load_checkpoint(path)[0]], meta
    import torch.distributed.checkpoint as dcp

    try:
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:  # DCP's errors for a malformed file
        raise CheckpointCorrupt(f"cannot read checkpoint {path}: {exc}") from exc
    ranks = {int(key.split("/", 1)[0][len("rank"):]) for key in stored if key.startswith("rank")}
    return [load_rank_part(path, rank) for rank in range(len(ranks))], meta


def _rank_prefix(rank: int) -> str:
    return f"rank{rank}/"


def _out_of_space(exc: BaseException, root: Path, state: dict[str, torch.Tensor]) -> bool:
    """Whether a failed DCP write ran out of disk: an ENOSPC among the ranks' failures, or less
    room left than this rank's part needs (torch's zip writer reports a short write as a
    RuntimeError, "unexpected pos", without the errno)."""
    causes = [exc, *(c[0] if isinstance(c, tuple) else c  # DCP: (exception, traceback) per rank
                     for c in getattr(exc, "failures", {}).values())]
    if any(is_disk_full(c) for c in causes):
        return True
    needed = sum(t.numel() * t.element_size() for t in state.values())
    return shutil.disk_usage(root).free < needed


def _publish_sharded(tmp: Path, final: Path, meta: dict) -> None:
    """Rank 0's part after DCP wrote every rank's files into ``tmp``: the meta with the SHA-256
    of each file, then the rename into place and the ``LATEST`` pointer."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    meta = {**meta, SHARDED: True,
            DIGESTS: {str(p.relative_to(tmp)): _sha256(p.read_bytes()) for p in files}}
    meta[META_DIGEST] = _meta_digest(meta)
    write_synced(tmp / META, json.dumps(meta, indent=1, sort_keys=True).encode())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write(final.parent / POINTER, final.name, sync=True)


def load_rank_part(path: Path, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors of a DCP checkpoint, read by this process alone (DCP's metadata
    gives every tensor's shape and dtype, so nothing of the live state is needed). Its digests
    are not checked here: read the meta with :func:`read_verified_meta` first."""
    import torch.distributed.checkpoint as dcp

    prefix = _rank_prefix(rank)
    try:
        reader = dcp.FileSystemReader(path)
        stored = reader.read_metadata().state_dict_metadata
        state = {key: torch.empty(tuple(info.size), dtype=info.properties.dtype)
                 for key, info in stored.items() if key.startswith(prefix)}
        if not state:
            raise CheckpointError(f"checkpoint {path} holds no part of rank {rank} (it was "
                                  f"written by a replica group of fewer ranks); resume with the "
                                  f"same --ranks-per-worker")
        with warnings.catch_warnings():  # DCP notes that it loads in one process: meant so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as exc:  # DCP's errors for a malformed file
        raise CheckpointCorrupt(f"cannot read checkpoint {path}: {exc}") from exc
    return {key[len(prefix):]: tensor for key, tensor in state.items()}


def save_sharded_checkpoint(root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict,
                            rank: int, group, keep: int = 2) -> Path:
    """A collective of a replica group's ranks (``group``, rank ``rank`` of it): each writes its
    ``tensors`` into checkpoint ``step`` through DCP; rank 0 then adds ``meta`` with the SHA-256
    of every file and publishes it. Each rank's tensors are stored under its own prefix, since
    the ranks' algorithm states (a shard's outer momentum, residuals, RNG) differ."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = checkpoint_path(root, step)
    owner = [os.getpid()]  # the temporary directory is named after rank 0's process
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(root)
    dist.broadcast_object_list(owner, src=dist.get_global_rank(group, 0), group=group)
    tmp = root / f"{TEMP_PREFIX}{step:07d}-{owner[0]}"
    state = {_rank_prefix(rank) + k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    try:  # a collective: a failure on any rank is raised on every rank
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                 process_group=group)
    except (Exception, dcp.CheckpointException) as exc:  # a BaseException; on every rank
        full = [rank == 0 and _out_of_space(exc, root, state)]  # judged before the cleanup
        dist.broadcast_object_list(full, src=dist.get_global_rank(group, 0), group=group)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full[0]:
            raise DiskFull(root) from exc
        raise
    failed: list[str | None] = [None]  # rank 0's publication, told to every rank
    if rank == 0:
        try:
            _publish_sharded(tmp, final, meta)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            failed[0], error = str(exc), exc
    dist.broadcast_object_list(failed, src=dist.get_global_rank(group, 0), group=group)
    if failed[0] is not None:
        if rank == 0 and is_disk_full(error):
            raise DiskFull(root) from error
        if rank == 0:
            raise error
        raise CheckpointError(f"rank 0 could not publish checkpoint {final}: {failed[0]}")
    if rank == 0:
        existing = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in existing[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


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


def _verified(path: Path, rejected: list[tuple[Path, str]], rank: int = 0) -> Restored | None:
    """``path`` loaded if it verifies; else set aside as ``corrupt-step-NNNNNN`` (neither tried
    again nor counted among the checkpoints kept), noted in ``rejected``, and None."""
    try:
        tensors, meta = load_checkpoint(path, rank)
    except CheckpointCorrupt as exc:
        aside = path.with_name(CORRUPT_PREFIX + path.name)
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        rejected.append((aside, str(exc)))
        log.warning("%s; set aside as %s", exc, aside.name)
        return None
    return Restored(path, tensors, meta)


def load_newest_intact(root: Path, rank: int = 0) -> Restored:
    """Load the newest checkpoint under ``root`` that verifies, newest first by step; each newer
    one that fails is set aside and reported in :attr:`Restored.rejected`. Of a replica group's
    checkpoints, rank ``rank``'s part."""
    rejected: list[tuple[Path, str]] = []
    for path in _candidates(root):
        if (restored := _verified(path, rejected, rank)) is not None:
            restored.rejected = rejected
            return restored
    return Restored(rejected=rejected)


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint directory ``step-NNNNNNN``."""
    return int(path.name.split("-", 1)[1])
