"""A state's SHA-256, so a state handed from one peer to another (healing, a checkpoint moved
between replica groups) is loaded only when its bytes are the ones the sender hashed. Its own
module since the algorithms, the group mixing layer and the trust checks all hash states."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("farlink.sync.base")

TensorState = dict[str, torch.Tensor]


class StateTransferError(RuntimeError):
    """A state received from a peer that fails verification."""


def state_digest(state: TensorState, include_schedule: bool = False) -> bytes:
    """SHA-256 over names, dtypes, shapes and bytes of a state, in name order."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        if name.startswith("schedule.") and not include_schedule:
            continue
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.digest()


def with_digest(state: TensorState) -> TensorState:
    """``state`` with its SHA-256 (schedule included) added, for a transfer to a peer."""
    return {**state, "integrity.sha256": torch.frombuffer(
        bytearray(state_digest(state, include_schedule=True)), dtype=torch.uint8)}


def verified(state: TensorState) -> TensorState:
    """A transferred state without its digest, if it hashes to what the sender sent; else
    :class:`StateTransferError` (nothing of it must be loaded)."""
    state = dict(state)
    hash_ = state.pop("integrity.sha256", None)
    if hash_ is None:
        raise StateTransferError("transferred state carries no integrity hash")
    if bytes(hash_.numpy().tobytes()) != state_digest(state, include_schedule=True):
        raise StateTransferError("transferred state does not match its hash; not loaded")
    log.info("state from a live peer verified (%s)", bytes(hash_[:8].numpy()).hex())
    return state
