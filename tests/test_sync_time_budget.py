"""Time budgets (``round_seconds``) for every round-based algorithm, through the one
:class:`~farlink.sync.schedule.Schedule` they share: replicas of different speeds as threads on an
in-process group, each running as many inner steps as fit in a round; every round takes every
replica, the run ends on one committed model everywhere, and that model learns."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from farlink.codecs import make_compressor
from farlink.comm.inprocess import InProcessGroup
from farlink.compose import wire
from farlink.config import RunConfig
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange
from farlink.sync.schedule import StepSchedule, TimeBudget

TARGET = torch.randn(8, 8, generator=torch.Generator().manual_seed(7)) / 3
PACE = (0.002, 0.002, 0.05)  # seconds slept per step: the third replica is slower by 0.048 s a
# step, which keeps it the slowest however much the load slows every step's own compute
OPTIONS = {"streaming_diloco": {"fragments": 2, "overlap_steps": 1},
           "sparseloco": {"sparseloco_chunk": 16, "sparseloco_topk": 8}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x @ TARGET).pow(2).mean()


def _held_out(model: nn.Module) -> float:
    with torch.no_grad():
        return float(_loss(model, torch.randn(256, 8, generator=torch.Generator().manual_seed(99))))


@pytest.mark.parametrize("algorithm", ["streaming_diloco", "sparseloco"])
def test_a_time_budget_is_accepted_where_the_schedule_runs_it(algorithm: str) -> None:
    cfg = RunConfig(algorithm=algorithm, round_seconds=0.5, steps=40, inner_steps=10)
    assert cfg.round_seconds == 0.5
    model = _model()
    collective = InProcessGroup(1).member(0)
    cls = algorithm_class(algorithm)
    algo = cls(model, cfg, collective, Exchange(collective, sender="w", **wire(cls, cfg, "none")))
    assert isinstance(algo.schedule, TimeBudget)
    untimed = RunConfig(algorithm=algorithm, steps=40, inner_steps=10)
    assert isinstance(cls(_model(), untimed, collective, Exchange(
        collective, sender="v", **wire(cls, untimed, "none"))).schedule, StepSchedule)


@pytest.mark.parametrize("algorithm", ["streaming_diloco", "sparseloco", "diloco"])
def test_a_time_budgeted_run_ends_on_one_model_that_learned(algorithm: str) -> None:
    inner_steps, rounds = 10, 4
    cfg = RunConfig(algorithm=algorithm, round_seconds=0.3, steps=rounds * inner_steps,
                    inner_steps=inner_steps, warmup_steps=0, lr=0.02,
                    **OPTIONS.get(algorithm, {}))
    init_lock = threading.Lock()
    before = _held_out(_model())

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        with init_lock:  # the global RNG is shared by threads: seed and build at once
            model = _model()
        cls = algorithm_class(algorithm)
        algo = cls(model, cfg, collective, Exchange(
            collective, sender=f"w{rank}", **wire(cls, cfg, "none")))
        gen = torch.Generator().manual_seed(rank + 1)
        steps_per_round, outcomes = [0], []
        while not algo.finished():
            _loss(model, torch.randn(16, 8, generator=gen)).backward()
            time.sleep(PACE[rank])
            outcome = algo.step(16)
            steps_per_round[-1] += 1
            if outcome.synced:
                outcomes.append(outcome)
                steps_per_round.append(0)
        last = algo.finish()
        if last is not None:
            outcomes.append(last)
        with torch.no_grad():  # the committed model (Streaming DiLoCo's local copy mixes in
            for p, g in zip(algo.params, algo.global_params):  # its latest local progress)
                p.copy_(g)
        return algo.fingerprint(), algo.inner_steps_done, outcomes, _held_out(model)

    results = InProcessGroup(3).run(member, timeout=120)
    fingerprints = {fp for fp, _, _, _ in results}
    assert len(fingerprints) == 1, fingerprints  # one committed model on every replica
    expected_rounds = rounds * (cfg.fragments if algorithm == "streaming_diloco" else 1)
    for _, _, outcomes, _ in results:
        assert len(outcomes) == expected_rounds
        assert all(o.committed and o.world_size == 3 for o in outcomes)
    steps = [s for _, s, _, _ in results]
    assert steps[2] < 0.6 * steps[0], steps  # the slow replica ran fewer steps, not fewer rounds
    losses = [loss for _, _, _, loss in results]
    assert len(set(losses)) == 1 and losses[0] < 0.5 * before, (losses, before)


def test_a_schedule_places_each_point_at_its_share_of_the_period() -> None:
    """A point ``at`` inner steps into a period (a fragment's shift, or the end, H): under H
    steps, the step itself; under a time budget, the step boundary nearest the same share of
    ``round_seconds``."""
    steps = StepSchedule(inner_steps=10, steps=40)
    assert steps.due(15, at=5) and not steps.due(14, at=5) and steps.due(20)
    assert not steps.due(25) and steps.finished(40, 0) and not steps.finished(39, 99)
    budget = TimeBudget(inner_steps=10, steps=40, round_seconds=20.0, rounds_per_period=2)
    budget.period_started = budget.clock_started = time.monotonic() - 8.0
    budget.steps_since_clock = 4  # 2 s steps, 8 s into a 20 s period
    assert budget.due(4, at=4)  # 8 s: reached
    assert not budget.due(4, at=5)  # 10 s: the next boundary (10 s) is nearer
    assert not budget.due(4)  # the period's end, 20 s
    # the run: 40 // 10 = 4 periods of 2 rounds each, counted in rounds, not steps
    assert budget.total_rounds == 8 and budget.finished(0, 8) and not budget.finished(10**6, 7)
    assert budget.last_round_due(0, 7) and budget.lr_step(0, 4) == 20


def test_a_streaming_replica_waiting_for_a_late_peer_keeps_its_period_for_training() -> None:
    """Replica 1 starts 1 s late: replica 0 waits for it when its first fragment's round lands.
    That wait is not training time, so its period's next fragment still starts at its share of
    the period's training time (many steps later), not at once."""
    cfg = RunConfig(algorithm="streaming_diloco", round_seconds=0.4, steps=20, inner_steps=10,
                    warmup_steps=0, fragments=2, overlap_steps=1)
    init_lock = threading.Lock()

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        with init_lock:
            model = _model()
        algo = algorithm_class("streaming_diloco")(model, cfg, collective, Exchange(
            collective, make_compressor("none"), sender=f"w{rank}"))
        if rank == 1:
            time.sleep(1.0)
            algo.schedule.start_period()  # its own training starts now
        gen, landed = torch.Generator().manual_seed(rank + 1), []
        while not algo.finished():
            _loss(model, torch.randn(16, 8, generator=gen)).backward()
            time.sleep(0.01)
            if algo.step(16).synced:
                landed.append(algo.inner_steps_done)
        algo.finish()
        return landed

    landed = InProcessGroup(2).run(member, timeout=60)[0]
    # counted as training, the 1 s wait (2.5 periods) would make the next fragment due at the
    # very next step (a gap of 1); its share of training time takes several steps (about 10 on
    # an idle machine, fewer when a loaded one slows every step)
    assert len(landed) >= 2 and landed[1] - landed[0] >= 2, landed
