"""Policy versions out to rollout workers: hashed chunks once, compressed deltas after.

The trainer publishes a *served* copy of its weights, one version per step. Version ``v+1`` is
version ``v`` plus the codec's decoding of ``trained - served`` (what the codec dropped stays in
that difference and goes out with a later delta, so the served copy tracks the trained weights
like error feedback would). Both sides add the same decoded delta to the same tensors, so a
worker's copy of a version is bit-identical to the trainer's: the verifier can recompute a
rollout under exactly the weights that sampled it.

A worker that holds version ``u`` receives the deltas ``u+1 .. v`` (each a codec payload per
tensor); one that is further behind than ``max_chain``, or new, fetches the full state as a
safetensors blob in hashed chunks (:mod:`farlink.state.snapshot`), checking every chunk.
Every byte either way is counted on the worker's side.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

import torch
from torch import nn

from farlink.codecs import Codec
from farlink.state.snapshot import chunk_digests, chunk_ok, pack_state, unpack_state


@dataclass
class Snapshot:
    """A full version: the blob, its digest and one digest per chunk."""

    version: int
    blob: bytes
    sha256: str
    chunk_bytes: int
    chunks: list[str]


class PolicyPublisher:
    """The trainer's side: the served copy, the last ``keep`` versions' deltas and weights."""

    def __init__(self, model: nn.Module, codec: Codec, keep: int = 8,
                 chunk_bytes: int = 64 << 10) -> None:
        self.codec, self.keep, self.chunk_bytes = codec, keep, chunk_bytes
        # parameters, not state_dict(): a tied weight is one tensor and must get its delta once
        self.served = {k: v.detach().float().clone() for k, v in model.named_parameters()}
        self.version = 0
        #: who numbers the versions: a restarted trainer's version 5 need not be the old one's
        self.epoch = secrets.randbits(63)
        self._deltas: dict[int, dict[str, bytes]] = {}
        self._weights: dict[int, dict[str, torch.Tensor]] = {0: self._copy()}
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()

    def _copy(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.served.items()}

    @property
    def full_bytes(self) -> int:
        """fp32 weights: what a full refresh of every tensor would cost without the container."""
        return sum(v.numel() * 4 for v in self.served.values())

    def publish(self, model: nn.Module) -> int:
        """Serve the next version (the trained weights through the codec); its number."""
        trained = dict(model.named_parameters())
        payloads = {}
        with self._lock:
            for name, served in self.served.items():
                delta = trained[name].detach().float() - served
                payload = self.codec.encode(delta)
                served += self.codec.decode(payload, delta.shape, delta.dtype)
                payloads[name] = payload
            self.version += 1
            self._deltas[self.version] = payloads
            self._weights[self.version] = self._copy()
            for old in [v for v in self._deltas if v <= self.version - self.keep]:
                del self._deltas[old]
            for old in [v for v in self._weights if v < self.version - self.keep]:
                del self._weights[old]
            self._snapshot = None
            return self.version

    def restore(self, served: dict[str, torch.Tensor], version: int) -> None:
        """Serve ``served`` as ``version`` (a restarted trainer): no deltas are kept from
        before, so every worker's next refresh is a full fetch."""
        with self._lock:
            self.served = {k: v.float().clone() for k, v in served.items()}
            self.version = version
            self.epoch = secrets.randbits(63)
            self._deltas = {}
            self._weights = {version: self._copy()}
            self._snapshot = None

    def weights(self, version: int) -> dict[str, torch.Tensor] | None:
        """The served weights of ``version`` while kept (for the verifier), else None."""
        with self._lock:
            return self._weights.get(version)

    def deltas(self, since: int) -> tuple[int, list[dict[str, bytes]]] | None:
        """The deltas from ``since`` to the newest version, or None when one is gone."""
        with self._lock:
            wanted = range(since + 1, self.version + 1)
            if any(v not in self._deltas for v in wanted):
                return None
            return self.version, [self._deltas[v] for v in wanted]

    def snapshot(self) -> Snapshot:
        with self._lock:
            if self._snapshot is None or self._snapshot.version != self.version:
                blob, digest = pack_state(self.served)
                self._snapshot = Snapshot(self.version, blob, digest, self.chunk_bytes,
                                          chunk_digests(blob, self.chunk_bytes))
            return self._snapshot


class PolicyReplica:
    """A worker's copy of the served policy and the bytes it took to keep it current."""

    def __init__(self, model: nn.Module, codec: Codec, max_chain: int = 4) -> None:
        self.model, self.codec, self.max_chain = model, codec, max_chain
        self.version: int | None = None
        self.epoch: int | None = None  # the publisher's that numbered ``version``
        self.bytes_received = 0
        self.full_fetches = 0
        self.delta_updates = 0  # refreshes by deltas
        self.delta_versions = 0  # versions those refreshes covered (a chain covers several)
        self.delta_bytes = 0

    def refresh(self, publisher: PolicyPublisher) -> int:
        """Bring the copy to the newest version; the version held afterwards."""
        epoch, newest = publisher.epoch, publisher.version
        if epoch != self.epoch:  # a restarted trainer: its version numbers name other weights
            self.version = None
        if self.version == newest:
            return self.version
        update = None
        if self.version is not None and newest - self.version <= self.max_chain:
            update = publisher.deltas(self.version)
        if update is None:
            self._fetch_full(publisher.snapshot())
            self.epoch = epoch
        else:
            version, chain = update
            state = dict(self.model.named_parameters())
            with torch.no_grad():
                for payloads in chain:
                    for name, payload in payloads.items():
                        self.bytes_received += len(payload)
                        self.delta_bytes += len(payload)
                        target = state[name]
                        target += self.codec.decode(payload, target.shape, torch.float32)
            self.version = version
            self.delta_updates += 1
            self.delta_versions += len(chain)
        return self.version

    def _fetch_full(self, snapshot: Snapshot) -> None:
        parts = []
        for i, digest in enumerate(snapshot.chunks):
            data = snapshot.blob[i * snapshot.chunk_bytes:(i + 1) * snapshot.chunk_bytes]
            self.bytes_received += len(data)
            if not chunk_ok(data, digest):
                raise ValueError(f"policy chunk {i} of version {snapshot.version} fails its hash")
            parts.append(data)
        state = unpack_state(b"".join(parts), snapshot.sha256)
        self.model.load_state_dict(state, strict=False)
        self.version = snapshot.version
        self.full_fetches += 1
