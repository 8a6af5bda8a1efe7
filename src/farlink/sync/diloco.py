"""DiLoCo (arXiv 2311.08105) and its special case, local SGD.

Each worker runs H inner AdamW steps from the shared parameters θ. The pseudo-gradient
Δ = θ - θ_local is averaged over the round's participants (weighted by the tokens each worker
processed, so a slow worker that did fewer steps counts less) and applied by an outer SGD with
Nesterov momentum (lr 0.7, momentum 0.9). Local SGD is the same loop with the outer step replaced by
plain averaging (outer lr 1, no momentum).

A failed round (a peer died mid-exchange) leaves θ untouched; local training continues and the
next round's Δ simply spans more steps, so no committed work is lost and none is applied twice.

Knobs (:class:`DiLoCoOptions`): ``inner_steps`` (H), ``outer_lr``/``outer_momentum`` of the default
outer optimizer (any other is injected as a factory of the global parameters), and
``round_seconds``: time-budgeted rounds for devices of different speeds, where every worker runs
as many inner steps as fit and ends at the step boundary nearest the deadline. The inner
optimizer is the caller's (default AdamW, betas 0.9/0.95). Capabilities: time budgets, any
backend.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field

from farlink.comm.base import RoundInfo
from farlink.sync.base import (
    Capabilities,
    OuterOptimizerFactory,
    StepOutcome,
    SyncAlgorithm,
    SyncOptions,
    TensorState,
    load_optimizer_state,
    load_worker_private_state,
    nesterov,
    nothing_more,
    optimizer_state,
    worker_private_state,
)
from farlink.sync.exchange import ExchangeResult, dense_of

log = logging.getLogger(__name__)


class DiLoCoOptions(SyncOptions):
    outer_lr: float = Field(0.7, gt=0, description="outer Nesterov SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    round_seconds: float | None = Field(
        None, gt=0, description="time-budgeted DiLoCo: each round lasts this long and every "
        "worker runs as many inner steps as fit (rounds = steps / inner_steps)")
    outer_overlap: Literal["none", "delayed", "eager"] = Field(
        "none", description="the outer step off the critical path: 'delayed' applies round "
        "r's averaged update one round later, its exchange running while round r+1 computes "
        "(DiLoCoX's one-step delay); 'eager' also steps at once with this worker's own "
        "pseudo-gradient standing in for its share of the average not yet known (arXiv "
        "2502.12996). 'none': every round blocks until its average is applied")


class DiLoCo(SyncAlgorithm):
    name = "diloco"
    Options = DiLoCoOptions
    capabilities = Capabilities(time_budget=True, outer_optimizer=True, sharded=True,
                                stage_averaging=True, partial_groups=True, delayed_outer=True)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.global_params = [p.detach().clone() for p in self.params]
        self.outer_opt = self.make_outer_optimizer(self.global_params)
        self.tokens_since_sync = 0
        #: guards the committed state where a background round may read it (a peer healing
        #: from this replica) while the training thread applies a delayed update
        self.state_lock = threading.RLock()
        self.delayed = None
        # (a fragmented algorithm delays its fragments' rounds itself: farlink.sync.streaming)
        if getattr(self.cfg, "outer_overlap", "none") != "none" \
                and not self.capabilities.fragments:
            from farlink.sync.delayed import DelayedOuterStep

            if not self.capabilities.delayed_outer:
                raise ValueError(f"{self.name} has no delayed outer step (--outer-overlap); "
                                 "use diloco, local_sgd or sparseloco")

            self.delayed = DelayedOuterStep(self, eager=self.cfg.outer_overlap == "eager")
        self._carry: dict[str, torch.Tensor] = {}  # a failed delayed round's Δ, sent next
        self._pending_heal: TensorState | None = None  # healed on the round's thread

    @classmethod
    def outer_optimizer_of(cls, options: DiLoCoOptions) -> OuterOptimizerFactory:
        """Nesterov SGD with the options' lr and momentum (DiLoCo: 0.7, 0.9)."""
        return nesterov(options.outer_lr, options.outer_momentum)

    def default_outer_optimizer(self) -> OuterOptimizerFactory:
        return self.outer_optimizer_of(self.cfg)

    def make_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The outer optimizer over ``params`` (a global copy): the injected one, or the default."""
        return (self.outer_factory or self.default_outer_optimizer())(params)

    # --- the outer step, on the run's global state or on a given one ----------------------------
    def pseudo_gradient(self, local: list[torch.Tensor],
                        start: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Δ = θ_start - θ_local, named: how far ``local`` moved from ``start`` (default θ_g)."""
        start = self.global_params if start is None else start
        return {n: (g - p.detach()) for n, g, p in zip(self.names, start, local)}

    def outer_update(self, result: ExchangeResult, params: list[torch.Tensor] | None = None,
                     opt: torch.optim.Optimizer | None = None) -> None:
        """The outer step: the averaged Δ is the gradient of ``params`` (default θ_g) for
        ``opt`` (default the outer optimizer); a round nobody contributed to changes nothing."""
        params = self.global_params if params is None else params
        opt = self.outer_opt if opt is None else opt
        if result.total_weight <= 0:
            return
        bad = [n for n in self.names if not torch.isfinite(result.tensors[n]).all()]
        if bad:  # the exchange drops such a round; a result from elsewhere may not have
            log.warning("outer step skipped: the round's averaged update of %s is not finite "
                        "(nonfinite aggregate); the global parameters stay as they were",
                        ", ".join(bad[:3]))
            return
        for n, g in zip(self.names, params):
            g.grad = result.tensors[n].to(g.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def global_state(self, params: list[torch.Tensor] | None = None,
                     opt: torch.optim.Optimizer | None = None) -> TensorState:
        """θ_g and the outer optimizer's state (default: the run's own), as named tensors."""
        params = self.global_params if params is None else params
        state = {f"global.{n}": g.detach().clone() for n, g in zip(self.names, params)}
        state.update(optimizer_state(self.outer_opt if opt is None else opt, "outer"))
        return state

    def load_global_state(self, state: TensorState, params: list[torch.Tensor] | None = None,
                          opt: torch.optim.Optimizer | None = None) -> None:
        params = self.global_params if params is None else params
        with torch.no_grad():
            for n, g in zip(self.names, params):
                g.copy_(state[f"global.{n}"])
        load_optimizer_state(self.outer_opt if opt is None else opt, state, "outer")

    # --- the round loop: the schedule says when (H steps, or a time budget) -------------------
    @property
    def clock(self):  # noqa: ANN201 - a Schedule
        """The schedule whose clock ends this algorithm's rounds (hierarchical: its island's)."""
        return self.schedule

    def round_due(self) -> bool:
        """Whether a round ends after the step just taken."""
        return self.schedule.due(self.inner_steps_done)

    def round_ended(self) -> None:
        """A round just ended: the next period starts now."""
        self.schedule.start_period()

    def step(self, tokens: int) -> StepOutcome:
        self.clip_and_step(self.inner_opt)
        self.inner_steps_done += 1
        self.clock.step_taken()
        self.tokens_since_sync += tokens
        if not self.round_due() and not self._healed_mid_phase():
            return StepOutcome(outer_step=self.outer_step)
        outcome = self.sync()
        self.round_ended()
        return outcome

    def joining_round(self) -> StepOutcome:
        self.tokens_since_sync = 0  # a zero-weight pseudo-gradient: it only receives
        outcome = self.sync_now()
        self.round_ended()
        if outcome.committed:
            healed = self.last_round is not None and self.last_round.healed
            self.inner_steps_done = self.schedule.step_after_join(self.inner_steps_done, healed)
        return outcome

    def count_tokens(self, tokens: int) -> None:
        """Tokens this replica processed where :meth:`step` did not see them (a pipeline stage
        peer steps in its own process, :mod:`farlink.parallel.stage_sync`): they weigh its
        update in the next round."""
        self.tokens_since_sync += tokens

    def sync(self) -> StepOutcome:
        if self.delayed is not None:
            return self.delayed.sync()
        return self.sync_now()

    def sync_now(self) -> StepOutcome:
        """A round that blocks until its average is applied."""
        committed, seconds, info = self.run_round(
            self._pseudo_gradient, self._apply, float(self.tokens_since_sync)
        )
        return self.round_outcome(committed, seconds, info)

    def finish(self) -> StepOutcome | None:
        if self.delayed is None:
            return None
        return self.delayed.finish()

    # --- the delayed outer step's hooks (farlink.sync.delayed) ---------------------------------
    def round_update(self) -> dict:
        """What this worker sends at the end of a phase: Δ from where the phase began, plus a
        failed round's Δ carried over."""
        update = self.pseudo_gradient(self.params, self.delayed.start)
        for n, carried in self._carry.items():
            update[n] = update[n] + carried
        self._carry = {}
        return update

    def own_contribution(self, update: dict) -> dict[str, torch.Tensor]:
        """This worker's dense share of a round (eager's stand-in)."""
        return {n: dense_of(t) for n, t in update.items()}

    def round_failed(self, update: dict) -> None:
        """A delayed round that did not commit: its Δ goes out again with the next round."""
        for n, t in update.items():
            self._carry[n] = self._carry.get(n, 0) + dense_of(t)

    def apply_delayed(self, result: ExchangeResult, info: RoundInfo | None) -> None:
        """The committed outer step with a round's average, one round late."""
        with self.state_lock:
            if self._mixed_state is not None:
                self.load_global_state(self._mixed_state)
                self._mixed_state = None
            self.outer_update(result)

    def reset_local_to(self, start: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for g, p in zip(start, self.params):
                p.copy_(g)

    def _healed_mid_phase(self) -> bool:
        """A delayed round healed this replica while its phase ran: the phase, measured from
        the old state, is dropped now rather than at its end, so the replica rejoins its peers
        at once instead of a phase late (farlink.sync.delayed)."""
        return self.delayed is not None and self._pending_heal is not None

    def adopt_pending_heal(self) -> bool:
        """Load the state a delayed round healed this replica with, if one did (it arrived on
        the round's thread); whether one did."""
        with self.state_lock:
            state, self._pending_heal = self._pending_heal, None
        if state is None:
            return False
        self._load_shared_state(state)
        return True

    def _pseudo_gradient(self, info: RoundInfo) -> dict[str, torch.Tensor]:
        return self.pseudo_gradient(self.params)

    def mixable_state(self) -> TensorState:
        """Moshpit groups (hivemind ``--group-size``): θ_g and the outer optimizer's state.
        Each member computed its Δ from its own θ_g, and the outer step is linear in
        (θ_g, momentum, Δ), so averaging them before the step equals averaging the states the
        members step into."""
        return self.global_state()

    def _apply(self, result: ExchangeResult, info: RoundInfo) -> None:
        if self._mixed_state is not None:  # the group's average committed state (Moshpit)
            self.load_global_state(self._mixed_state)
            self._mixed_state = None
        self.outer_update(result)
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params):
                p.copy_(g)
        self.tokens_since_sync = 0

    # --- state -----------------------------------------------------------------------------
    def shared_state(self) -> TensorState:
        with self.state_lock:
            return self._shared_state()

    def _shared_state(self) -> TensorState:
        state = self.global_state()
        state["counter.outer_step"] = torch.tensor(self.outer_step)
        # where the sender is in the schedule (lr, end of run): a healed peer adopts it. With
        # the outer step delayed, the committed state is that of the round in flight's launch
        step = self.inner_steps_done if self.delayed is None else self.delayed.committed_step()
        if self._joining_round:  # serving in its join round: its place is that round's end
            step = self.schedule.step_after_join(step, healed=False)
        state["schedule.inner_steps"] = torch.tensor(step)
        return state

    def load_shared_state(self, state: TensorState) -> None:
        """With a delayed outer step the heal arrives on the round's thread while the training
        thread runs: it is adopted at the phase's end (the healed round sends nothing)."""
        if self.delayed is not None and threading.current_thread().name.startswith(
                "farlink-outer"):
            with self.state_lock:
                self._pending_heal = state
            return
        self._load_shared_state(state)

    def _load_shared_state(self, state: TensorState) -> None:
        self.load_global_state(state)
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params):
                p.copy_(g)
        self.outer_step = int(state["counter.outer_step"])
        self.inner_steps_done = int(state["schedule.inner_steps"])
        self.tokens_since_sync = 0
        self.rounds_skipped_since_commit = 0  # the sender's count includes the skipped rounds
        self._carry = {}  # a failed delayed round's Δ belongs to the old state

    def state_dict(self) -> TensorState:
        """A consistent cut: with a delayed round in flight, it waits for that round."""
        state, rest = self.state_parts()
        state.update(rest())
        return state

    def checkpoint_parts(self) -> tuple[TensorState, Callable[[], TensorState]]:
        if self.delayed is None or not self.delayed.in_flight():
            return self.state_dict(), nothing_more  # with a subclass's own state_dict
        return self.state_parts()

    def state_parts(self) -> tuple[TensorState, Callable[[], TensorState]]:
        """The state as :meth:`checkpoint_parts` splits it. A delayed round in flight decides
        its own outcome and average, the committed step counter and the codec residuals (its
        encoding rewrites them); the rest is the training thread's and is read now. The second
        part waits for that round, in whichever thread calls it: what it returns is what a
        checkpoint taken after the round landed holds (the training thread only changes those
        at the next phase's end, and the next round starts after the write, ``before_round``)."""
        landed = self.delayed.in_flight_result() if self.delayed is not None else None
        state = super().state_dict()
        state.update(worker_private_state(self, residuals=landed is None))
        state["counter.tokens_since_sync"] = torch.tensor(self.tokens_since_sync)
        state.update({f"carry.{n}": t.clone() for n, t in self._carry.items()})
        if self.delayed is None:
            return state, nothing_more
        delayed = self.delayed
        state.update(delayed.own_state())
        if landed is None:
            state.update(delayed.round_state(delayed.waiting_to_apply()))
            return state, nothing_more
        outer_step, compressor = self.outer_step, self.exchange.compressor

        def rest() -> TensorState:
            finished = landed()
            if finished.committed and finished.info is not None:
                counter = finished.info.round_id + 1  # as run_round sets it on a commit
            else:
                counter = outer_step
            return {**delayed.round_state(finished),
                    "counter.outer_step": torch.tensor(counter),
                    **{k: v.clone() for k, v in compressor.state_dict().items()}}

        return state, rest

    def load_state_dict(self, state: TensorState) -> None:
        super().load_state_dict(state)
        load_worker_private_state(self, state)
        self.tokens_since_sync = int(state["counter.tokens_since_sync"])
        if self.delayed is not None:
            self.delayed.load_state_dict(state)
        self._carry = {n: state[f"carry.{n}"] for n in self.names if f"carry.{n}" in state}


class LocalSGD(DiLoCo):
    """Parameter averaging every H steps: DiLoCo with outer lr 1 and no momentum."""

    name = "local_sgd"

    @classmethod
    def outer_optimizer_of(cls, options: DiLoCoOptions) -> OuterOptimizerFactory:
        return nesterov(1.0, 0.0)  # plain SGD with lr 1: theta <- theta - mean(delta)
