"""The run's result when replicas end on different states (an elastic run's straggler)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from farlink.config import load_config
from farlink.train.launcher import ended_apart_report, export_model, final_replicas, summarize


def _write_worker(run_dir: Path, worker: str, evals: list[tuple[int, float, float]],
                  outer_step: int, fingerprint: str | None,
                  last_group: int | None = None) -> None:
    records = [{"kind": "eval", "time": t, "worker": worker, "step": step, "tokens": step * 10,
                "loss": loss, "ppl": 2.0 ** loss, "outer_step": outer_step, "bytes_sent": 0,
                "wall_s": t} for step, loss, t in evals]
    end = {"kind": "end", "time": 999.0, "worker": worker, "finished": True, "inner_steps": 100,
           "tokens": 1000, "bytes_sent": 10, "compute_s": 1.0, "comm_s": 1.0, "wall_s": 3.0}
    if fingerprint is not None:
        end |= {"outer_step": outer_step, "fingerprint": fingerprint}
    if last_group is not None:
        end["last_group"] = last_group
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in [*records, end]]
    (run_dir / "metrics" / f"{worker}.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "final").mkdir(exist_ok=True)
    save_file({"w": torch.full((2,), float(int(worker[1:])))},
              str(run_dir / "final" / f"{worker}.safetensors"))


def test_straggler_ending_alone_does_not_become_the_result(tmp_path: Path) -> None:
    cfg = load_config(None, {"run_dir": tmp_path / "run", "workers": 3})
    # w0 and w1 committed round 5 together; w2 missed it and later committed its own round 5
    # alone, with a worse model, and evaluated it last
    _write_worker(cfg.run_dir, "w0", [(100, 5.18, 237.0)], 5, "aaaa", last_group=2)
    _write_worker(cfg.run_dir, "w1", [(100, 5.18, 236.0)], 5, "aaaa", last_group=2)
    _write_worker(cfg.run_dir, "w2", [(100, 5.27, 266.0)], 5, "bbbb", last_group=1)
    summary = summarize(cfg)
    # the report names the worker apart, its state and its last round's group
    report = ended_apart_report(summary["final_replicas"])
    assert "w2 (outer step 5, state bbbb, its last round in a group of 1)" in report
    assert "w0 (" not in report and report.endswith("that of w0, w1")
    assert summary["final_heldout_loss"] == 5.18
    assert summary["final_replicas"]["holders"] == ["w0", "w1"]
    assert summary["final_replicas"]["consistent"] is False
    assert summary["final_replicas"]["states"]["w2"] == [5, "bbbb"]
    model = export_model(cfg, summary["final_replicas"]["holders"])
    assert model is not None and float(load_file(str(model))["w"][0]) == 0.0


def test_ties_go_to_the_later_outer_step_and_old_metrics_keep_every_worker() -> None:
    ends = {"w0": {"outer_step": 4, "fingerprint": "a"}, "w1": {"outer_step": 5, "fingerprint": "b"}}
    assert final_replicas(ends) == (["w1"], False)
    assert final_replicas({"w0": {}, "w1": {}}) == (["w0", "w1"], True)


def test_consistent_run_reports_the_last_evaluation(tmp_path: Path) -> None:
    cfg = load_config(None, {"run_dir": tmp_path / "run", "workers": 2})
    _write_worker(cfg.run_dir, "w0", [(50, 6.0, 10.0), (100, 5.0, 20.0)], 2, "cc")
    _write_worker(cfg.run_dir, "w1", [(25, 6.1, 11.0), (50, 5.1, 21.0)], 2, "cc")
    summary = summarize(cfg)
    assert summary["final_replicas"] == {"holders": ["w0", "w1"], "consistent": True,
                                         "states": {"w0": [2, "cc"], "w1": [2, "cc"]},
                                         "last_groups": {"w0": None, "w1": None}}
    assert summary["final_heldout_loss"] == 5.0  # the furthest-trained worker's last evaluation
