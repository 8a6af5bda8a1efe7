"""Checkpoints resume exactly: an interrupted-and-resumed run ends bit-identical to an
uninterrupted one on the same schedule (parameters, optimizer states, data position, RNG).
The bit-for-bit runs are workers as threads (``farlink.testing``: torchft's real Lighthouse and
Gloo in one process); stopping ``farlink train`` by a signal needs its processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from farlink.config import load_config
from farlink.state.checkpoint import latest_checkpoint, load_checkpoint
from farlink.testing.runs import launch_in_threads
from farlink.train.metrics import read_metrics

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

BASE = {"model": "nano", "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2, "workers": 2,
        "steps": 12, "inner_steps": 3, "warmup_steps": 2, "join_timeout": 10,
        # every round holds both workers, so the two runs follow one schedule even when one
        # worker starts late on a busy machine (an elastic round of one would differ)
        "min_replicas": 2}


def test_resumed_run_matches_uninterrupted_run_bit_for_bit(tmp_path: Path,
                                                           cache_dir: Path) -> None:
    straight = load_config(None, {**BASE, "run_dir": tmp_path / "a", "cache_dir": cache_dir})
    assert launch_in_threads(straight).returncodes == [0, 0]

    cut = load_config(None, {**BASE, "run_dir": tmp_path / "b", "cache_dir": cache_dir,
                             "stop_at_step": 6})
    first = launch_in_threads(cut)
    assert first.returncodes == [0, 0]
    assert not (cut.run_dir / "final").exists()  # it really stopped early
    _, meta = load_checkpoint(latest_checkpoint(cut.run_dir / "checkpoints" / "w0"))
    assert meta["inner_steps"] == 6 and meta["outer_step"] == 2

    resumed = load_config(None, {**BASE, "run_dir": tmp_path / "b", "cache_dir": cache_dir,
                                 "resume": True})
    assert launch_in_threads(resumed).returncodes == [0, 0]
    for worker in ("w0", "w1"):
        a = load_file(str(straight.run_dir / "final" / f"{worker}.safetensors"))
        b = load_file(str(resumed.run_dir / "final" / f"{worker}.safetensors"))
        assert a.keys() == b.keys()
        for name in a:
            assert (a[name] == b[name]).all(), f"{worker}:{name} differs after resume"


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_ctrl_c_or_kill_of_farlink_train_stops_workers_and_keeps_checkpoints(
        tmp_path: Path, cache_dir: Path, sig: signal.Signals) -> None:
    """`farlink train` interrupted mid-run (Ctrl-C, or `kill`): every worker stops between
    steps, the last committed checkpoint of each is intact, and the run says how to resume."""
    run_dir = tmp_path / "run"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**BASE, "steps": 400}.items()]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from farlink.cli import main; main()", "train", *flags,
         "--run-dir", str(run_dir), "--cache-dir", str(cache_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not all(latest_checkpoint(run_dir / "checkpoints" / w) for w in ("w0", "w1")):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.5)
        pids = [r["pid"] for w in ("w0", "w1")
                for r in read_metrics(run_dir / "metrics" / f"{w}.jsonl") if r["kind"] == "start"]
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "--resume" in out, out
    for pid in pids:  # the workers are gone, not orphaned
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(
            f"/proc/{pid}/status").read_text(), f"worker {pid} still running"
    for w in ("w0", "w1"):
        _, meta = load_checkpoint(latest_checkpoint(run_dir / "checkpoints" / w))
        assert meta["inner_steps"] % BASE["inner_steps"] == 0 and meta["inner_steps"] < 400
        assert not (run_dir / "final" / f"{w}.safetensors").exists()
