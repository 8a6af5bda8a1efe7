"""Replica groups of two ranks that arrive while a run is under way: a fresh one, and one whose
rank was SIGKILLed, both healing from a live replica group.

Real processes: a torchft Lighthouse and three replica groups, each a ``torchrun`` of 2 ranks
sharding a GPT with FSDP2 (Gloo). Replica groups 0 and 1 train; after their first committed round
replica group 2 starts with ``farlink join --ranks-per-worker 2`` (from the run's config), which
starts the replica group's ranks itself: each of its ranks receives its own shard from the same
rank of a live replica group through torchft's healing, then the replica group trains and
contributes to every later round.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procfs import replica_group_ranks

from farlink.bench.churn import committed_outer_steps
from farlink.config import load_config
from farlink.robust.auth import run_authenticator
from farlink.train.audit import audit_run
from farlink.train.launcher import _stop_all, spawn_worker, write_run_config
from farlink.train.lighthouse import Lighthouse
from farlink.train.metrics import read_metrics

pytest.importorskip("torchft")


@pytest.mark.slow  # three replica groups of two ranks: 47-60 s on an idle machine, 130 s at load 30
def test_a_fresh_replica_group_heals_its_shards_from_a_live_one_and_contributes(tmp_path: Path,
                                                                                cache_dir: Path):
    from farlink.data import prepare_data

    cfg = load_config(None, {
        "workers": 3, "ranks_per_worker": 2, "steps": 120, "inner_steps": 10, "warmup_steps": 10,
        "batch_size": 8, "vocab_size": 512, "seq_len": 64, "eval_batches": 2, "eval_every": 100,
        "min_replicas": 2, "join_timeout": 5, "heartbeat_timeout": 3, "pace_seconds": 0.2,
        "auth": "secret", "secret": "the-run-secret",  # each rank's ledger names who sent what
        "run_dir": tmp_path / "run", "cache_dir": cache_dir})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    lighthouse = Lighthouse(min_replicas=2, join_timeout=5, heartbeat_timeout=3,
                            log_path=tmp_path / "lighthouse.log",
                            authenticator=run_authenticator(cfg, "gate", verifier=True)).start()
    procs = [spawn_worker(cfg, i, lighthouse.address, False) for i in range(2)]
    try:
        deadline = time.time() + 300
        while committed_outer_steps(cfg.run_dir) < 1:
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                "the first two replica groups made no progress"
            time.sleep(0.5)
        with open(tmp_path / "join.log", "wb") as log:  # the command a person would type
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "farlink.cli", "join", "--lighthouse", lighthouse.address,
                 "--config", str(cfg.run_dir / "config.toml"), "--index", "2",
                 "--ranks-per-worker", "2"],
                stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "FARLINK_SECRET": cfg.secret, "OMP_NUM_THREADS": "1"}))
        for proc in procs:
            proc.wait(timeout=400)
    finally:
        _stop_all(procs)
        lighthouse.stop()
    logs = [(cfg.run_dir / "logs" / f"w{i}.log").read_text()[-3000:] for i in range(2)]
    logs.append((tmp_path / "join.log").read_text()[-3000:])
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    records = read_metrics(cfg.run_dir / "metrics" / "w2.jsonl")
    join = next(r for r in records if r["kind"] == "join")
    # it healed (both ranks: the fingerprint spans every rank's shard) at the live replica groups'
    # step
    assert join["committed"] and join["healed"] and 2 <= join["outer_step"] <= 10, join
    assert join["step"] == 10 * join["outer_step"]
    member = {r["outer_step"]: r["fingerprint"]
              for r in read_metrics(cfg.run_dir / "metrics" / "w0.jsonl")
              if r["kind"] == "sync" and r["committed"]}
    assert member[join["outer_step"]] == join["fingerprint"]
    # then it trained and took part in every later round, all three replica groups on one model
    syncs = [r for r in records if r["kind"] == "sync" and r["committed"]]
    assert syncs and all(r["world_size"] == 3 for r in syncs), syncs
    assert [r["outer_step"] for r in syncs] == list(range(join["outer_step"] + 1, 13))
    ends = {i: [r for r in read_metrics(cfg.run_dir / "metrics" / f"w{i}.jsonl")
                if r["kind"] == "end"][-1] for i in range(3)}
    assert len({e["fingerprint"] for e in ends.values()}) == 1, ends
    assert all(e["finished"] and e["outer_step"] == 12 for e in ends.values()), ends
    # the newcomer's tokens count: every rank of the live replica groups weighed its shard of each
    # later round by the newcomer's tokens (its own inner steps only, not the healed ones)
    assert ends[2]["tokens"] == 8 * 64 * (120 - join["step"]), ends[2]
    for name in ("w0.json", "w0.rank1.json", "w1.json", "w1.rank1.json"):
        newcomer = json.loads((cfg.run_dir / "ledger" / name).read_text())["peers"]["w2"]
        assert newcomer["tokens_accepted"] == ends[2]["tokens"], (name, newcomer)
        # its join round too, at zero weight: it only received
        assert newcomer["updates_accepted"] == len(syncs) + 1, (name, newcomer)
    audit = audit_run(cfg.run_dir)
    assert audit["consistent"] and not audit["missing_steps"], audit


# a replica group killed and restarted while the other trains 24 rounds: 4 min at load 30
@pytest.mark.slow
def test_a_replica_group_whose_rank_is_sigkilled_restarts_from_its_checkpoint_and_heals(
        tmp_path: Path, cache_dir: Path):
    """One rank of replica group 1 is SIGKILLed mid-run: torchrun ends the replica group, replica
    group 0 goes on alone (min_replicas 1), and ``farlink join --resume --ranks-per-worker 2``
    brings replica group 1 back: it resumes from its own newest checkpoint, then heals each shard
    from replica group 0, which is ahead. No committed round is lost and both replica groups end on
    one model."""
    from farlink.data import prepare_data

    cfg = load_config(None, {
        "workers": 2, "ranks_per_worker": 2, "steps": 240, "inner_steps": 10,
        "warmup_steps": 10, "batch_size": 8, "vocab_size": 512, "seq_len": 64,
        "eval_batches": 2, "eval_every": 100, "min_replicas": 1, "join_timeout": 5,
        "heartbeat_timeout": 3, "pace_seconds": 0.3,
        "run_dir": tmp_path / "run", "cache_dir": cache_dir})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    lighthouse = Lighthouse(min_replicas=1, join_timeout=5, heartbeat_timeout=3,
                            log_path=tmp_path / "lighthouse.log").start()
    procs = [spawn_worker(cfg, i, lighthouse.address, False) for i in range(2)]
    try:
        deadline = time.time() + 300
        while not (cfg.run_dir / "checkpoints" / "w1" / "step-0000020").is_dir():
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                "the replica groups made no progress"
            time.sleep(0.2)
        victims = replica_group_ranks(procs[1].pid, b"farlink.worker")
        assert len(victims) == 2, victims
        os.kill(max(victims), signal.SIGKILL)  # one rank of replica group 1, mid-run
        assert procs[1].wait(timeout=60) != 0  # torchrun ended the whole replica group
        with open(tmp_path / "rejoin.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "farlink.cli", "join", "--lighthouse", lighthouse.address,
                 "--config", str(cfg.run_dir / "config.toml"), "--index", "1", "--resume",
                 "--ranks-per-worker", "2"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        for proc in (procs[0], procs[2]):
            proc.wait(timeout=400)
    finally:
        _stop_all(procs)
        lighthouse.stop()
    logs = [(cfg.run_dir / "logs" / "w0.log").read_text()[-3000:],
            (tmp_path / "rejoin.log").read_text()[-3000:]]
    assert [procs[0].returncode, procs[2].returncode] == [0, 0], logs
    survivor = read_metrics(cfg.run_dir / "metrics" / "w0.jsonl")
    restarted = read_metrics(cfg.run_dir / "metrics" / "w1.jsonl")
    # the other replica group went on alone while replica group 1 was down
    alone = [r for r in survivor if r["kind"] == "sync" and r["committed"]
             and r["world_size"] == 1]
    assert alone, "replica group 0 waited for the killed replica group instead of going on"
    # replica group 1 resumed from its own checkpoint (every rank's part), not from the initial
    # state
    resume = next(r for r in restarted if r["kind"] == "resume")
    assert resume["path"] is not None and resume["outer_step"] >= 2, resume
    assert not resume["fell_back"]
    # ... then healed from replica group 0, ahead of it, and took part in every round after
    join = next(r for r in restarted if r["kind"] == "join")
    assert join["committed"] and join["healed"] and join["outer_step"] > resume["outer_step"]
    held = {r["outer_step"]: r["fingerprint"] for r in survivor
            if r["kind"] == "sync" and r["committed"]}
    assert held[join["outer_step"]] == join["fingerprint"]
    later = [r for r in restarted if r["kind"] == "sync" and r["committed"]
             and r["time"] > join["time"]]
    assert later and all(r["world_size"] == 2 for r in later), later
    # nothing committed lost: every round of the run committed once, one model at the end
    assert sorted(held) == list(range(1, 25)), sorted(held)
    ends = [[r for r in records if r["kind"] == "end"][-1] for records in (survivor, restarted)]
    assert all(e["finished"] and e["outer_step"] == 24 for e in ends), ends
    assert ends[0]["fingerprint"] == ends[1]["fingerprint"]
    audit = audit_run(cfg.run_dir)
    assert audit["consistent"] and not audit["missing_steps"], audit
