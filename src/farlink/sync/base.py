"""The outer-algorithm interface: what happens to the parameters after each backward pass.

An algorithm owns the optimizers (inner and outer) because that is where the families differ:
DDP averages gradients before every AdamW step, DiLoCo runs AdamW alone for H steps and then takes
an outer Nesterov step on the averaged pseudo-gradient, DeMo replaces AdamW by a sign step on
gathered DCT momentum. The training loop only calls :meth:`SyncAlgorithm.step` after
``loss.backward()``; algorithms talk to peers only through an :class:`~farlink.sync.exchange.Exchange`
and the :class:`~farlink.comm.base.Collective` it wraps, never through a concrete backend.

Committed state is what every replica agrees on after an outer step (global parameters, outer
optimizer state, the round counter). It is what a newcomer receives (:meth:`shared_state`) and what
a checkpoint must restore exactly (:meth:`state_dict`, which adds this worker's private state).
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from farlink.comm.base import Collective, RoundInfo
from farlink.sync.exchange import Exchange, ExchangeResult

if TYPE_CHECKING:
    from farlink.config import RunConfig

log = logging.getLogger(__name__)

TensorState = dict[str, torch.Tensor]


@dataclass
class StepOutcome:
    """What one call to :meth:`SyncAlgorithm.step` did, for metrics."""

    synced: bool = False  # a round was attempted during this step
    committed: bool = False  # ... and every participant committed it
    outer_step: int = 0  # committed rounds so far
    world_size: int = 1
    comm_seconds: float = 0.0  # time this step spent blocked on communication
    rejected: int = 0  # peer updates dropped by validation this step


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup then cosine decay to ``min_ratio * base_lr`` (nanoGPT's schedule)."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def nearest_step_boundary(now: float, started: float, steps: int, deadline: float) -> bool:
    """Whether a time-budgeted round should end after the step just taken: at the step boundary
    nearest ``deadline``. Ending at the first boundary past it makes a worker with long steps
    (a slow device) overshoot by up to a whole step while every other worker waits for it;
    the nearest boundary bounds it to half a step either way. A step's length is this round's
    mean (``steps`` taken since ``started``)."""
    per_step = (now - started) / max(steps, 1)
    return now + per_step / 2 >= deadline


def optimizer_state(opt: torch.optim.Optimizer, prefix: str) -> TensorState:
    """Flatten an optimizer's per-parameter state into named tensors (safetensors-friendly)."""
    out: TensorState = {}
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            out[f"{prefix}.{index}.{key}"] = tensor.detach().clone()
    return out


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: TensorState, prefix: str) -> None:
    full = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if not name.startswith(prefix + "."):
            continue
        index, key = name[len(prefix) + 1 :].split(".", 1)
        state.setdefault(int(index), {})[key] = value.clone()
    full["state"] = state
    opt.load_state_dict(full)


def worker_private_state(algo: SyncAlgorithm) -> TensorState:
    """What a checkpoint adds for a local-update algorithm beyond the committed state: its inner
    optimizer, its local (not yet synced) parameters and its codec residuals."""
    state = optimizer_state(algo.inner_opt, "inner")
    state.update({f"local.{n}": p.detach().clone() for n, p in zip(algo.names, algo.params)})
    state.update(algo.exchange.compressor.state_dict())
    return state


def load_worker_private_state(algo: SyncAlgorithm, state: TensorState) -> None:
    load_optimizer_state(algo.inner_opt, state, "inner")
    with torch.no_grad():
        for n, p in zip(algo.names, algo.params):
            p.copy_(state[f"local.{n}"])
    algo.exchange.compressor.load_state_dict(
        {k: v for k, v in state.items() if k.startswith("residual.")}
    )


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


