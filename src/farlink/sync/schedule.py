"""When a round-based algorithm's rounds fall and when its run ends: every H inner steps
(:class:`StepSchedule`) or every ``round_seconds`` of training (:class:`TimeBudget`).

Every round-based algorithm (DiLoCo, local SGD, Streaming DiLoCo, SparseLoCo, hierarchical
DiLoCo) asks its schedule instead of branching on the kind of run, so a time budget works for
each of them as soon as it works for one. A schedule splits the run into *periods* (one outer
round of DiLoCo, one pass over every fragment of Streaming DiLoCo, one island round of
hierarchical DiLoCo) and answers whether the step just taken reaches a point of the current
period (``at`` inner steps into it: its end, or a fragment's offset); a time budget maps that
point to the same fraction of ``round_seconds``.

The counters (inner steps taken, rounds counted) stay with the algorithm, which checkpoints and
heals them; a schedule holds only its clock, which a resumed or healed replica restarts.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable


def _own(flag: bool) -> bool:
    """One process is the whole replica: its own decision stands."""
    return flag


def nearest_step_boundary(now: float, started: float, steps: int, deadline: float) -> bool:
    """Whether a time-budgeted round should end after the step just taken: at the step boundary
    nearest ``deadline``. Ending at the first boundary past it makes a worker with long steps
    (a slow device) overshoot by up to a whole step while every other worker waits for it;
    the nearest boundary bounds it to half a step either way. A step's length is this round's
    mean (``steps`` taken since ``started``)."""
    per_step = (now - started) / max(steps, 1)
    return now + per_step / 2 >= deadline


class Schedule(ABC):
    """The cadence of rounds and the run's length. ``inner_steps`` is H, the period in steps
    (and, under a time budget, the unit of ``at`` in :meth:`due`); ``steps`` the run's budget
    in inner steps (None: no end); ``rounds_per_period`` how many rounds one period holds (a
    Streaming DiLoCo period holds one per fragment)."""

    timed: bool = False

    def __init__(self, inner_steps: int, steps: int | None, rounds_per_period: int = 1) -> None:
        self.inner_steps = inner_steps
        self.steps = steps
        self.rounds_per_period = rounds_per_period
        #: periods in the run (at least one): a time budget counts them instead of steps
        self.total_periods = max(1, (steps or 0) // inner_steps)
        self.start_period()

    # --- the clock (a time budget's; a step schedule keeps it and never reads it) ----------------
    def start_period(self) -> None:
        """A period begins now (after a round ended, or at the start of the run)."""
        self.period_started = time.monotonic()
        self.restart_clock()

    def restart_clock(self) -> None:
        """A round that blocked has just ended: a step's length is measured from here, so the
        time spent in the round does not count as a long step."""
        self.clock_started = time.monotonic()
        self.steps_since_clock = 0

    def pause(self, seconds: float) -> None:
        """The replica waited ``seconds`` for its peers outside a round that restarts the
        period (Streaming DiLoCo's exposed wait for a fragment's round): the period's deadlines
        and the step-length clock move on by as much, so waiting is not taken for training."""
        self.period_started += seconds
        self.clock_started += seconds

    def step_taken(self) -> None:
        self.steps_since_clock += 1

    # --- the cadence -----------------------------------------------------------------------------
    @abstractmethod
    def due(self, step: int, at: int | None = None) -> bool:
        """Whether the ``step``-th inner step, just taken, reaches the point ``at`` inner steps
        into the current period (default: its end, H)."""

    @abstractmethod
    def finished(self, step: int, rounds: int) -> bool:
        """Whether the run's budget is spent after ``step`` inner steps and ``rounds`` rounds
        counted (committed, or skipped since the last commit)."""

    @abstractmethod
    def last_round_due(self, step: int, rounds: int) -> bool:
        """Whether the round about to run is the run's last (every live peer forms it)."""

    @abstractmethod
    def next_round_is_last(self, step: int, rounds: int) -> bool:
        """Whether the round after the one just done is the run's last."""

    @abstractmethod
    def periods_of(self, inner: Schedule) -> int:
        """How many periods of ``inner`` (a finer cadence of the same kind, e.g. hierarchical
        DiLoCo's island rounds) one period of this schedule holds."""

    @abstractmethod
    def last_period(self, step: int, periods: int) -> bool:
        """Whether the period ending now is the run's last (``periods`` done before it)."""

    @abstractmethod
    def step_after_join(self, step: int, healed: bool) -> int:
        """Where a replica that joined in a committed round stands in the run, in inner steps:
        ``step`` is where it stood when the round began (a healed one: its source's place)."""

    @abstractmethod
    def lr_step(self, step: int, rounds: float) -> int:
        """The inner step the lr schedule (warmup + cosine over ``steps``) reads: the step
        itself, or under a time budget the share of the run's rounds behind."""

    @abstractmethod
    def at_boundary(self, step: int, period_ended: bool) -> bool:
        """Whether the loop should checkpoint and evaluate after this step."""


