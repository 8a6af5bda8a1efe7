"""Streaming DiLoCo (arXiv 2501.18512): fragments synced in turn, overlapped with compute.

The parameters are split into P fragments (transformer blocks dealt out in a strided way, the
rest spread over fragments by size). Fragment p starts its outer round every H inner steps, at
offset ``shift(p) = p*H/P + H/(2P)``, so rounds are staggered and never coincide with the H
boundaries where checkpoints are taken. A round runs on a background thread: the pseudo-gradient
snapshot is sent while the worker keeps computing; τ (``overlap_steps``) inner steps later the
averaged pseudo-gradient is applied by the outer Nesterov step to the fragment's global copy and
mixed into the local fragment: ``local = α * local + (1 - α) * global`` (α = ``mix_alpha``).
With τ = 0 there is no overlap: the round blocks and its update lands in the step that launched
it, before the next inner step.
Peak bandwidth drops by about P (one fragment in flight instead of the whole model), and the
exposed communication is only what exceeds τ steps of compute.

Time budgets (``round_seconds``): a period lasts that long instead of H steps and fragment p
starts its round at the step boundary nearest the same fraction of it, ``shift(p) / H``; the run
lasts ``steps // H`` periods, counted in rounds launched (every replica launches them in the
same order), so it ends on the same round everywhere whatever each replica's speed.

Knobs (:class:`StreamingOptions`): DiLoCo's, plus ``fragments`` (P), ``overlap_steps`` (τ) and
``mix_alpha`` (α). Capabilities: fragmented rounds, time budgets, any backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from pydantic import Field

from farlink.comm.base import RoundInfo
from farlink.comm.errors import CommError
from farlink.sync.base import Capabilities, StepOutcome, TensorState, load_optimizer_state
from farlink.sync.diloco import DiLoCo, DiLoCoOptions
from farlink.sync.exchange import ExchangeResult

log = logging.getLogger(__name__)


def assign_fragments(names: list[str], sizes: list[int], fragments: int) -> list[int]:
    """Fragment index per parameter: block i goes to fragment i % P, others balance by size."""
    import re

    assignment = [-1] * len(names)
    load = [0] * fragments
    for i, name in enumerate(names):
        match = re.search(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.", name)
        if match:
            assignment[i] = int(match.group(1)) % fragments
            load[assignment[i]] += sizes[i]
    for i in sorted(range(len(names)), key=lambda j: -sizes[j]):
        if assignment[i] < 0:
            target = min(range(fragments), key=lambda f: load[f])
            assignment[i] = target
            load[target] += sizes[i]
    return assignment


def fragment_shift(fragment: int, fragments: int, inner_steps: int) -> int:
    """Inner step (mod H) at which ``fragment`` starts its round."""
    return (fragment * inner_steps) // fragments + max(1, inner_steps // (2 * fragments))


@dataclass
class _InFlight:
    fragment: int
    future: Future
    apply_at: int
    launched: int = 0  # rounds launched by this replica, this one included
    healed: bool = False  # this round healed this replica (its build saw it)


class StreamingOptions(DiLoCoOptions):
    fragments: int = Field(4, ge=1, description="Streaming DiLoCo: number of fragments P")
    overlap_steps: int = Field(5, ge=0, description="Streaming DiLoCo: tau, steps of overlap")
    mix_alpha: float = Field(0.5, ge=0, le=1, description="Streaming DiLoCo: local/global mix")


class StreamingDiLoCo(DiLoCo):
    name = "streaming_diloco"
    Options = StreamingOptions
    capabilities = Capabilities(fragments=True, outer_optimizer=True, sharded=True,
                                time_budget=True, delayed_outer=True)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.num_fragments = min(cfg.fragments, len(self.params))
        # whole parameters' sizes (not this rank's shards): every rank of a replica group
        # assigns alike
        self.fragment_of = assign_fragments(
            self.names, [p.numel() for p in self.module_params], self.num_fragments
        )
        self.shifts = [fragment_shift(f, self.num_fragments, cfg.inner_steps)
                       for f in range(self.num_fragments)]
        self.fragment_tokens = [0] * self.num_fragments
        self.fragment_rounds = [0] * self.num_fragments
        # a period holds one round per fragment, launched in order of their shifts
        self.schedule.rounds_per_period = self.num_fragments
        self.rounds_launched = 0  # on the training thread: what the schedule counts
        self.launched_in_period = 0
        self.period_ended = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="farlink-stream")
        #: rounds launched and not yet landed, in launch order (they run in that order on the
        #: one communication thread); one at a time, unless the outer step is delayed a period
        self._queue: list[_InFlight] = []
        #: inner steps from a fragment's launch to its update's landing: tau, or a whole
        #: period H with --outer-overlap delayed (each fragment's round overlaps the next H
        #: inner steps and lands as the fragment's next round starts)
        self.delay = cfg.inner_steps if cfg.outer_overlap == "delayed" else cfg.overlap_steps
        self._lock = threading.Lock()
        self._pending_heal: TensorState | None = None
        #: several rounds in flight at once (a whole period each): a healed replica takes the
        #: sender's place among them (:meth:`_rejoin`)
        self._period_in_flight = self.delay >= cfg.inner_steps
        #: heals adopted so far: a round launched before the last one belongs to the old state
        self._heals_adopted = 0
        #: the round the communication thread runs now (a heal arriving in it marks it)
        self._running: _InFlight | None = None

    def members(self, fragment: int) -> list[int]:
        return [i for i, f in enumerate(self.fragment_of) if f == fragment]

    def due(self, step: int) -> list[int]:
        """The fragments whose round starts after inner step ``step``: those not yet launched in
        this period whose point (``shift``) the schedule says is reached."""
        return [f for f, s in enumerate(self.shifts)
                if f >= self.launched_in_period and self.schedule.due(step, at=s)]

    # --- the loop ------------------------------------------------------------------------------
    def step(self, tokens: int) -> StepOutcome:
        self._apply_heal()
        self.clip_and_step(self.inner_opt)
        self.inner_steps_done += 1
        self.schedule.step_taken()
        self.fragment_tokens = [t + tokens for t in self.fragment_tokens]
        outcome = StepOutcome(outer_step=self.outer_step)
        t = self.inner_steps_done
        while self._queue and t >= self._queue[0].apply_at:
            if not self._apply_oldest(outcome):
                return outcome  # healed: it stands where the group launched that round
        for fragment in self.due(t):
            # tau too long for the schedule (a round still in flight when the next is due, or
            # this fragment's own with a delayed outer step): wait, stay correct
            while self._queue and (self.delay < self.cfg.inner_steps
                                   or any(r.fragment == fragment for r in self._queue)):
                if not self._apply_oldest(outcome):
                    return outcome
            self._launch(fragment, t)
            if self.delay == 0:  # tau = 0: no overlap, the update lands right now
                self._apply_oldest(outcome)
        self.period_ended = self.schedule.due(t)
        if self.period_ended:
            self.launched_in_period = 0
            self.schedule.start_period()
        return outcome

    # --- the schedule, in rounds launched (the training thread's count) -------------------------
    def rounds_counted(self) -> int:
        return self.rounds_launched

    def rounds_done(self) -> float:
        return self.rounds_launched

    def at_boundary(self, outcome: StepOutcome) -> bool:
        return self.schedule.at_boundary(self.inner_steps_done, self.period_ended)

    def joining_round(self) -> None:
        return None  # fragment rounds are scheduled by step: heal in the first one

    def finish(self) -> StepOutcome | None:
        if not self._queue:
            return None
        outcome = StepOutcome(outer_step=self.outer_step)
        while self._queue:
            self._apply_oldest(outcome)
        return outcome

    def _launch(self, fragment: int, step: int) -> None:
        idx = self.members(fragment)
        snapshot = {self.names[i]: (self.global_params[i] - self.params[i].detach()).clone()
                    for i in idx}
        weight = float(self.fragment_tokens[fragment])
        self.fragment_tokens[fragment] = 0
        self.rounds_launched += 1
        self.launched_in_period += 1

        inflight = _InFlight(fragment, Future(), step + self.delay, self.rounds_launched)
        heals = self._heals_adopted

        def build(info: RoundInfo) -> dict[str, torch.Tensor]:
            if info.healed:
                inflight.healed = True
            if self._period_in_flight and info.world_size > 1:
                agreed = self._round_fragment(inflight.fragment, info)
                if agreed != inflight.fragment:
                    return self._nothing_for(agreed)
            if info.healed:
                return self._nothing_for(inflight.fragment)
            return snapshot

        def run() -> tuple[bool, float, RoundInfo | None, ExchangeResult | None]:
            if self._period_in_flight and (heals != self._heals_adopted
                                           or self._pending_heal is not None):
                # launched before a heal was adopted: its update and its place among the
                # group's rounds are the old state's; it is dropped, not run (farlink.sync.delayed)
                return False, 0.0, None, None
            results: list[ExchangeResult] = []
            self._running = inflight
            # what each try's quorum compares (:meth:`_round_fragment`): the fragment the round
            # carries then (a heal between tries may have named the group's)
            tag = (lambda: str(inflight.fragment)) if self._period_in_flight else None
            try:
                committed, seconds, info = self.run_round(
                    build, lambda result, info: results.append(result), weight, tag=tag
                )
            finally:
                self._running = None
            return committed, seconds, info, results[0] if results else None

        inflight.future = self._executor.submit(run)
        self._queue.append(inflight)

    def _round_fragment(self, fragment: int, info: RoundInfo) -> int:
        """The fragment this round carries, as its members agree (``fragment``: this
        replica's). With rounds in flight for a period, a member left out of a round that then
        failed on the others meets their next fragment's round at the same round id; summing
        one fragment with another would abort in Gloo (other sizes) or mix unlike tensors. So
        the members compare fragments first: if they differ, every member fails the round (all
        see the same list), sends zeros of the fragment most members hold (ties: the lowest),
        so no collective meets tensors of another size, and a member that held another one
        steps its committed round back by one: the round's retry, or the next round, heals it
        from a member at the group's round, whose state names that fragment. The fragments
        travel in the quorum's own announcements (``begin_round(tag=...)``, ``RoundInfo.tags``: no extra
        round trip); a backend that does not carry them (hivemind) is not checked."""
        held = [f for f in map(self._fragment_named, info.tags or []) if f is not None]
        if len(set(held)) <= 1:
            return fragment
        counts = Counter(held)
        agreed = min(counts, key=lambda f: (-counts[f], f))
        self.collective.fail_round(CommError(
            f"round {info.round_id}: its members hold the rounds of fragments {held} (a member "
            f"left out of a failed round meets the next one); the round fails and the members "
            f"not at fragment {agreed} heal from the others"))
        if fragment != agreed:
            self.collective.load_committed_step(max(0, info.round_id - 1))
        return agreed

    def _fragment_named(self, tag: str | None) -> int | None:
        """The fragment a member's tag names; None for no tag or one that names no fragment of
        this run (a peer's announcement is its word: garbage is left out of the comparison, never
        raised in the round's thread nor turned into zeros of a fragment that does not exist)."""
        if tag is None or not tag.isdigit() or int(tag) >= len(self.shifts):
            return None
        return int(tag)

    def _nothing_for(self, fragment: int) -> dict[str, torch.Tensor]:
        """A healed replica's update: zeros, for the fragment the group's round carries (with
        rounds in flight for a period, the heal named it: :meth:`load_shared_state` put it in
        the round, since this replica's own may be another)."""
        return {self.names[i]: torch.zeros_like(self.global_params[i])
                for i in self.members(fragment)}

    def _apply_oldest(self, outcome: StepOutcome) -> bool:
        """Wait for the oldest round in flight and apply it; False (nothing applied) when it
        healed this replica under a delayed outer step: it rejoined the group instead."""
        start = time.perf_counter()
        committed, _, info, result = self._queue[0].future.result()
        if self._period_in_flight and self._apply_heal():
            return False
        with self.state_lock:  # a peer healing from this replica reads θ and the queue at once
            inflight = self._queue.pop(0)
            self._land(inflight, outcome, start, committed, info, result)
        return True

    def _land(self, inflight: _InFlight, outcome: StepOutcome, start: float, committed: bool,
              info: RoundInfo | None, result: ExchangeResult | None) -> None:
        waited = time.perf_counter() - start
        outcome.comm_seconds += waited  # only the exposed wait
        self.schedule.pause(waited)
        outcome.synced = True
        outcome.committed = committed
        outcome.world_size = info.world_size if info else 1
        if self.last_exchange is not None:
            outcome.rejected = len(self.last_exchange.rejected)
        if not self._period_in_flight:  # (else adopted before the round landed)
            self._apply_heal(inflight.fragment)
        if committed and result is not None:
            self._apply_fragment(inflight.fragment, result)
            self.fragment_rounds[inflight.fragment] += 1
        outcome.outer_step = self.outer_step

    def _apply_fragment(self, fragment: int, result: ExchangeResult) -> None:
        idx = self.members(fragment)
        alpha = self.cfg.mix_alpha
        self._outer_step_of(fragment, result, self.global_params, self.outer_opt)
        with torch.no_grad():
            for i in idx:
                self.params[i].mul_(alpha).add_(self.global_params[i], alpha=1 - alpha)

    def _outer_step_of(self, fragment: int, result: ExchangeResult, params: list[torch.Tensor],
                       opt: torch.optim.Optimizer) -> None:
        """The outer step of ``fragment`` with its round's average, on ``params`` (θ or a copy)."""
        if result.total_weight <= 0:
            return
        for i in self.members(fragment):
            params[i].grad = result.tensors[self.names[i]].to(torch.float32)
        opt.step()  # params without a grad (other fragments) are skipped
        opt.zero_grad(set_to_none=True)

    # --- state ---------------------------------------------------------------------------------
    def shared_state(self) -> TensorState:
        with self.state_lock:
            state = super().shared_state()
            # where the sender is in the run's rounds (a time budget counts them): a healed
            # peer adopts it
            state["schedule.rounds_launched"] = torch.tensor(self.rounds_launched)
            if self._period_in_flight:
                state.update(self._rounds_in_flight(state))
        return state

    def _rounds_in_flight(self, state: TensorState) -> TensorState:
        """With rounds in flight for a period, θ lacks the rounds that landed and wait for
        their step (the training thread applies each at its step, concurrently with the round
        being run), and that round (the one a peer heals in) is one of several. The committed
        state of round k is θ with every round before k applied, whatever this replica's
        training thread has applied so far: the landed rounds are applied here, to copies, so
        every member at round k announces one fingerprint and serves the state it announced
        (torchft fetches it later in the round, after more may have been applied). Under
        ``schedule.``: the running round's fragment and launch (step, rounds launched), where
        the healed peer takes its place among the rounds in flight."""
        queue = list(self._queue)
        running = next((i for i, r in enumerate(queue) if not r.future.done()), len(queue))
        landed = [(r.fragment, r.future.result()) for r in queue[:running]]
        landed = [(fragment, result) for fragment, (committed, _, _, result) in landed
                  if committed and result is not None]
        if landed:
            params = [state[f"global.{n}"] for n in self.names]  # copies already
            opt = self.make_outer_optimizer(params)
            load_optimizer_state(opt, state, "outer")
            for fragment, result in landed:
                self._outer_step_of(fragment, result, params, opt)
            state.update(self.global_state(params, opt))
        if running == len(queue):
            return state
        now = queue[running]
        return {**state, "schedule.fragment": torch.tensor(now.fragment),
                "schedule.inner_steps": torch.tensor(now.apply_at - self.delay),
                "schedule.rounds_launched": torch.tensor(now.launched)}

    def load_shared_state(self, state: TensorState) -> None:
        """Healing may arrive on the communication thread: defer it to the training thread."""
        if threading.current_thread() is threading.main_thread():
            self._adopt(state)
            return
        with self._lock:
            running = self._running
            if self._period_in_flight and running is not None:
                # the round this replica heals in is the group's round of the fragment the
                # sender names: marked before the training thread can see the heal, so its
                # build sends zeros of that fragment and the rejoin finds it (farlink's heal
                # arrives between quorum and build, on this thread)
                running.healed = True
                running.fragment = int(state.get("schedule.fragment", running.fragment))
            self._pending_heal = state

    def _apply_heal(self, fragment: int | None = None) -> bool:
        """Adopt a state that arrived during the round of ``fragment`` (default: the one in
        flight): the sender stood at that round of its period, as this replica does now.
        Whether one was adopted."""
        with self._lock:
            state, self._pending_heal = self._pending_heal, None
        if state is None:
            return False
        if self._period_in_flight:
            self._rejoin(state)
            return True
        self._adopt(state)
        if fragment is None and self._queue:
            fragment = self._queue[0].fragment
        if fragment is not None:
            self.launched_in_period = fragment + 1
        return True

    def _rejoin(self, state: TensorState) -> None:
        """Healed with rounds in flight for a period (--outer-overlap delayed; the lagging
        worker of farlink.sync.delayed): stand where the sender launched the round this
        replica healed in. θ (with the rounds that had landed there already applied:
        :meth:`_rounds_in_flight`), the counters and that round's fragment and launch are the
        sender's; the healing round is applied at the sender's step, as that fragment's; this
        replica's other rounds belong to its old state and are dropped (those not yet run skip
        their round)."""
        healing = next((r for r in self._queue if r.healed), None)
        self._heals_adopted += 1
        with self.state_lock:
            self._adopt(state)
        queue = []
        if healing is not None and "schedule.fragment" in state:
            healing.apply_at = self.inner_steps_done + self.delay
            queue.append(healing)
            if healing.future.done():  # its commit counts (the sender's counter preceded it)
                committed, _, info, _ = healing.future.result()
                if committed and info is not None:
                    self.outer_step = info.round_id + 1
            self.launched_in_period = healing.fragment + 1
        self._queue = queue
        # as the sender's step that launched it ends: a fragment due at the period's end
        # closes the period
        self.period_ended = self.schedule.due(self.inner_steps_done)
        if self.period_ended:
            self.launched_in_period = 0
            self.schedule.start_period()
        log.warning("healed in round %d: its peers went on without this replica (it reached a "
                    "round's quorum later than the Lighthouse's join timeout)", self.outer_step)

    def _adopt(self, state: TensorState) -> None:
        DiLoCo.load_shared_state(self, state)
        self.fragment_tokens = [0] * self.num_fragments
        self.rounds_launched = int(state.get("schedule.rounds_launched",
                                             torch.tensor(self.rounds_launched)))

    def state_dict(self) -> TensorState:
        while self._queue:  # land them so the checkpoint is a consistent cut
            self._apply_oldest(StepOutcome())
        state = super().state_dict()
        state["counter.fragment_tokens"] = torch.tensor(self.fragment_tokens)
        return state

    def load_state_dict(self, state: TensorState) -> None:
        super().load_state_dict(state)
        self.fragment_tokens = [int(t) for t in state["counter.fragment_tokens"]]
        self.launched_in_period = 0  # a checkpoint is taken at a period's end
