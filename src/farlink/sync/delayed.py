"""The outer step off the critical path: round r's exchange runs while round r+1 computes.

DiLoCo's round blocks every worker until the pseudo-gradients are averaged; on a slow link the
workers idle for the whole transfer. With ``outer_overlap`` the round's exchange runs on a
background thread and its averaged update is applied one round later (the one-step delay of
DiLoCoX, arXiv 2506.21263, and of PCCL's async DiLoCo; the "naive delayed outer gradients" of
arXiv 2502.12996). With M workers, θ the committed (agreed) parameters and ``Opt`` the outer
optimizer, at the end of inner phase t worker m:

1. computes Δ_m^t = start^t - θ_m^t, how far it moved from where phase t began, and hands it
   to the exchange on the background thread (the round's quorum, bytes and commit run there);
2. waits for the round launched one phase earlier (it ran while phase t computed) and applies
   its average: θ^t = Opt(θ^(t-1), Δ^(t-1)) (no update after phase 1: nothing has landed);
3. starts phase t+1 from ``start^(t+1)``:

   * ``delayed``: θ^t itself, the same on every replica;
   * ``eager`` (arXiv 2502.12996): its own copy of the outer state, stepped with
     Δ̃_m^t = Δ^(t-1) + (Δ_m^t - Δ_m^(t-1)) / M: the delayed average with this worker's share
     of it replaced by its fresh pseudo-gradient, the stand-in for the average not yet known
     (M: the last round's participants; 0 before any round was seen, so phase 1 adds none).
     That copy differs a little between replicas, so it is this worker's private state; the
     committed θ stays the delayed one, equal everywhere (a newcomer heals from it).

The run's last round lands in :meth:`finish`, so every round's average is applied once, and the
replicas end on the committed θ. A round that fails is carried into the next one (its Δ is added
to the next round's, or its sparse values go back into SparseLoCo's error feedback), so no work
is lost, as with a failed round of the blocking step.

Nobody waits for a slow worker at a phase's end any more, so it may reach round r's quorum up
to a phase after the others; past the Lighthouse's join timeout the quorum leaves it out and it
heals in a later round k. The state it heals from is a peer's with round k in flight: θ before
round k, the outer step counter k and the inner step at which round k was launched
(:meth:`committed_step`). At its next inner step the healed worker lands round k, loads that
state (its phase so far, measured from its old state, is dropped) and stands where its peers
stand at the end of the phase after round k's launch: it applies round k's average, moves its
step counter to that phase's end and launches round k+1 with nothing of its own (zero weight),
as they launch theirs; if the run ends before that phase does, it only applies round k. So it
applies every round once, launches the rounds its peers launch, and ends on their committed θ.

This module holds the pipeline; the algorithm says what a round sends (``round_update``), which
dense tensor is this worker's share (``own_contribution``) and how a failed round is taken back
(``round_failed``). Time-budgeted rounds are refused with it (the schedule counts committed
rounds, which land one round late).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from farlink import interrupt
from farlink.comm.base import RoundInfo
from farlink.sync.base import StepOutcome, TensorState, load_optimizer_state, optimizer_state
from farlink.sync.exchange import ExchangeResult, dense_of

if TYPE_CHECKING:
    from farlink.sync.diloco import DiLoCo

log = logging.getLogger(__name__)

MODES = ("none", "delayed", "eager")


@dataclass
class _Finished:
    """A finished round, waiting to be applied at the next phase's end."""

    committed: bool
    info: RoundInfo | None
    result: ExchangeResult | None
    update: dict  # what this worker sent (to take back if the round failed)


