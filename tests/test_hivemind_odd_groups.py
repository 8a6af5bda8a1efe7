"""Moshpit groups that the swarm does not divide into: 3 hivemind peers in groups of 2, through
``farlink train`` on loopback. One peer is always left out of a round; it skips that round's
averaging instead of waiting out the quorum timeout, and the run's last round is one group of
all three, so the run ends on one model."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from farlink.config import load_config
from farlink.train.audit import audit_run
from farlink.train.launcher import launch
from farlink.train.metrics import read_metrics


def test_three_peers_in_groups_of_two_end_on_one_model(tmp_path: Path, cache_dir: Path) -> None:
    # a short quorum timeout: a peer that waited for a group that cannot form would fail fast
    cfg = load_config(None, {
        "backend": "hivemind", "workers": 3, "group_size": 2, "min_replicas": 2,
        "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2,
        "steps": 20, "inner_steps": 10, "warmup_steps": 2, "quorum_timeout": 20,
        "run_dir": tmp_path / "run", "cache_dir": cache_dir})
    result = launch(cfg, show_progress=False)
    assert result.returncodes == [0, 0, 0]

    syncs = {w: [r for r in read_metrics(cfg.run_dir / "metrics" / f"{w}.jsonl")
                 if r["kind"] == "sync"] for w in ("w0", "w1", "w2")}
    skipped = [r for records in syncs.values() for r in records if r.get("skipped")]
    assert skipped, "3 peers in groups of 2: some peer must have been left out of a round"
    assert all(not r["committed"] and r["world_size"] == 1 for r in skipped)
    assert sum(w["skipped_rounds"] for w in result.summary["per_worker"].values()) == len(skipped)
    # the last round is one group of everyone, committed by each
    for records in syncs.values():
        assert records[-1]["committed"] and records[-1]["world_size"] == 3

    audit = audit_run(cfg.run_dir)  # every committed round: one state, none missing
    assert audit["consistent"] and audit["outer_steps"] == 2, audit
    ended = result.summary["final_replicas"]
    assert ended["consistent"] and ended["holders"] == ["w0", "w1", "w2"]
    models = [load_file(str(p)) for p in sorted((cfg.run_dir / "final").glob("w*.safetensors"))]
    assert len(models) == 3
    for other in models[1:]:
        assert all((other[name] == models[0][name]).all() for name in models[0])
