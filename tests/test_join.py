"""``farlink join``: a new worker joins a running job, heals from a live peer (hash-verified)
before its first inner step, and contributes from the next round on."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from farlink.bench.churn import committed_outer_steps
from farlink.config import load_config
from farlink.train.audit import audit_run
from farlink.train.launcher import _stop_all, spawn_worker, write_run_config
from farlink.train.lighthouse import Lighthouse
from farlink.train.metrics import read_metrics


def test_join_heals_from_live_peers_and_contributes(tmp_path: Path, cache_dir: Path) -> None:
    from farlink.data import prepare_data

    cfg = load_config(None, {"vocab_size": 512, "seq_len": 64, "batch_size": 4,
                             "eval_batches": 2, "workers": 3, "steps": 300, "inner_steps": 10, "eval_every": 10,
                             "warmup_steps": 5, "min_replicas": 2, "join_timeout": 5,
                             "run_dir": tmp_path / "run", "cache_dir": cache_dir})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    lighthouse = Lighthouse(min_replicas=2, join_timeout=5).start()
    procs = [spawn_worker(cfg, i, lighthouse.address, False) for i in range(2)]
    try:
        deadline = time.time() + 300
        while committed_outer_steps(cfg.run_dir) < 2:
            assert time.time() < deadline, "the first two workers made no progress"
            time.sleep(0.5)
        joiner = subprocess.Popen(
            [sys.executable, "-m", "farlink.cli", "join", "--lighthouse", lighthouse.address,
             "--config", str(cfg.run_dir / "config.toml"), "--index", "2"],
            stdout=open(tmp_path / "join.log", "wb"), stderr=subprocess.STDOUT)
        procs.append(joiner)
        for p in procs:
            p.wait(timeout=600)
    finally:
        _stop_all(procs)
        lighthouse.stop()
    assert [p.returncode for p in procs] == [0, 0, 0], (tmp_path / "join.log").read_text()[-3000:]
    records = read_metrics(cfg.run_dir / "metrics" / "w2.jsonl")
    join = next(r for r in records if r["kind"] == "join")
    assert join["committed"] and join["healed"] and join["outer_step"] >= 3
    assert join["step"] >= 20  # adopted the live peers' schedule position
    syncs = [r for r in records if r["kind"] == "sync" and r["committed"]]
    assert syncs and all(r["world_size"] == 3 for r in syncs)  # contributed afterwards
    audit = audit_run(cfg.run_dir)
    assert audit["consistent"], audit
    joined_fp = {r["outer_step"]: r["fingerprint"]
                 for r in read_metrics(cfg.run_dir / "metrics" / "w0.jsonl")
                 if r["kind"] == "sync" and r["committed"]}
    assert joined_fp[join["outer_step"]] == join["fingerprint"]