class DelayedOuterStep:
    """One round in flight on a background thread; its average is applied a round later."""

    def __init__(self, algo: DiLoCo, eager: bool) -> None:
        self.algo = algo
        self.eager = eager
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="farlink-outer")
        self._future: Future | None = None
        self._update: dict | None = None  # the in-flight round's update
        self._finished: _Finished | None = None  # waited for (a checkpoint), not yet applied
        self._launched_at: int | None = None  # the inner step of the round in flight's launch
        self.members = 0  # M: participants of the last round seen
        if eager:
            self.params = [g.detach().clone() for g in algo.global_params]
            self.opt = algo.make_outer_optimizer(self.params)
            self.own_prev: dict[str, torch.Tensor] = {}

    # --- where a phase starts ------------------------------------------------------------------
    @property
    def start(self) -> list[torch.Tensor]:
        """The parameters the current inner phase began from (Δ is measured against them)."""
        return self.params if self.eager else self.algo.global_params

    def in_flight(self) -> bool:
        return self._future is not None

    def committed_step(self) -> int:
        """The inner step the committed state stands at: the one at which the round in flight
        was launched (the committed θ has every round before it applied; the training thread
        has gone on since), or the current one when no round is in flight. A peer healing from
        this replica places itself by it."""
        if self._launched_at is not None:
            return self._launched_at
        return self.algo.inner_steps_done

    # --- the pipeline --------------------------------------------------------------------------
    def sync(self) -> StepOutcome:
        """End of an inner phase: launch its round, apply the one launched a phase ago. Also
        called as soon as that round healed this replica (mid-phase): it rejoins its peers."""
        algo = self.algo
        outcome = StepOutcome(outer_step=algo.outer_step)
        finished = self._wait(outcome)
        if algo.adopt_pending_heal():
            self._rejoin(finished)
        else:
            update = algo.round_update()
            weight = float(algo.tokens_since_sync)
            algo.tokens_since_sync = 0
            self._apply(finished, update)
            self._launch(update, weight)
        outcome.synced = True
        outcome.outer_step = algo.outer_step
        return outcome

    def finish(self) -> StepOutcome | None:
        """Land the run's last round and end every replica on the committed parameters."""
        if self._future is None and self._finished is None:
            return None
        outcome = StepOutcome(outer_step=self.algo.outer_step)
        finished = self._wait(outcome)
        if self.algo.adopt_pending_heal():
            finished = self._healed_in(finished)
        self._apply_committed(finished)
        if self.eager:
            self._restart_eager()
        self.algo.reset_local_to(self.algo.global_params)
        outcome.synced = True
        outcome.outer_step = self.algo.outer_step
        return outcome

    def _launch(self, update: dict, weight: float) -> None:
        algo = self.algo

        def build(info: RoundInfo) -> dict:
            if info.healed:  # a healed worker's Δ belongs to its old state: send nothing
                return {n: torch.zeros_like(dense_of(t)) for n, t in update.items()}
            return update

        def run() -> tuple[bool, RoundInfo | None, ExchangeResult | None]:
            results: list[ExchangeResult] = []
            committed, _, info = algo.run_round(build, lambda r, i: results.append(r), weight,
                                                before=False)
            return committed, info, results[0] if results else None

        # the last checkpoint write lands first, here: it waits for the round before this one
        # (landed already). In the round's own thread it could meet the write of this very
        # round's boundary, submitted meanwhile, which waits for this round: a deadlock.
        if algo.before_round is not None:
            algo.before_round()
        self._update = update
        self._launched_at = algo.inner_steps_done
        self._future = self._executor.submit(run)

    def _wait(self, outcome: StepOutcome) -> _Finished | None:
        """The round launched a phase ago, once done; the seconds waited are exposed time."""
        if self._finished is not None:
            finished, self._finished = self._finished, None
            return finished
        if self._future is None:
            return None
        began = time.perf_counter()
        # a worker's Ctrl-C only sets the stop flag: a plain result() would sleep through it
        committed, info, result = interrupt.wait_future(
            self._future, float("inf"),
            lambda: f"the delayed round of outer step {self.algo.outer_step}", log)
        waited = time.perf_counter() - began
        self._future = self._launched_at = None
        outcome.comm_seconds += waited
        self.algo.schedule.pause(waited)
        outcome.committed = committed
        outcome.world_size = info.world_size if info else 1
        self.members = self._members_after(info)
        return _Finished(committed, info, result, self._update)

    def _members_after(self, info: RoundInfo | None) -> int:
        """M once a round has landed: its quorum's size, or the last one if it had none."""
        return info.world_size if info is not None and info.world_size > 0 else self.members

    def _apply_committed(self, finished: _Finished | None) -> bool:
        """θ^t = Opt(θ^(t-1), Δ^(t-1)) if that round committed; a failed one is carried."""
        if finished is None:
            return False
        if finished.committed and finished.result is not None:
            self.algo.apply_delayed(finished.result, finished.info)
            return True
        self.algo.round_failed(finished.update)
        return False

    def _apply(self, finished: _Finished | None, update: dict) -> None:
        algo = self.algo
        committed = self._apply_committed(finished)
        if self.eager:
            own = algo.own_contribution(update)
            share = 1.0 / self.members if self.members else 0.0
            stand_in = {}
            for n in algo.names:
                g = own[n] * share
                if n in self.own_prev:
                    g = g - self.own_prev[n] * share
                if committed and finished.result.total_weight > 0:
                    g = finished.result.tensors[n].to(g.dtype) + g
                stand_in[n] = g
            for n, p in zip(algo.names, self.params):
                p.grad = stand_in[n].to(p.dtype)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if share:  # before any round was seen no stand-in was added: none to take back
                self.own_prev = own
        algo.reset_local_to(self.start)

    # --- a consistent cut for checkpoints ------------------------------------------------------
    def in_flight_result(self) -> Callable[[], _Finished] | None:
        """The round in flight as a function that waits for it (in the caller's thread: a
        background checkpoint write) and returns it, leaving it in the pipeline, where the
        phase's end still applies it; None when no round is in flight."""
        future, update = self._future, self._update
        if future is None:
            return None
        step = self.algo.outer_step

        def landed() -> _Finished:
            committed, info, result = interrupt.wait_future(
                future, float("inf"), lambda: f"the delayed round of outer step {step}", log)
            return _Finished(committed, info, result, update)

        return landed

    def waiting_to_apply(self) -> _Finished | None:
        """A finished round not yet applied (one restored from a checkpoint), if any."""
        return self._finished

    def round_state(self, finished: _Finished | None) -> TensorState:
        """What a checkpoint keeps of the round to be applied at the phase's end: whether it
        committed, its average, what this worker sent (taken back if it failed), and M."""
        state: TensorState = {}
        members = self._members_after(finished.info) if finished is not None else self.members
        if finished is not None:
            state["delayed.committed"] = torch.tensor(int(finished.committed
                                                          and finished.result is not None))
            state["delayed.weight"] = torch.tensor(
                finished.result.total_weight if finished.result is not None else 0.0)
            if finished.result is not None:
                state.update({f"delayed.avg.{n}": t.clone()
                              for n, t in finished.result.tensors.items()})
            state.update({f"delayed.sent.{n}": dense_of(t).clone()
                          for n, t in finished.update.items()})
        state["delayed.members"] = torch.tensor(members)
        return state

    def own_state(self) -> TensorState:
        """The eager copy of the outer state (the training thread's: read at once)."""
        if not self.eager:
            return {}
        state = {f"eager.{n}": p.detach().clone() for n, p in zip(self.algo.names, self.params)}
        state.update(optimizer_state(self.opt, "eager_outer"))
        state.update({f"eager_own.{n}": t.clone() for n, t in self.own_prev.items()})
        return state

    def load_state_dict(self, state: TensorState) -> None:
        self.members = int(state.get("delayed.members", torch.tensor(0)))
        self._finished = None
        if "delayed.committed" in state:
            names = self.algo.names
            result = ExchangeResult({n: state[f"delayed.avg.{n}"] for n in names
                                     if f"delayed.avg.{n}" in state},
                                    float(state["delayed.weight"]))
            sent = {n: state[f"delayed.sent.{n}"] for n in names}
            self._finished = _Finished(bool(int(state["delayed.committed"])), None,
                                   result if result.tensors else None, sent)
        if self.eager:
            with torch.no_grad():
                for n, p in zip(self.algo.names, self.params):
                    p.copy_(state[f"eager.{n}"])
            load_optimizer_state(self.opt, state, "eager_outer")
            self.own_prev = {n: state[f"eager_own.{n}"] for n in self.algo.names
                             if f"eager_own.{n}" in state}

    def _restart_eager(self) -> None:
        """The eager copy of the outer state starts again from the committed state."""
        with torch.no_grad():
            for e, g in zip(self.params, self.algo.global_params):
                e.copy_(g)
        self.opt = self.algo.make_outer_optimizer(self.params)
        self.own_prev = {}

    def _rejoin(self, finished: _Finished | None) -> None:
        """This replica was healed in the round that just landed (k): stand where the peers
        stand at the end of the phase after round k's launch. Round k's average is applied, the
        phase starts from the committed θ, and round k+1 is launched with nothing of this
        replica's in it (zero weight: its phase was measured from the old state), unless the
        run ends before that phase does."""
        algo = self.algo
        log.warning("healed in round %d: its peers went on without this replica (it reached a "
                    "round's quorum later than the Lighthouse's join timeout). With the outer "
                    "step delayed a worker may lag its peers by up to a phase: a join timeout "
                    "above the slowest worker's phase keeps it in", algo.outer_step)
        self._apply_committed(self._healed_in(finished))
        if self.eager:
            self._restart_eager()
        algo.reset_local_to(self.start)
        steps = algo.schedule.steps
        algo.inner_steps_done += algo.schedule.inner_steps
        if steps is not None and algo.inner_steps_done > steps:  # round k was the run's last
            algo.inner_steps_done = max(steps, algo.inner_steps_done - algo.schedule.inner_steps)
            return
        algo.tokens_since_sync = 0
        self._launch({n: torch.zeros_like(p) for n, p in zip(algo.names, algo.params)}, 0.0)

    def _healed_in(self, finished: _Finished | None) -> _Finished | None:
        """The round that just landed healed this replica (the state it carried is loaded:
        θ before that round, the counters where its sender launched it). That round sent
        nothing of this replica's (its Δ belonged to the old state): a failure carries nothing
        back. Its commit counts, as on the peers (loading the sender's counter took it back)."""
        if finished is not None:
            finished = replace(finished, update={n: torch.zeros_like(dense_of(t))
                                                 for n, t in finished.update.items()})
            if finished.committed and finished.info is not None:
                self.algo.outer_step = finished.info.round_id + 1
        return finished
