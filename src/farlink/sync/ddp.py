"""Data-parallel baseline: gradients averaged before every AdamW step.

This is what a single cluster does, and the yardstick for loss at equal tokens and for bytes sent.
A failed round skips the optimizer step on every replica alike (the batch is dropped, not half
applied), so replicas never diverge.
"""

from __future__ import annotations

import torch

from farlink.comm.base import RoundInfo
from farlink.sync.base import (
    StepOutcome,
    SyncAlgorithm,
    TensorState,
    load_optimizer_state,
    optimizer_state,
)
from farlink.sync.exchange import ExchangeResult


class DDP(SyncAlgorithm):
    name = "ddp"
    syncs_every_step = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )

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
            self.optimizer.zero_grad(set_to_none=True)
            return
        for n, p in zip(self.names, self.params):
            p.grad = result.tensors[n].to(p.dtype)
        self.clip_and_step(self.optimizer)

    def shared_state(self) -> TensorState:
        return {**self.replica_state(), **optimizer_state(self.optimizer, "inner")}

    def load_shared_state(self, state: TensorState) -> None:
        self.load_replica_state(state)
        load_optimizer_state(self.optimizer, state, "inner")

    def state_dict(self) -> TensorState:
        return {**self.shared_state(), **self.exchange.compressor.state_dict()}

    def load_state_dict(self, state: TensorState) -> None:
        self.load_shared_state(state)
        self.exchange.compressor.load_state_dict(
            {k: v for k, v in state.items() if k.startswith("residual.")}
        )
