"""A full disk while writing a checkpoint: one clear line, no temp files left, and after the user
frees space, ``--resume`` redoes the lost round bit for bit, which the audit calls a redone round,
not a divergence. The disk is a real, small tmpfs (root only: mounting needs it). The run that
meets the full disk is worker processes (their exit code and logs are the subject); the resume,
whose subject is the redone round, has its workers as threads (``launch_in_threads``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from farlink.config import load_config
from farlink.train.audit import audit_run
from farlink.state.checkpoint import EXIT_DISK_FULL
from farlink.testing.runs import launch_in_threads
from farlink.train.launcher import launch

TINY = {"model": "nano", "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2, "workers": 2,
        "steps": 6, "inner_steps": 2, "warmup_steps": 2, "join_timeout": 5,
        # both workers in every round: the one that fell back heals from the other instead of
        # racing through rounds alone while a busy machine delays its peer
        "min_replicas": 2}
CHECKPOINT_MB = 2.81  # one checkpoint (state.safetensors, 2,805,592 bytes) at these settings


def _mount(path: Path, size_mb: int, remount: bool = False) -> subprocess.CompletedProcess:
    options = f"{'remount,' if remount else ''}size={size_mb}m"
    argv = ["mount", "-o", options, str(path)] if remount else \
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    return subprocess.run(argv, capture_output=True, text=True)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs with room for the first round's two checkpoints, not for the second's."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real full disk needs a tmpfs mount, which needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = _mount(disk, int(2 * CHECKPOINT_MB + CHECKPOINT_MB / 2))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def squash(text: str) -> str:
    return "".join(text.split())


@pytest.mark.torchft_threads  # the resume: torchft in this process, after every test that forks
def test_disk_full_stops_with_one_line_and_resume_redoes_the_round(
        small_disk: Path, cache_dir: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = small_disk / "run"
    cfg = load_config(None, {**TINY, "run_dir": run_dir, "cache_dir": cache_dir})
    result = launch(cfg, show_progress=False)
    console = squash(capsys.readouterr().err)
    assert result.returncodes == [EXIT_DISK_FULL, EXIT_DISK_FULL], console
    assert squash(f"disk full writing checkpoint under {run_dir / 'checkpoints'}") in console
    for w in ("w0", "w1"):
        log = (run_dir / "logs" / f"{w}.log").read_text()
        assert "Traceback" not in log, log
        assert squash(f"error: disk full writing checkpoint under {run_dir}/checkpoints/{w}") \
            in squash(log), log
        assert "--resume" in log
        ckpt = run_dir / "checkpoints" / w
        assert sorted(p.name for p in ckpt.iterdir()) == ["LATEST", "step-0000002"]
    assert not [p for p in run_dir.rglob("*") if ".tmp-" in p.name]

    assert _mount(small_disk, 400, remount=True).returncode == 0  # the user frees space
    resumed = load_config(None, {**TINY, "run_dir": run_dir, "cache_dir": cache_dir,
                                 "resume": True})
    result = launch_in_threads(resumed)
    assert result.returncodes == [0, 0]
    audit = audit_run(run_dir)
    # round 2 was committed, its checkpoint never written, and done again to the same state
    assert audit["redone_steps"] == {"w0": [2], "w1": [2]}, audit
    assert audit["consistent"] and audit["divergent_steps"] == {}, audit
    assert audit["lost_committed_steps"] == 0 and audit["outer_steps"] == 3


def _sync(worker: str, step: int, fingerprint: str) -> str:
    return json.dumps({"kind": "sync", "time": 1.0, "worker": worker, "committed": True,
                       "outer_step": step, "fingerprint": fingerprint})


def test_audit_tells_a_redone_round_from_a_divergent_one(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    # w0 committed round 2 twice to the same state (a redo); w1 once
    (metrics / "w0.jsonl").write_text("\n".join(
        [_sync("w0", 1, "a"), _sync("w0", 2, "b"), _sync("w0", 2, "b"), _sync("w0", 3, "c")]))
    (metrics / "w1.jsonl").write_text("\n".join(
        [_sync("w1", 1, "a"), _sync("w1", 2, "b"), _sync("w1", 3, "c")]))
    audit = audit_run(tmp_path)
    assert audit["consistent"] and audit["redone_steps"] == {"w0": [2]}
    assert audit["redone_committed_steps"] == 1 and audit["repeated_steps"] == {}
    # the second record of round 2 carries another state: that is no redo
    (metrics / "w0.jsonl").write_text("\n".join(
        [_sync("w0", 1, "a"), _sync("w0", 2, "b"), _sync("w0", 2, "x"), _sync("w0", 3, "c")]))
    audit = audit_run(tmp_path)
    assert not audit["consistent"]
    assert audit["repeated_steps"] == {"w0": [2]} and audit["divergent_steps"] == {2: ["b", "x"]}
    assert audit["redone_steps"] == {}


def test_audit_accepts_moshpit_groups_apart_but_not_one_group_apart(tmp_path: Path) -> None:
    """Groups smaller than the swarm commit one round with different states (each record
    names its group); within one group, or in the last round, two states are a divergence."""
    metrics = tmp_path / "metrics"
    metrics.mkdir()

    def grouped(worker: str, step: int, fingerprint: str, group: str) -> str:
        return json.dumps({**json.loads(_sync(worker, step, fingerprint)), "group": group})

    def write(last: dict[str, str], w1_first: str = "a") -> None:
        (metrics / "w0.jsonl").write_text("\n".join(
            [grouped("w0", 1, "a", "g1"), _sync("w0", 2, last["w0"])]))
        (metrics / "w1.jsonl").write_text("\n".join(
            [grouped("w1", 1, w1_first, "g1"), _sync("w1", 2, last["w1"])]))
        (metrics / "w2.jsonl").write_text("\n".join(
            [grouped("w2", 1, "b", "g2"), _sync("w2", 2, last["w2"])]))

    write({"w0": "c", "w1": "c", "w2": "c"})
    audit = audit_run(tmp_path)
    assert audit["consistent"] and audit["group_steps"] == {1: ["a", "b"]}, audit
    write({"w0": "c", "w1": "c", "w2": "c"}, w1_first="x")  # one group, two states
    audit = audit_run(tmp_path)
    assert not audit["consistent"] and audit["divergent_steps"] == {1: ["a", "b", "x"]}
    write({"w0": "c", "w1": "c", "w2": "d"})  # the last round did not join the groups
    audit = audit_run(tmp_path)
    assert not audit["consistent"] and audit["divergent_steps"] == {2: ["c", "d"]}