class StepSchedule(Schedule):
    """A round every H inner steps; the run lasts ``steps`` inner steps."""

    def due(self, step: int, at: int | None = None) -> bool:
        at = self.inner_steps if at is None else at
        return step % self.inner_steps == at % self.inner_steps

    def finished(self, step: int, rounds: int) -> bool:
        return self.steps is not None and step >= self.steps

    def last_round_due(self, step: int, rounds: int) -> bool:
        return self.finished(step, rounds)

    def next_round_is_last(self, step: int, rounds: int) -> bool:
        return self.steps is not None and step + self.inner_steps >= self.steps

    def periods_of(self, inner: Schedule) -> int:
        return self.inner_steps // inner.inner_steps

    def last_period(self, step: int, periods: int) -> bool:
        return step + self.inner_steps > self.steps

    def step_after_join(self, step: int, healed: bool) -> int:
        # A peer restarted from its own checkpoint is not healed when the others wait in the
        # same round (its checkpoint holds their last commit); it skips that round's inner
        # steps, so its schedule moves by one round, or it finishes one round after everyone
        # else. Counted from its own step, not from its outer steps: after a round every member
        # gave up, the members stand a round further than their outer steps say. A healed
        # peer took its source's place, which is already the round's end.
        return step if healed else step + self.inner_steps

    def lr_step(self, step: int, rounds: float) -> int:
        return step

    def at_boundary(self, step: int, period_ended: bool) -> bool:
        return step % self.inner_steps == 0


class TimeBudget(Schedule):
    """Rounds of ``round_seconds`` each, for devices of different speeds: every worker runs as many
    inner steps as fit and ends at the step boundary nearest the deadline; the run lasts ``steps //
    inner_steps`` periods. ``agree`` makes the ranks of a replica group (each reading its own
    clock) take one decision: True on all of them if on any."""

    timed = True

    def __init__(self, inner_steps: int, steps: int | None, round_seconds: float,
                 agree: Callable[[bool], bool] | None = None, rounds_per_period: int = 1) -> None:
        if steps is None:
            raise ValueError("round_seconds (time-budgeted rounds) needs steps: the run lasts "
                             "steps / inner_steps rounds")
        self.round_seconds = round_seconds
        self.agree = agree or _own
        super().__init__(inner_steps, steps, rounds_per_period)

    @property
    def total_rounds(self) -> int:
        return self.total_periods * self.rounds_per_period

    def due(self, step: int, at: int | None = None) -> bool:
        at = self.inner_steps if at is None else at
        deadline = self.period_started + self.round_seconds * at / self.inner_steps
        return self.agree(nearest_step_boundary(time.monotonic(), self.clock_started,
                                                self.steps_since_clock, deadline))

    def finished(self, step: int, rounds: int) -> bool:
        return rounds >= self.total_rounds

    def last_round_due(self, step: int, rounds: int) -> bool:
        return rounds + 1 >= self.total_rounds

    def next_round_is_last(self, step: int, rounds: int) -> bool:
        return rounds + 2 >= self.total_rounds

    def periods_of(self, inner: Schedule) -> int:
        return max(1, round(self.round_seconds / inner.round_seconds))

    def last_period(self, step: int, periods: int) -> bool:
        return periods + 1 >= self.total_periods

    def step_after_join(self, step: int, healed: bool) -> int:
        return step  # a time budget counts rounds, not steps

    def lr_step(self, step: int, rounds: float) -> int:
        return int(rounds / self.total_rounds * self.steps)

    def at_boundary(self, step: int, period_ended: bool) -> bool:
        return period_ended


def make_schedule(inner_steps: int, steps: int | None, round_seconds: float | None = None,
                  agree: Callable[[bool], bool] | None = None,
                  rounds_per_period: int = 1) -> Schedule:
    """A time budget when ``round_seconds`` is given, else a round every ``inner_steps``."""
    if round_seconds is None:
        return StepSchedule(inner_steps, steps, rounds_per_period)
    return TimeBudget(inner_steps, steps, round_seconds, agree, rounds_per_period)
