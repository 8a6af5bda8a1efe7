"""A model state as one hashed blob served in hashed chunks.

A snapshot is a safetensors blob with a manifest (whole-blob SHA-256 plus one SHA-256 per
chunk), so a newcomer can fetch different chunks from different sources at once and still check
every byte: a chunk that fails its digest is fetched again elsewhere. The hivemind backend
serves a joining peer's state this way, and RL rollout workers fetch the policy this way.
"""

from __future__ import annotations

import hashlib

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

STATE_CHUNK_BYTES = 4 << 20  # 4 MiB: big enough to stream, small enough to spread over peers


def pack_state(state: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    """Serialized state and its SHA-256, so a receiver can check it before adopting it."""
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    blob = st_save(tensors)
    return blob, hashlib.sha256(blob).hexdigest()


def unpack_state(blob: bytes, expected_sha256: str) -> dict[str, torch.Tensor]:
    actual = hashlib.sha256(blob).hexdigest()
    if actual != expected_sha256:
        raise ValueError(f"state hash mismatch: got {actual[:16]}, expected {expected_sha256[:16]}")
    return st_load(blob)


def chunk_digests(blob: bytes, chunk_bytes: int) -> list[str]:
    """SHA-256 of each ``chunk_bytes`` slice of ``blob`` (one digest for an empty blob)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk size must be >= 1 byte, got {chunk_bytes}")
    starts = range(0, len(blob), chunk_bytes) if blob else [0]
    return [hashlib.sha256(blob[i : i + chunk_bytes]).hexdigest() for i in starts]


def chunk_ok(data: bytes, expected_sha256: str) -> bool:
    return hashlib.sha256(data).hexdigest() == expected_sha256
