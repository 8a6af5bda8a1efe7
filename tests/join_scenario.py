"""A running job that a third worker joins with ``farlink join`` (a helper module, not tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from farlink.bench.churn import committed_outer_steps
from farlink.config import RunConfig
from farlink.train.audit import audit_run
from farlink.train.launcher import _stop_all, spawn_worker
from farlink.train.lighthouse import Lighthouse
from farlink.train.metrics import read_metrics


def two_workers_then_join(cfg: RunConfig, lighthouse: Lighthouse, log: Path) -> dict:
    """Workers 0 and 1 train; after two committed rounds worker 2 joins through the CLI. Waits
    for all three, stops the Lighthouse, checks they exited 0, and returns the joiner's ``join``
    record after checking that it healed, then took part in every later round with consistent
    replicas."""
    procs = [spawn_worker(cfg, i, lighthouse.address, False) for i in range(2)]
    try:
        deadline = time.time() + 300
        while committed_outer_steps(cfg.run_dir) < 2:
            assert time.time() < deadline, "the first two workers made no progress"
            time.sleep(0.5)
        # the saved config never holds the secret: a joiner is given it, as a person would
        env = {**os.environ, "FARLINK_SECRET": cfg.secret} if cfg.secret else None
        with open(log, "wb") as join_log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "farlink.cli", "join", "--lighthouse", lighthouse.address,
                 "--config", str(cfg.run_dir / "config.toml"), "--index", "2"],
                stdout=join_log, stderr=subprocess.STDOUT, env=env))
        for p in procs:
            p.wait(timeout=600)
    finally:
        _stop_all(procs)
        lighthouse.stop()
    assert [p.returncode for p in procs] == [0, 0, 0], log.read_text()[-3000:]
    records = read_metrics(cfg.run_dir / "metrics" / "w2.jsonl")
    join = next(r for r in records if r["kind"] == "join")
    assert join["committed"] and join["healed"] and join["outer_step"] >= 3
    syncs = [r for r in records if r["kind"] == "sync" and r["committed"]]
    assert syncs and all(r["world_size"] == 3 for r in syncs)  # contributed afterwards
    assert audit_run(cfg.run_dir)["consistent"]
    return join
