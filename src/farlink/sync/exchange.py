"""One round's exchange of named tensors: encode, sign, gather, verify, validate, aggregate.

This is the only place where an algorithm's update leaves the worker. Two paths:

* dense: fp32, plain token-weighted mean, no authentication -> one ring all-reduce of
  ``weight * tensor`` plus the weight (the cheapest exact path, used by DDP and plain DiLoCo);
* gathered: anything else -> every peer's update is encoded by the codec, packed in an envelope,
  signed, all-gathered as real bytes, and each received message is verified, decoded and checked
  before a (possibly Byzantine-robust) aggregator combines them. A message that fails any check is
  dropped with its reason logged (and recorded in the ledger); the round goes on without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from farlink.codecs import Compressor, CodecError
from farlink.codecs import envelope
from farlink.comm.base import Collective
from farlink.robust.aggregators import Aggregator, weighted_mean
from farlink.robust.auth import Authenticator, AuthError
from farlink.robust.validate import UpdateRejected, check_update

log = logging.getLogger(__name__)


@dataclass
class ExchangeResult:
    """The aggregate of one round, and who it came from."""

    tensors: dict[str, torch.Tensor]
    total_weight: float
    accepted: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)


class Exchange:
    def __init__(
        self,
        collective: Collective,
        compressor: Compressor,
        sender: str,
        aggregator: Aggregator = weighted_mean,
        authenticator: Authenticator | None = None,
        max_update_norm: float | None = None,
        ledger=None,  # noqa: ANN001 - farlink.robust.ledger.Ledger, optional
        tamper=None,  # noqa: ANN001 - attack emulation hook: (tensors, round) -> tensors
    ) -> None:
        self.collective = collective
        self.compressor = compressor
        self.sender = sender
        self.aggregator = aggregator
        self.authenticator = authenticator or Authenticator()
        self.max_update_norm = max_update_norm
        self.ledger = ledger
        self.tamper = tamper

    @property
    def dense(self) -> bool:
        return (
            self.compressor.codec.name == "fp32"
            and not self.compressor.error_feedback
            and self.aggregator is weighted_mean
            and self.authenticator.name == "none"
            and self.tamper is None
        )

    def average(
        self, tensors: dict[str, torch.Tensor], weight: float, round_id: int
    ) -> ExchangeResult:
        """Token-weighted aggregate of every participant's ``tensors`` for this round."""
        if self.tamper is not None:
            tensors = self.tamper(tensors, round_id)
        if self.dense:
            return self._all_reduce(tensors, weight)
        return self._gather(tensors, weight, round_id)

    def _all_reduce(self, tensors: dict[str, torch.Tensor], weight: float) -> ExchangeResult:
        names = list(tensors)
        flat = torch.cat([tensors[n].detach().float().reshape(-1) * weight for n in names])
        flat = torch.cat([flat, torch.tensor([weight], dtype=torch.float32)])
        self.collective.all_reduce_sum([flat])
        total = float(flat[-1])
        out, offset = {}, 0
        for n in names:
            numel = tensors[n].numel()
            chunk = flat[offset : offset + numel].reshape(tensors[n].shape)
            out[n] = chunk / total if total > 0 else torch.zeros_like(chunk)
            offset += numel
        return ExchangeResult(out, total)

    def _gather(
        self, tensors: dict[str, torch.Tensor], weight: float, round_id: int
    ) -> ExchangeResult:
        payloads = {n: self.compressor.encode(n, t) for n, t in tensors.items()}
        message = envelope.pack(
            self.sender, round_id, weight, payloads,
            {n: tuple(t.shape) for n, t in tensors.items()},
            {n: torch.float32 for n in tensors},
        )
        received = self.collective.all_gather_bytes(self.authenticator.sign(message))
        updates: dict[str, list[torch.Tensor]] = {n: [] for n in tensors}
        weights: list[float] = []
        result = ExchangeResult({}, 0.0)
        for index, raw in enumerate(received):
            peer = f"rank{index}"
            try:
                env = envelope.unpack(self.authenticator.verify(raw))
                peer = env.sender
                decoded = self._decode(env, tensors, round_id)
            except (CodecError, AuthError, UpdateRejected) as exc:
                result.rejected[peer] = f"{type(exc).__name__}: {exc}"
                log.warning("rejected update from %s: %s", peer, exc)
                if self.ledger is not None:
                    self.ledger.record_rejected(peer, str(exc))
                continue
            for n, t in decoded.items():
                updates[n].append(t)
            weights.append(env.weight)
            result.accepted.append(peer)
            if self.ledger is not None:
                self.ledger.record_accepted(peer, env.weight)
        result.total_weight = float(sum(weights))
        if not weights:
            return result
        w = torch.tensor(weights, dtype=torch.float32)
        result.tensors = {n: self.aggregator(torch.stack(updates[n]), w) for n in tensors}
        return result

    def _decode(
        self, env: envelope.Envelope, expected: dict[str, torch.Tensor], round_id: int
    ) -> dict[str, torch.Tensor]:
        if env.round_id != round_id:
            raise UpdateRejected(f"update is for round {env.round_id}, this is round {round_id}")
        if set(env.payloads) != set(expected):
            raise UpdateRejected("update names a different set of tensors")
        out = {}
        for name, ref in expected.items():
            if tuple(env.shapes[name]) != tuple(ref.shape):
                raise UpdateRejected(f"{name}: shape {env.shapes[name]} != {tuple(ref.shape)}")
            tensor = self.compressor.decode(env.payloads[name], ref.shape, torch.float32)
            check_update(name, tensor, tuple(ref.shape), self.max_update_norm)
            out[name] = tensor
        return out
