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
    return joined(cfg)


def two_workers_then_join_in_threads(cfg: RunConfig, lighthouse: Lighthouse) -> dict:
    """:func:`two_workers_then_join` with the workers as threads of this process (the joiner a
    ``Worker`` built with ``joining=True``, as ``farlink join`` builds it) against
    ``lighthouse``; the same checks and the joiner's ``join`` record."""
    import threading

    from farlink.testing import in_threads
    from farlink.train.worker import Worker

    building = threading.Lock()  # a worker seeds the process's RNG, then builds its model
    ready = threading.Event()

    def work(index: int, _member: object) -> int:
        if index == 2:
            ready.wait(300)
        with building:
            worker = Worker(cfg, index, lighthouse.address, joining=index == 2)
        try:
            return worker.run()
        finally:
            worker.close()

    def watch() -> None:
        deadline = time.time() + 300
        while committed_outer_steps(cfg.run_dir) < 2 and time.time() < deadline:
            time.sleep(0.2)
        ready.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        codes = in_threads(work, dict.fromkeys(range(3)), timeout=300)
    finally:
        ready.set()
        lighthouse.stop()
    assert committed_outer_steps(cfg.run_dir) >= 2, "the first two workers made no progress"
    assert [codes[i] for i in range(3)] == [0, 0, 0]
    return joined(cfg)


def joined(cfg: RunConfig) -> dict:
    """The joiner's (w2's) ``join`` record, after checking that it healed, then took part in
    every later round with consistent replicas."""
    records = read_metrics(cfg.run_dir / "metrics" / "w2.jsonl")
    join = next(r for r in records if r["kind"] == "join")
    assert join["committed"] and join["healed"] and join["outer_step"] >= 3
    syncs = [r for r in records if r["kind"] == "sync" and r["committed"]]
    assert syncs and all(r["world_size"] == 3 for r in syncs)  # contributed afterwards
    assert audit_run(cfg.run_dir)["consistent"]
    return join
