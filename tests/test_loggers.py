"""Metrics where people look: ``--log-to tensorboard,wandb`` and the library's Reporter.

The TensorBoard event files are read back with TensorBoard's own EventAccumulator, the W&B runs
from their offline run files (``WANDB_MODE=offline``: no network, no account), so a figure that
is logged but lands nowhere, or under another name, fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import farlink
from farlink.comm.inprocess import InProcessGroup
from farlink.config import ConfigError, load_config
from farlink.loggers import open_sinks, parse_spec, scalars_of
from farlink.train.metrics import read_metrics
from wandb_offline import offline_runs

torch.set_num_threads(1)
TINY = {"model": "nano", "steps": 4, "inner_steps": 2, "workers": 2, "vocab_size": 512,
        "seq_len": 64, "batch_size": 4, "eval_batches": 2, "warmup_steps": 1,
        "join_timeout": 10, "log_every": 1}


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def assert_tensorboard_equals_records(run: Path, worker: str) -> tuple[dict, dict]:
    """A 2-worker TINY run's TensorBoard curves for ``worker`` equal its JSONL records;
    returns its step records by step and its end record."""
    records = read_metrics(run / "metrics" / f"{worker}.jsonl")
    steps = {r["step"]: r for r in records if r["kind"] in ("step", "sync")}
    syncs = [r for r in records if r["kind"] == "sync"]
    end = next(r for r in records if r["kind"] == "end")
    tb = tensorboard_scalars(run / "tensorboard" / worker)
    assert [s for s, _ in tb["train/loss"]] == sorted(steps)
    for step, value in tb["train/loss"]:
        assert value == pytest.approx(steps[step]["loss"], rel=1e-6)
    assert tb["train/tokens"][-1][1] == end["tokens"] == 4 * 4 * 64
    assert tb["net/bytes_sent"][-1][1] == end["bytes_sent"] > 0
    assert [v for _, v in tb["round/outer_step"]][-1] == end["outer_step"] == 2
    assert [v for _, v in tb["peers/live"]] == [r["world_size"] for r in syncs] == [2, 2]
    assert [v for _, v in tb["round/seconds"]] == pytest.approx([r["round_s"] for r in syncs])
    assert all(0 < v <= 1 for _, v in tb["time/utilization"])
    assert "round/quorum_s" in tb and "peers/rejected" in tb
    return steps, end


def assert_held_out_curve_equals_records(run: Path) -> list[dict]:
    """w0's eval/loss curve equals its two eval records; returns them."""
    evals = [r for r in read_metrics(run / "metrics" / "w0.jsonl") if r["kind"] == "eval"]
    held_out = tensorboard_scalars(run / "tensorboard" / "w0")["eval/loss"]
    assert held_out == [(r["step"], pytest.approx(r["loss"])) for r in evals] and len(evals) == 2
    return evals


