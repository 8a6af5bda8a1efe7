"""DeMo, decoupled momentum optimization (arXiv 2411.19870).

Each worker keeps its own momentum ``m <- beta * m + g`` and never synchronizes it. Every step it
extracts the fast-moving part of m: chunked DCT, top-k coefficients per chunk (the ``dct_topk``
codec), subtracts what it extracted from m (error feedback: the rest keeps accumulating), and
all-gathers only those sparse coefficients. The average of everyone's extracted components drives
a sign-SGD step with decoupled weight decay, so replicas stay identical while sending a small
fraction of what gradient all-reduce sends.
"""

from __future__ import annotations

import torch

from farlink.codecs import make_compressor
from farlink.comm.base import RoundInfo
from farlink.sync.base import StepOutcome, SyncAlgorithm, TensorState
from farlink.sync.exchange import ExchangeResult


class DeMo(SyncAlgorithm):
    name = "demo"
    syncs_every_step = True  # the sparse momentum components are all-gathered each step

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.extractor = make_compressor(f"dct_topk:{cfg.demo_chunk}:{cfg.demo_topk}")
        if self.exchange.compressor.codec.name == "fp32":
            # the wire format *is* the sparse DCT coefficients unless the user chose otherwise
            self.exchange.compressor = self.extractor
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self._extracted: dict[str, torch.Tensor] = {}

    def current_lr(self) -> float:
        from farlink.sync.base import lr_at

        cfg = self.cfg
        return lr_at(self.inner_steps_done, cfg.demo_lr, cfg.warmup_steps, cfg.steps)

    def step(self, tokens: int) -> StepOutcome:
        beta = self.cfg.demo_beta
        self._extracted = {}
        with torch.no_grad():
            for name, m, p in zip(self.names, self.momentum, self.params):
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                m.mul_(beta).add_(grad)
                sent, _ = self.extractor.codec.roundtrip(m)
                m.sub_(sent)  # error feedback: what was not sent stays in the momentum
                self._extracted[name] = sent
        committed, seconds, info = self.run_round(self._build, self._apply, float(tokens))
        self.inner_steps_done += 1
        for p in self.params:
            p.grad = None
        return self.round_outcome(committed, seconds, info)

    def _build(self, info: RoundInfo) -> dict[str, torch.Tensor]:
        if info.healed:
            return {n: torch.zeros_like(t) for n, t in self._extracted.items()}
        return self._extracted

    def _apply(self, result: ExchangeResult, info: RoundInfo) -> None:
        if result.total_weight <= 0:
            return
        lr, wd = self.current_lr(), self.cfg.weight_decay
        with torch.no_grad():
            for name, p in zip(self.names, self.params):
                p.mul_(1 - lr * wd)
                p.add_(torch.sign(result.tensors[name]).to(p.dtype), alpha=-lr)

    def shared_state(self) -> TensorState:
        return self.replica_state()

    def load_shared_state(self, state: TensorState) -> None:
        self.load_replica_state(state)

    def state_dict(self) -> TensorState:
        state = self.shared_state()
        state.update({f"momentum.{n}": m.clone() for n, m in zip(self.names, self.momentum)})
        return state

    def load_state_dict(self, state: TensorState) -> None:
        self.load_shared_state(state)
        for n, m in zip(self.names, self.momentum):
            m.copy_(state[f"momentum.{n}"])
