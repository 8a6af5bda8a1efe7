"""`farlink train` killed with SIGKILL (a closed terminal, the OOM killer) runs no cleanup: its
workers and its Lighthouse must notice on their own and stop within seconds, keeping their
checkpoints, and `farlink train --resume` then finishes the run. The killed run is processes (they
are the subject); the torchft resume is the CLI in the test process with its workers as threads
(its subject is what the killed run left on disk)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procfs import alive, command_line, descendants

from farlink.state.checkpoint import latest_checkpoint
from farlink.train.metrics import read_metrics

from test_run_safety import farlink_train_in_threads

BASE = {"model": "nano",
        "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2, "workers": 2,
        "steps": 40, "inner_steps": 10, "warmup_steps": 5, "join_timeout": 10}
GONE_WITHIN_S = 20.0


def farlink_train(*args: str, **popen: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from farlink.cli import main; main()",
                             "train", *args], **popen)


# the torchft resume runs torchft in this process: after every test that forks (see conftest)
@pytest.mark.parametrize("backend", [pytest.param("torchft", marks=pytest.mark.torchft_threads),
                                     pytest.param("hivemind", marks=pytest.mark.slow)])
def test_sigkilled_launcher_leaves_no_process_and_resume_finishes(
        tmp_path: Path, cache_dir: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft: the workers and the Lighthouse; hivemind: the workers, their DHT processes and
    p2p daemons, and the bootstrap peer the launcher forked (with its p2pd)."""
    run_dir = tmp_path / "run"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**BASE, "backend": backend}.items()]
    dirs = ["--run-dir", str(run_dir), "--cache-dir", str(cache_dir)]
    launcher = farlink_train(*flags, *dirs, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    left: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while not all(latest_checkpoint(run_dir / "checkpoints" / w) for w in ("w0", "w1")):
            assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.2)
        children = descendants(launcher.pid)
        names = {p: command_line(p) for p in children}
        central = "torchft_lighthouse" if backend == "torchft" else "p2pd"
        assert any(central in name for name in names.values()), names
        assert sum("farlink.worker" in name for name in names.values()) >= 2, names
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        killed_at = time.monotonic()
        while (left := {p for p in children if alive(p)}) and \
                time.monotonic() - killed_at < GONE_WITHIN_S:
            time.sleep(0.2)
        assert not left, {p: command_line(p) for p in left}
    finally:
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not (run_dir / "final").exists()  # it stopped mid-run, not at the end
    for w in ("w0", "w1"):  # they stopped because the launcher was gone, and said so
        assert "farlink train (pid" in (run_dir / "logs" / f"{w}.log").read_text()

    if backend == "torchft":  # workers as threads (launch_in_threads runs torchft runs only)
        code, out = farlink_train_in_threads(monkeypatch, "--resume", *dirs)
    else:
        resumed = farlink_train("--resume", *dirs, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        out, _ = resumed.communicate(timeout=400)
        code = resumed.returncode
    assert code == 0, out
    for w in ("w0", "w1"):
        records = read_metrics(run_dir / "metrics" / f"{w}.jsonl")
        resume = [r for r in records if r["kind"] == "resume"]
        assert resume and resume[-1]["inner_steps"] >= BASE["inner_steps"], records[-3:]
        assert records[-1]["kind"] == "end" and records[-1]["finished"]
        assert (run_dir / "final" / f"{w}.safetensors").exists()


# by default: test_lifeline's test_a_sigkilled_process_takes_its_dht_and_p2pd_along
@pytest.mark.slow
def test_a_sigkilled_volunteer_leaves_no_process(tmp_path: Path, cache_dir: Path) -> None:
    """``farlink swarm join`` killed with SIGKILL: its DHT process (forked, with its p2pd) must
    not outlive it. An orphaned DHT also held the volunteer's output pipes open, so whoever
    waited for the volunteer's output waited forever."""
    from swarm_output import read_multiaddress, stop

    env = {**os.environ, "FARLINK_SECRET": "s"}
    (tmp_path / "run.toml").write_text('[train]\nvocab_size = 512\nauth = "secret"\n')
    boot = subprocess.Popen([sys.executable, "-m", "farlink.cli", "swarm", "start", "--config",
                             str(tmp_path / "run.toml"), "--run-dir", str(tmp_path / "boot"),
                             "--cache-dir", str(cache_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        address = read_multiaddress(boot, timeout=300)
        volunteer = subprocess.Popen(
            [sys.executable, "-m", "farlink.cli", "swarm", "join", "--initial-peers", address,
             "--auth", "secret", "--run-dir", str(tmp_path / "v"), "--cache-dir",
             str(cache_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 300
        while not (tmp_path / "v" / "swarm.json").is_file():  # it claimed a shard: all started
            assert volunteer.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        below = descendants(volunteer.pid)
        assert any("p2pd" in command_line(pid) for pid in below), [command_line(p) for p in below]
        volunteer.kill()
        volunteer.wait(30)
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(alive(pid) for pid in below) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [command_line(pid) for pid in below if alive(pid)]
    finally:
        stop(boot)