# by default: test_a_runs_workers_log_their_records_to_tensorboard (the workers' sinks, as
# threads) and test_the_library_reports_an_optimizers_figures_with_rejections_per_peer (W&B)
@pytest.mark.slow
def test_farlink_train_logs_to_tensorboard_and_wandb(tmp_path: Path, cache_dir: Path) -> None:
    """A real 2-worker run with ``--log-to tensorboard,wandb``: every worker's curves in both,
    equal to its JSONL records (the run's own record). Worker processes, not threads: two W&B
    runs opened at once by threads of one process lost a run's name (seen once, not
    reproduced alone)."""
    run = tmp_path / "run"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    done = subprocess.run(
        [sys.executable, "-m", "farlink.cli", "train", *flags, "--run-dir", str(run),
         "--cache-dir", str(cache_dir), "--log-to", "tensorboard,wandb"],
        env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = {r.name: r for r in offline_runs(run / "wandb")}
    assert set(runs) == {"w0", "w1"}
    for worker in ("w0", "w1"):
        steps, end = assert_tensorboard_equals_records(run, worker)
        wb = runs[worker]
        assert wb.group == run.name and wb.config["algorithm"] == "diloco"
        logged = [h for h in wb.history if "train/loss" in h]
        assert [h["step"] for h in logged] == sorted(steps)
        assert [h["train/loss"] for h in logged] == pytest.approx(
            [steps[s]["loss"] for s in sorted(steps)])
        assert wb.history[-1]["net/bytes_sent"] == end["bytes_sent"]
    evals = assert_held_out_curve_equals_records(run)
    assert [(h["step"], h["eval/loss"]) for h in runs["w0"].history if "eval/loss" in h] == [
        (r["step"], r["loss"]) for r in evals]


@pytest.mark.torchft_threads  # torchft in this process: after every test that forks
def test_a_runs_workers_log_their_records_to_tensorboard(tmp_path: Path, cache_dir: Path) -> None:
    """The same 2-worker run with ``log_to="tensorboard"``, its workers as threads: every
    worker's TensorBoard curves equal its JSONL records. (W&B from a run's workers, which are
    processes: test_farlink_train_logs_to_tensorboard_and_wandb, with the slow scenarios.)"""
    from farlink.testing.runs import launch_in_threads

    cfg = load_config(None, {**TINY, "log_to": "tensorboard", "run_dir": tmp_path / "run",
                             "cache_dir": cache_dir})
    assert launch_in_threads(cfg).returncodes == [0, 0]
    run = cfg.run_dir
    for worker in ("w0", "w1"):
        assert_tensorboard_equals_records(run, worker)
    assert_held_out_curve_equals_records(run)


_INIT = threading.Lock()


def test_the_library_reports_an_optimizers_figures_with_rejections_per_peer(
        tmp_path: Path) -> None:
    """Three replicas in a user's loop, one sending NaN updates: each reports through
    ``farlink.Reporter`` to TensorBoard and W&B; the honest replicas' curves show the live
    peers, the bytes, the outer step and the NaN sender's rejected updates under its name."""

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        with _INIT:
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
        sync = farlink.Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                 collective=collective, index=rank, backend="inprocess",
                                 algorithm="diloco", inner_steps=3, steps=9, attack="nan", auth="secret",
                                 secret="s3cret",
                                 attackers="2")
        with _INIT:  # wandb's first import is not safe from several threads at once
            report = farlink.Reporter(sync, open_sinks("tensorboard,wandb", tmp_path / f"r{rank}",
                                                       name=f"r{rank}"))
        gen = torch.Generator().manual_seed(rank)
        for _ in range(9):
            x = torch.randn(16, 4, generator=gen)
            loss = nn.functional.mse_loss(model(x).squeeze(-1), x.sum(-1))
            loss.backward()
            report(sync.step(tokens=16), loss=loss.item(), tokens=16)
        report.evaluation(sync.inner_steps, 0.5)
        with _INIT:  # nor is finishing several W&B runs of one process at once
            report.close()
        return sync.ledger.to_dict()["peers"], sync.bytes_sent()

    results = InProcessGroup(3).run(member)
    for rank in (0, 1):
        ledger, sent = results[rank]
        rejected = {peer: rec["updates_rejected"] for peer, rec in ledger.items()
                    if rec["updates_rejected"]}
        assert rejected and all(n == 3 for n in rejected.values())  # every round of 3
        tb = tensorboard_scalars(tmp_path / f"r{rank}" / "tensorboard" / f"r{rank}")
        for peer, count in rejected.items():
            assert tb[f"peers/rejected/{peer}"][-1] == (9, count)
        assert [s for s, _ in tb["train/loss"]] == list(range(1, 10))
        assert tb["train/tokens"][-1] == (9, 16 * 9)
        assert tb["net/bytes_sent"][-1] == (9, sent)
        assert [v for _, v in tb["peers/live"]] == [3, 3, 3]
        assert tb["round/outer_step"][-1] == (9, 3)
        assert tb["eval/loss"] == [(9, 0.5)]
        (wb,) = offline_runs(tmp_path / f"r{rank}")
        assert [h["step"] for h in wb.history if "train/loss" in h] == list(range(1, 10))
        assert wb.history[-1]["eval/loss"] == 0.5
        for peer, count in rejected.items():
            assert [h for h in wb.history if "train/loss" in h][-1][
                f"peers/rejected/{peer}"] == count


