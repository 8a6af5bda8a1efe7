"""Evaluation and checkpoints off the critical path, and utilization that counts all wall-clock.

One real run (two workers as threads, ``launch_in_threads``: torchft's real Lighthouse, Gloo over
TCP) with a held-out evaluation far
longer than a training step, every other round: rank 0 keeps training while it evaluates, its
peer waits no longer at the round after an evaluation than at a round after none, the
background evaluation reports what a synchronous evaluation of the same parameters gives, and
the worker's time accounts add up to its wall-clock.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
from safetensors.torch import load_model

from farlink.config import load_config
from farlink.testing.runs import launch_in_threads
from farlink.train.metrics import read_metrics

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

RUN = {"model": "nano", "vocab_size": 512, "seq_len": 64, "batch_size": 4, "warmup_steps": 5,
       "workers": 2, "steps": 40, "inner_steps": 10, "eval_every": 2, "eval_batches": 64,
       "log_every": 1, "join_timeout": 10, "min_replicas": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path):  # noqa: ANN201
    cfg = load_config(None, {**RUN, "run_dir": tmp_path_factory.mktemp("bg") / "run",
                             "cache_dir": cache_dir})
    result = launch_in_threads(cfg)
    assert result.returncodes == [0, 0]
    return cfg, result.summary


def records(cfg, worker: str) -> list[dict]:  # noqa: ANN001
    return read_metrics(cfg.run_dir / "metrics" / f"{worker}.jsonl")


def synchronous_heldout(cfg) -> tuple[float, float]:  # noqa: ANN001
    """Held-out loss of w0's final model evaluated here, in the test, and the seconds it took."""
    from farlink.data import evaluate, heldout_batches, prepare_data
    from farlink.model.build import build_model

    data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    model = build_model(cfg.model, data.vocab_size, cfg.seq_len)
    load_model(model, str(cfg.run_dir / "final" / "w0.safetensors"))
    batches = heldout_batches(data.heldout, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    start = time.perf_counter()
    loss = evaluate(model, batches)
    return loss, time.perf_counter() - start


def test_peers_do_not_wait_for_rank_zero_evaluating(run) -> None:  # noqa: ANN001
    cfg, _ = run
    w0, w1 = records(cfg, "w0"), records(cfg, "w1")
    evals = {r["step"]: r for r in w0 if r["kind"] == "eval"}
    assert sorted(evals) == [20, 40], evals  # every other boundary, and the final one
    assert not [r for r in w1 if r["kind"] == "eval"]

    # rank 0's loop went on training while the evaluation of step 20 ran: step records of
    # later steps were written before the evaluation's record
    boundary = next(r for r in w0 if r["kind"] == "sync" and r["step"] == 20)
    during = [r["step"] for r in w0 if r["kind"] in ("step", "sync")
              and boundary["time"] <= r["time"] < evals[20]["time"] and r["step"] > 20]
    assert len(during) >= 2, (during, evals[20])

    # the evaluation, at one thread, takes several training steps' time: synchronously, the peer
    # would wait that long at the next round. It waits about as long at the round after the
    # evaluation (step 30) as at the round after a boundary without one (step 20).
    loss, eval_seconds = synchronous_heldout(cfg)
    waits = {r["step"]: r["round_s"] for r in w1 if r["kind"] == "sync"}
    # the premise, on any machine's speed: one evaluation costs several of w1's training steps
    step_times = [b["compute_s"] - a["compute_s"] for a, b in zip(w1, w1[1:])
                  if a["kind"] == b["kind"] == "step"]
    assert eval_seconds > 3 * statistics.median(step_times), (eval_seconds, step_times)
    assert waits[30] < waits[20] + 0.5 * eval_seconds, (waits, eval_seconds)

    # what the background evaluation measured is the loss of the parameters at its step
    assert evals[40]["loss"] == pytest.approx(loss, abs=2e-5)


def test_utilization_counts_evaluation_and_checkpoints(run) -> None:  # noqa: ANN001
    cfg, summary = run
    for worker in ("w0", "w1"):
        end = next(r for r in records(cfg, worker) if r["kind"] == "end")
        w = summary["per_worker"][worker]
        assert w["compute_utilization"] == pytest.approx(end["compute_s"] / end["wall_s"])
        # every second of the worker's wall-clock is in one account; only the loop's own
        # bookkeeping between steps (log lines) is in none, and it is small
        parts = sum(end[k] for k in ("compute_s", "comm_s", "eval_s", "checkpoint_s", "setup_s"))
        assert parts <= end["wall_s"] + 0.01
        assert parts > 0.95 * end["wall_s"], end
        assert end["checkpoint_s"] > 0 and end["setup_s"] > 0
        for key in ("eval_s", "checkpoint_s", "setup_s"):
            assert w[key] == end[key]
    evaluating = next(r for r in records(cfg, "w0") if r["kind"] == "end")
    assert evaluating["eval_s"] > 0  # the snapshots: small, and counted
