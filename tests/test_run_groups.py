"""A local run trains one model: its rounds average across its workers (on hivemind, with plain
fp32 updates, into bit-identical replicas), and a run in which no round had more than one worker
fails loudly instead of reporting success."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from farlink.train.audit import audit_run
from farlink.train.metrics import read_metrics

BASE = {"model": "nano",
        "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2, "workers": 2,
        "steps": 30, "inner_steps": 10, "warmup_steps": 5, "backend": "hivemind"}


def farlink_train(run_dir: Path, cache_dir: Path,
                  **overrides: object) -> subprocess.CompletedProcess:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**BASE, **overrides}.items()]
    return subprocess.run(
        [sys.executable, "-c", "from farlink.cli import main; main()", "train", *flags,
         "--run-dir", str(run_dir), "--cache-dir", str(cache_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)


def committed_groups(run_dir: Path) -> list[int]:
    return [r["world_size"] for path in sorted((run_dir / "metrics").glob("w*.jsonl"))
            for r in read_metrics(path) if r["kind"] == "sync" and r["committed"]]


def test_local_hivemind_swarm_averages_all_workers_by_default(tmp_path: Path,
                                                              cache_dir: Path) -> None:
    run = farlink_train(tmp_path / "run", cache_dir)
    assert run.returncode == 0, run.stdout
    groups = committed_groups(tmp_path / "run")
    assert len(groups) == 2 * 3 and set(groups) == {2}, groups  # 3 rounds each, both peers
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_replicas"]["consistent"], summary["final_replicas"]
    assert summary["final_heldout_loss"] < 6.0  # from ln(512) = 6.24 at init
    # hivemind's butterfly all-reduce is exact only up to rounding, so plain fp32 updates go
    # through the gathered path there: every replica decodes the same bytes
    audit = audit_run(tmp_path / "run")
    assert audit["consistent"] and audit["outer_steps"] >= 3, audit
    a, b = (load_file(str(tmp_path / "run" / "final" / f"w{i}.safetensors")) for i in range(2))
    assert all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow  # by default: test_rounds_of_one_are_named_as_independent_models
def test_run_whose_rounds_never_averaged_fails_loudly(tmp_path: Path, cache_dir: Path) -> None:
    """Groups of one allowed and the two peers far out of step (paced devices, one 5x slower):
    each commits every round alone. That is two independent models, never a success."""
    run = farlink_train(tmp_path / "run", cache_dir, min_replicas=1, pace_seconds=0.15, steps=10,
                        inner_steps=5,
                        slowdown="1,5")
    assert set(committed_groups(tmp_path / "run")) == {1}  # the situation really arose
    assert run.returncode == 1, run.stdout
    out = " ".join(run.stdout.split())  # rich wraps long lines
    assert "no round averaged two or more of the 2 workers" in out, run.stdout
    assert "--min-replicas 2" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["widest_group"] == 1 and "independent models" in summary["problem"]


def test_min_replicas_default_of_a_local_swarm_is_every_worker() -> None:
    from farlink.config import RunConfig, load_config

    local = load_config(None, {"backend": "hivemind", "workers": 3})
    assert local.min_replicas == 3
    assert RunConfig.model_validate_json(local.model_dump_json()).min_replicas == 3  # workers
    assert load_config(None, {"backend": "hivemind", "workers": 3,
                              "min_replicas": 2}).min_replicas == 2  # the user's choice
    # joining someone else's swarm: its size is unknown here
    assert load_config(None, {"backend": "hivemind", "initial_peers": "/ip4/10.0.0.1/tcp/1/p2p/x"}
                       ).min_replicas == 1
    # torchft's Lighthouse waits join_timeout for every live peer; 1 keeps the run elastic
    assert load_config(None, {"workers": 3}).min_replicas == 1


@pytest.mark.parametrize("widest", [1, 2])
def test_rounds_of_one_are_named_as_independent_models(tmp_path: Path, widest: int) -> None:
    """What the launcher makes of two workers' records in which every committed round had a
    group of ``widest``: of groups of one, the run's problem (two independent models, and the
    fix); of groups of two, none. (The run that really commits alone, and the CLI's exit code:
    test_run_whose_rounds_never_averaged_fails_loudly, with the slow scenarios.)"""
    from farlink.config import load_config
    from farlink.train.launcher import never_averaged, summarize

    cfg = load_config(None, {**BASE, "min_replicas": 1, "run_dir": tmp_path / "run"})
    (cfg.run_dir / "metrics").mkdir(parents=True)
    for worker in ("w0", "w1"):
        records = [{"kind": "sync", "step": 10 * (r + 1), "committed": True,
                    "world_size": widest} for r in range(3)]
        records.append({"kind": "end", "tokens": 7680, "bytes_sent": 100, "compute_s": 1.0,
                        "wall_s": 2.0, "comm_s": 0.5, "widest_group": widest})
        (cfg.run_dir / "metrics" / f"{worker}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    summary = summarize(cfg)
    assert summary["widest_group"] == widest
    problem = never_averaged(cfg, summary)
    if widest == 2:
        assert problem is None, problem
        return
    assert "no round averaged two or more of the 2 workers" in problem, problem
    assert "--min-replicas 2" in problem and "independent models" in problem