def test_scalars_of_names_phases_utilization_and_eval() -> None:
    scalars = scalars_of("sync", {"loss": 2.0, "compute_s": 3.0, "comm_s": 1.0,
                                  "phases_s": {"quorum": 0.25, "allreduce": 0.5},
                                  "rejected_by_peer": {"w3": 2}, "healed": True,
                                  "exchange_path": "allreduce", "world_size": 4})
    assert scalars == {"train/loss": 2.0, "time/compute_s": 3.0, "time/comm_s": 1.0,
                       "round/phase/quorum": 0.25, "round/phase/allreduce": 0.5,
                       "peers/rejected/w3": 2.0, "time/utilization": 0.75, "peers/live": 4.0}
    assert scalars_of("eval", {"loss": 3.0, "ppl": 20.0, "step": 5, "tokens": 10}) == {
        "eval/loss": 3.0, "eval/ppl": 20.0, "eval/tokens": 10.0}


def test_unknown_sinks_are_refused_and_the_spec_is_saved_normalized(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--log-to mlflow: unknown; choose from tensorboard"):
        load_config(None, {"log_to": "mlflow", "run_dir": tmp_path})
    assert load_config(None, {"log_to": " WandB,tensorboard,wandb", "run_dir": tmp_path}
                       ).log_to == "wandb,tensorboard"
    assert parse_spec("") == []


def test_log_to_without_the_metrics_extra_names_it_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``farlink``'s own entry point, run in this process (no fresh interpreter importing
    torch); only its signal handlers stay out of the test process."""
    from farlink import cli, interrupt

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed, as far as imports go
    monkeypatch.setattr(interrupt, "install", lambda: None)
    monkeypatch.setenv("COLUMNS", "200")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    monkeypatch.setattr(sys, "argv", ["farlink", "train", *flags, "--run-dir",
                                      str(tmp_path / "run"), "--cache-dir",
                                      str(tmp_path / "cache"), "--log-to", "tensorboard"])
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2, stderr[-2000:]
    assert "--log-to tensorboard needs tensorboard" in stderr
    assert "pip install 'farlink[metrics]'" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "run" / "metrics").exists()  # no worker started


def test_a_trainer_logs_the_optimizers_figures_through_its_own_tensorboard_callback(
        tmp_path: Path) -> None:
    """A real ``transformers.Trainer`` with ``report_to=["tensorboard"]``: with
    ``add_to_trainer`` the optimizer's figures land in the Trainer's own event files (as
    ``train/net/bytes_sent``, ...); appended after the Trainer's callbacks, as
    ``trainer.add_callback`` would, they come too late for its TensorBoard callback."""
    from transformers import Trainer, TrainingArguments

    from farlink.integrations import add_to_trainer, trainer_callback

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        with _INIT:
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
        sync = farlink.Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                 collective=collective, index=rank, backend="inprocess",
                                 algorithm="diloco", inner_steps=2, steps=4)
        for _ in range(4):
            model(torch.randn(8, 4)).sum().backward()
            sync.step(tokens=8)
        return sync

    sync = InProcessGroup(2).run(member)[0]
    assert sync.bytes_sent() > 0 and sync.outer_step == 2

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
            return {"loss": nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}

    gen = torch.Generator().manual_seed(0)
    data = [{"x": (x := torch.randn(4, generator=gen)), "labels": x.sum()} for _ in range(32)]

    def train(out: Path, first: bool) -> dict:
        args = TrainingArguments(output_dir=str(out), max_steps=4, logging_steps=2,
                                 report_to=["tensorboard"], per_device_train_batch_size=4,
                                 use_cpu=True, save_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=Regression(), args=args, train_dataset=data)
        if first:
            add_to_trainer(trainer, sync)
        else:
            trainer.add_callback(trainer_callback(sync))
        trainer.train()
        (events,) = {p.parent for p in out.rglob("events.out.tfevents.*")}
        return tensorboard_scalars(events)

    added = train(tmp_path / "first", first=True)
    assert added["train/net/bytes_sent"][-1] == (4, sync.bytes_sent())
    assert added["train/round/outer_step"][-1] == (4, 2)
    assert "train/loss" in added
    appended = train(tmp_path / "last", first=False)
    assert "train/loss" in appended and "train/net/bytes_sent" not in appended
