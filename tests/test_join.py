"""``farlink join``: a new worker joins a running job, heals from a live peer (hash-verified)
before its first inner step, and contributes from the next round on."""

from __future__ import annotations

from pathlib import Path

import pytest
from join_scenario import two_workers_then_join

from farlink.config import load_config
from farlink.train.launcher import write_run_config
from farlink.train.lighthouse import Lighthouse
from farlink.train.metrics import read_metrics


@pytest.mark.slow  # the same join-and-heal runs with --auth in test_trust_integration
def test_join_heals_from_live_peers_and_contributes(tmp_path: Path, cache_dir: Path) -> None:
    from farlink.data import prepare_data

    cfg = load_config(None, {"vocab_size": 512, "seq_len": 64, "batch_size": 4,
                             "eval_batches": 2, "workers": 3, "steps": 300, "inner_steps": 10, "eval_every": 10,
                             "warmup_steps": 5, "min_replicas": 2, "join_timeout": 5,
                             "run_dir": tmp_path / "run", "cache_dir": cache_dir})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    lighthouse = Lighthouse(min_replicas=2, join_timeout=5).start()
    join = two_workers_then_join(cfg, lighthouse, tmp_path / "join.log")
    assert join["step"] >= 20  # adopted the live peers' schedule position
    joined_fp = {r["outer_step"]: r["fingerprint"]
                 for r in read_metrics(cfg.run_dir / "metrics" / "w0.jsonl")
                 if r["kind"] == "sync" and r["committed"]}
    assert joined_fp[join["outer_step"]] == join["fingerprint"]
