"""The heterogeneity benchmark's arithmetic: budget, speedup to the fixed-H loss, targets."""

from __future__ import annotations

import pytest

from farlink.bench.hetero import compare, time_budget
from farlink.train.launcher import result_evals


def _run(label: str, utilization: list[float], evals: list[tuple[float, float]]) -> dict:
    return {"label": label, "final_heldout_loss": evals[-1][1], "tokens_per_step": 100,
            "wall_s": evals[-1][0],
            "per_worker": {f"w{i}": {"compute_utilization": u, "compute_s": 10.0 * (i + 1),
                                     "tokens": 1000} for i, u in enumerate(utilization)},
            "evals": [{"wall_s": t, "loss": loss} for t, loss in evals]}


def test_speedup_is_measured_to_the_fixed_runs_final_loss() -> None:
    fixed = _run("fixed", [0.4, 0.9], [(50.0, 6.0), (100.0, 5.0), (200.0, 4.5)])
    fast = _run("budget", [0.95, 0.91], [(40.0, 5.5), (90.0, 4.4), (180.0, 4.0)])
    busy_but_slow = _run("slow", [0.99, 0.99], [(150.0, 4.6), (170.0, 4.5)])
    rows = compare([fixed, fast, busy_but_slow])
    assert rows[0]["wall_to_fixed_final_loss"] == 200.0 and "meets_targets" not in rows[0]
    assert rows[1]["speedup_to_target"] == pytest.approx(200.0 / 90.0)
    assert rows[1]["min_utilization"] == 0.91 and rows[1]["meets_targets"]
    assert rows[2]["speedup_to_target"] == pytest.approx(200.0 / 170.0)
    assert not rows[2]["meets_targets"]  # busy, but not 1.5x faster
    never = _run("never", [0.99, 0.99], [(100.0, 9.0)])
    assert compare([fixed, never])[1]["speedup_to_target"] is None


def test_budget_is_h_steps_of_the_fastest_worker() -> None:
    fixed = _run("fixed", [0.5, 1.0], [(230.0, 5.0)])  # w0: 10 s for 10 steps, w1: 20 s
    budget, rounds = time_budget(fixed, inner_steps=20)
    assert budget == pytest.approx(20.0)
    assert rounds == int(230.0 / (20.0 * 1.15))


def test_result_evals_leave_out_a_stragglers_lone_round() -> None:
    evals = [{"worker": "w0", "loss": 5.2}, {"worker": "w2", "loss": 5.3}]
    assert result_evals(evals, ["w0", "w1"]) == [{"worker": "w0", "loss": 5.2}]
    assert len(result_evals([{"loss": 1.0}, {"loss": 2.0}], ["w0"])) == 2
    assert len(result_evals(evals, None)) == 2
