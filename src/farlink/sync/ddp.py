"""Data-parallel baseline: gradients averaged before every AdamW step.

This is what a single cluster does, and the yardstick for loss at equal tokens and for bytes sent.
A failed round skips the optimizer step on every replica alike (the batch is dropped, not half
applied), so replicas never diverge.

Knobs: only the shared ones (:class:`~farlink.sync.base.SyncOptions`); ``inner_steps`` is just the
checkpoint and evaluation cadence. The optimizer is the caller's (default AdamW, betas 0.9/0.95),
stepped on the averaged gradients. Capabilities: a round after every step, any backend.

On a replica group of several ranks sharded with FSDP2, each rank's gradient after backward is its
shard of the replica group's averaged gradient; rank r averages that shard with rank r of the other
replica groups, and the inner step (elementwise, as AdamW's is) updates each shard from it: the
whole replica steps on the gradient of every replica group's batch, as one process would. A DDP
replica group (``--sharding ddp``) would average only a 1/K slice of each gradient per rank and
need the slices shared before the inner step, every step; it is refused (use ``--sharding fsdp``).
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
    capabilities = Capabilities(syncs_every_step=True, sharded=True)

    def step(self, tokens: int) -> StepOutcome:
        committed, seconds, info = self.run_round(self._gradients, self._apply, float(tokens))
        self.inner_steps_done += 1
        return self.round_outcome(committed, seconds, info)

    def _gradients(self, info: RoundInfo) -> dict[str, torch.Tensor]:
        grads = [None] * len(self.params) if info.healed else self.local_gradients()
        return {n: torch.zeros_like(p) if g is None else g
                for n, p, g in zip(self.names, self.params, grads)}

    def _apply(self, result: ExchangeResult, info: RoundInfo) -> None:
        from farlink.parallel.sharding import is_sharded

        if result.total_weight <= 0:
            self.inner_opt.zero_grad(set_to_none=True)
            return
        for n, p, held in zip(self.names, self.params, self.module_params):
            average = result.tensors[n].to(p.dtype)
            if not is_sharded(held):
                held.grad = average
            elif held.grad is None:  # a parameter this rank's rows did not reach
                from torch.distributed.tensor import DTensor

                held.grad = DTensor.from_local(average, held.device_mesh, held.placements,
                                               shape=held.shape, stride=held.stride())
            else:
                held.grad.to_local().copy_(average)
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
