"""A torchft worker waiting for a quorum leaves within seconds of Ctrl-C or SIGTERM, saying what
it waited for, also when the Lighthouse is gone (torchft's attempt blocks up to join_timeout +
10 s and then retries for quorum_timeout); while it waits it says so. Real Lighthouse."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from farlink import interrupt

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads


def test_a_quorum_wait_ends_on_the_stop_flag_and_says_what_it_waits_for(monkeypatch,
                                                                         caplog) -> None:
    from torchft.coordination import LighthouseServer

    from farlink.comm.torchft_backend import TorchftCollective

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    coll = TorchftCollective("alone", lighthouse.address(), min_replicas=2, join_timeout=30,
                             quorum_timeout=60)
    coll.register_state(lambda: {"x": torch.zeros(1)}, lambda state: None)
    monkeypatch.setattr(interrupt, "WAIT_LOG_EVERY", 0.5)
    stop = threading.Timer(2.0, interrupt.STOP.set)
    start = time.monotonic()
    try:
        stop.start()
        with caplog.at_level(logging.WARNING, "farlink.comm.torchft_backend"), \
                pytest.raises(KeyboardInterrupt, match="interrupted while waiting for a quorum "
                              "of >= 2 replicas from the Lighthouse at "):
            coll.begin_round()  # before: blocked in torchft for the whole 40 s attempt
        took = time.monotonic() - start
    finally:
        stop.cancel()
        interrupt.STOP.clear()
        coll.close()
        lighthouse.shutdown()
    assert took < 5.0, f"left {took - 2.0:.1f} s after the stop request"
    said = [r.getMessage() for r in caplog.records]
    waiting = [m for m in said if m.startswith(
        f"waiting for a quorum of >= 2 replicas from the Lighthouse at {lighthouse.address()} (")]
    assert waiting and said[-1].endswith("; leaving"), said


def _started(metrics: Path) -> bool:
    """Whether the joiner wrote its ``start`` record: it has its Manager and asks for a quorum."""
    try:
        return any(json.loads(line).get("kind") == "start"
                   for line in metrics.read_text().splitlines() if line.strip())
    except (OSError, ValueError):
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_farlink_join_waiting_on_a_gone_lighthouse_leaves_promptly(sig, tmp_path: Path,
                                                                   cache_dir: Path) -> None:
    from farlink.config import load_config
    from farlink.data import prepare_data
    from farlink.train.launcher import write_run_config
    from farlink.train.lighthouse import Lighthouse

    cfg = load_config(None, {"vocab_size": 512, "seq_len": 64, "batch_size": 4,
                             "eval_batches": 2, "workers": 3, "steps": 100, "inner_steps": 10,
                             "min_replicas": 2, "join_timeout": 5, "quorum_timeout": 120,
                             "run_dir": tmp_path / "run", "cache_dir": cache_dir})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    lighthouse = Lighthouse(min_replicas=2, join_timeout=5).start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "farlink.cli", "join", "--lighthouse", lighthouse.address,
         "--config", str(cfg.run_dir / "config.toml"), "--index", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _started(cfg.run_dir / "metrics" / "w2.jsonl"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
        lighthouse.stop(kill=True)  # gone while the joiner waits for its first quorum
        time.sleep(2.0)
        sent = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)  # before: 120 s and more (quorum_timeout)
        took = time.monotonic() - sent
    finally:
        lighthouse.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (f"interrupted while waiting for a quorum of >= 2 replicas from the Lighthouse at "
            f"{lighthouse.address}; leaving") in out, out[-3000:]
    assert proc.returncode == 130, out[-3000:]  # typer's exit code for an interruption
    assert took < 10.0, f"took {took:.1f} s to leave after {sig.name}"
