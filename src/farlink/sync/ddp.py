"""Data-parallel baseline: gradients averaged before every AdamW step.

This is what a single cluster does, and the yardstick for loss at equal tokens and for bytes sent.
A failed round skips the optimizer step on every replica alike (the batch is dropped, not half
applied), so replicas never diverge.

Knobs: only the shared ones (:class:`~farlink.sync.base.SyncOptions`); ``inner_steps`` is just the
checkpoint and evaluation cadence. The optimizer is the caller's (default AdamW, betas 0.9/0.95),
stepped on the averaged gradients. Capabilities: a round after every step, any backend.
"""

from __future__ import annotations

import torch

from farlink.comm.base import RoundInfo
from farlink.sync.base import (
    Capabilities,
    StepOutcome,
    SyncAlgorithm,
    TensorState,
    load_optimizer_state,
    optimizer_state,
)
from farlink.sync.exchange import ExchangeResult


class DDP(SyncAlgorithm):
    name = "ddp"
    capabilities = Capabilities(syncs_every_step=True)

    def step(self, tokens: int) -> StepOutcome:
        committed, seconds, info = self.run_round(self._gradients, self._apply, float(tokens))
        self.inner_steps_done += 1
        return self.round_outcome(committed, seconds, info)

    def _gradients(self, info: RoundInfo) -> dict[str, torch.Tensor]:
        return {
            n: (p.grad if p.grad is not None and not info.healed else torch.zeros_like(p))
            for n, p in zip(self.names, self.params)
        }

    def _apply(self, result: ExchangeResult, info: RoundInfo) -> None:
        if result.total_weight <= 0:
            self.inner_opt.zero_grad(set_to_none=True)
            return
        for n, p in zip(self.names, self.params):
            p.grad = result.tensors[n].to(p.dtype)
        self.clip_and_step(self.inner_opt)

    def shared_state(self) -> TensorState:
        return {**self.replica_state(), **optimizer_state(self.inner_opt, "inner")}

    def load_shared_state(self, state: TensorState) -> None:
        self.load_replica_state(state)
        load_optimizer_state(self.inner_opt, state, "inner")

    def state_dict(self) -> TensorState:
        return {**self.shared_state(), **self.exchange.compressor.state_dict()}

    def load_state_dict(self, state: TensorState) -> None:
        self.load_shared_state(state)
        self.exchange.compressor.load_state_dict(
            {k: v for k, v in state.items() if k.startswith("residual.")}
        )