class SyncAlgorithm(ABC):
    name: ClassVar[str]
    # True when every inner step is a round (ddp, demo); False when rounds come every
    # --inner-steps steps, so a run needs steps >= inner_steps to sync at all
    syncs_every_step: ClassVar[bool] = False

    def __init__(
        self, model: nn.Module, cfg: RunConfig, collective: Collective, exchange: Exchange
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.collective = collective
        self.exchange = exchange
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.inner_steps_done = 0
        self.outer_step = 0
        self.last_round: RoundInfo | None = None
        self.last_exchange: ExchangeResult | None = None
        # where rounds spend their time, cumulative: waiting for the quorum (which absorbs
        # stragglers), moving bytes, and the rest (encode, decode, validate, apply) on this
        # worker; benchmarks compare them with the planner's terms
        self.quorum_seconds = 0.0
        self.network_seconds = 0.0
        self.round_seconds = 0.0
        collective.register_state(self.export_state, self.import_state)

    # --- the training loop's view -------------------------------------------------------------
    @abstractmethod
    def step(self, tokens: int) -> StepOutcome:
        """Called after ``loss.backward()`` with the number of tokens in the batch."""

    def at_boundary(self, outcome: StepOutcome) -> bool:
        """Whether the loop should checkpoint/evaluate now (every H steps by default)."""
        return self.inner_steps_done % self.cfg.inner_steps == 0

    def finished(self) -> bool:
        return self.inner_steps_done >= self.cfg.steps

    def join(self) -> StepOutcome | None:
        """A newcomer's first round, before any inner step: heal from live peers now rather
        than after H wasted steps. Algorithms without a cheap zero-weight round return None
        (their newcomers heal in their first regular round)."""
        return None

    def finish(self) -> StepOutcome | None:
        """Flush work still in flight (streaming); default: nothing pending."""
        return None

    # --- state ---------------------------------------------------------------------------------
    @abstractmethod
    def shared_state(self) -> TensorState:
        """Committed state every replica agrees on; what a newcomer downloads."""

    @abstractmethod
    def load_shared_state(self, state: TensorState) -> None:
        """Adopt a live peer's committed state (healing)."""

    def fingerprint(self) -> str:
        """Hash of the committed state: equal on every replica after a committed round."""
        return state_digest(self.shared_state()).hex()[:16]

    def export_state(self) -> TensorState:
        """Committed state for a healing peer, sealed with its SHA-256 (checked on arrival)."""
        state = self.shared_state()
        state["integrity.sha256"] = torch.frombuffer(
            bytearray(state_digest(state, include_schedule=True)), dtype=torch.uint8)
        return state

    def import_state(self, state: TensorState) -> None:
        """Adopt a transferred state only if it hashes to what the sender sealed."""
        state = dict(state)
        seal = state.pop("integrity.sha256", None)
        if seal is None:
            raise StateTransferError("transferred state carries no integrity hash")
        if bytes(seal.numpy().tobytes()) != state_digest(state, include_schedule=True):
            raise StateTransferError("transferred state does not match its hash; not loaded")
        log.info("healed from a live peer: state verified (%s)", bytes(seal[:8].numpy()).hex())
        self.load_shared_state(state)

    def state_dict(self) -> TensorState:
        """Shared state plus this worker's private state, for an exact resume."""
        return {**self.shared_state(), "counter.inner_steps": torch.tensor(self.inner_steps_done)}

    def load_state_dict(self, state: TensorState) -> None:
        self.load_shared_state(state)
        self.inner_steps_done = int(state["counter.inner_steps"])

    # --- helpers -------------------------------------------------------------------------------
    def round_outcome(self, committed: bool, seconds: float, info: RoundInfo | None) -> StepOutcome:
        """The outcome of a step that ran a round (see :meth:`run_round`)."""
        result = self.last_exchange
        return StepOutcome(
            synced=True,
            committed=committed,
            outer_step=self.outer_step,
            world_size=info.world_size if info else 1,
            comm_seconds=seconds,
            rejected=len(result.rejected) if result else 0,
        )

    def replica_state(self) -> TensorState:
        """Parameters and counters, for algorithms whose replicas hold no separate global copy."""
        state = {f"param.{n}": p.detach().clone() for n, p in zip(self.names, self.params)}
        state["counter.outer_step"] = torch.tensor(self.outer_step)
        state["counter.inner_steps"] = torch.tensor(self.inner_steps_done)
        return state

    def load_replica_state(self, state: TensorState) -> None:
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(state[f"param.{n}"])
        self.outer_step = int(state["counter.outer_step"])
        self.inner_steps_done = int(state["counter.inner_steps"])

    def current_lr(self) -> float:
        cfg = self.cfg
        return lr_at(self.inner_steps_done, cfg.lr, cfg.warmup_steps, cfg.steps)

    def clip_and_step(self, optimizer: torch.optim.Optimizer) -> None:
        lr = self.current_lr()
        for group in optimizer.param_groups:
            group["lr"] = lr
        if self.cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def run_round(
        self, build: callable, apply: callable, weight: float
    ) -> tuple[bool, float, RoundInfo | None]:
        """One fault-tolerant round: quorum, exchange, commit; retried after a failure.

        ``build(info)`` returns the named tensors to send (called after the quorum, so a worker
        healed in this quorum sends its freshly loaded state's update); ``apply(result, info)`` runs
        only when every participant committed. Returns (committed, seconds blocked, round info).
        """
        start = time.perf_counter()
        network_before = self.collective.stats.comm_seconds
        info, committed = None, False
        for attempt in range(self.cfg.round_retries + 1):
            asked = time.perf_counter()
            info = self.collective.begin_round()
            self.quorum_seconds += time.perf_counter() - asked
            self.last_round = info
            tensors = build(info)
            result = self.exchange.average(
                tensors, 0.0 if info.healed else weight, info.round_id
            )
            self.last_exchange = result
            if self.collective.commit():
                apply(result, info)
                self.outer_step = info.round_id + 1
                committed = True
                break
            log.warning("round %d not committed (attempt %d)", info.round_id, attempt + 1)
            self.collective.stats.failed_rounds += 1
        seconds = time.perf_counter() - start
        self.round_seconds += seconds
        self.network_seconds += self.collective.stats.comm_seconds - network_before
        return committed, seconds, info
