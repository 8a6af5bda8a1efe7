"""Chaos with real processes: SIGKILL random workers every few outer steps and restart them."""

from __future__ import annotations

from pathlib import Path

import pytest

from farlink.bench.churn import run_with_churn
from farlink.config import load_config


@pytest.mark.slow
def test_run_survives_repeated_sigkill_and_loses_no_committed_step(tmp_path: Path,
                                                                  cache_dir: Path) -> None:
    cfg = load_config(None, {
        "workers": 4, "steps": 360, "inner_steps": 20, "min_replicas": 2,
        "join_timeout": 8, "heartbeat_timeout": 2, "round_timeout": 15,
        "run_dir": tmp_path / "run", "cache_dir": cache_dir, "warmup_steps": 20,
    })
    # 18 outer rounds; a kill every 4 rounds -> 3 kills (bounded)
    result = run_with_churn(cfg, kills_per_100=25, max_kills=3, seed=1, timeout=1200)
    audit = result["audit"]
    assert result["kills"] == 3
    assert result["returncodes"] == [0, 0, 0, 0], result
    assert audit["consistent"], audit  # one fingerprint per outer step, none missing/repeated
    assert audit["lost_committed_steps"] == 0
    assert audit["outer_steps"] >= 18 - 1
    assert audit["last_eval_loss"] < audit["first_eval_loss"]
