"""Trust with real processes: a peer holding the wrong run secret, and a peer sending NaN/huge
updates, are rejected by the honest peers, who keep agreeing and learning."""

from __future__ import annotations

import json
from pathlib import Path

from farlink.config import load_config
from farlink.train.audit import audit_run
from farlink.train.launcher import _stop_all, spawn_worker, summarize, write_run_config
from farlink.train.lighthouse import Lighthouse
from farlink.train.metrics import read_metrics

BASE = {"vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2, "workers": 3,
        "steps": 30, "inner_steps": 10, "warmup_steps": 5, "join_timeout": 10,
        "auth": "secret", "codec": "int8"}


def run_three(cfg, envs: dict[int, dict[str, str]]) -> list[int]:  # noqa: ANN001
    from farlink.data import prepare_data

    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    lighthouse = Lighthouse(min_replicas=3, join_timeout=10).start()
    procs = [spawn_worker(cfg, i, lighthouse.address, False, envs.get(i)) for i in range(3)]
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        _stop_all(procs)
        lighthouse.stop()
    return [p.returncode for p in procs]


def honest_fingerprints(run_dir: Path, workers: list[str]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for w in workers:
        for r in read_metrics(run_dir / "metrics" / f"{w}.jsonl"):
            if r["kind"] == "sync" and r["committed"]:
                out.setdefault(r["outer_step"], set()).add(r["fingerprint"])
    return out


def test_wrong_secret_peer_is_refused_and_run_goes_on(tmp_path: Path, cache_dir: Path) -> None:
    cfg = load_config(None, {**BASE, "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                             "secret": "the-run-secret"})
    codes = run_three(cfg, {2: {"FARLINK_SECRET": "a-wrong-secret"}})
    assert codes == [0, 0, 0]
    ledger = json.loads((cfg.run_dir / "ledger" / "w0.json").read_text())
    peers = ledger["peers"]
    # an unverifiable message has no trustworthy sender: it is booked under its rank
    assert "w2" not in peers
    assert peers["rank2"]["updates_rejected"] == 3 and peers["rank2"]["updates_accepted"] == 0
    assert peers["rank2"]["rejections"] == {"AuthError": 3}
    assert peers["w1"]["updates_accepted"] == 3
    fps = honest_fingerprints(cfg.run_dir, ["w0", "w1"])
    assert len(fps) == 3 and all(len(f) == 1 for f in fps.values())  # honest replicas agree
    evals = summarize(cfg)["evals"]
    assert evals[-1]["loss"] < 6.0


def test_nan_and_scaled_attackers_are_screened(tmp_path: Path, cache_dir: Path) -> None:
    cfg = load_config(None, {**BASE, "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                             "secret": "s", "attack": "scale:1000", "attackers": "2"})
    assert run_three(cfg, {}) == [0, 0, 0]
    ledger = json.loads((cfg.run_dir / "ledger" / "w0.json").read_text())["peers"]
    assert ledger["w2"]["updates_rejected"] == 3 and ledger["w2"]["updates_accepted"] == 0
    assert audit_run(cfg.run_dir)["consistent"]
