"""Churn: real worker processes killed with SIGKILL at a given rate and restarted with --resume.

``ChaosDriver`` runs a job like ``farlink train`` does, but watches committed outer steps and, at
the requested rate (kills per 100 outer steps), SIGKILLs a random live worker and restarts it; the
restarted worker loads its last checkpoint and heals from a live peer in its first quorum. The
audit afterwards says whether replicas agreed at every step and how much committed progress was
lost (target: none). ``farlink bench churn`` compares kill rates side by side.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from farlink.bench.report import plot_curves, write_json
from farlink.bench.runner import set_aside_earlier_runs
from farlink.config import RunConfig, load_config
from farlink.train.audit import audit_run
from farlink.train.launcher import _stop_all, spawn_worker, summarize, write_run_config
from farlink.train.lighthouse import Lighthouse
from farlink.train.metrics import read_metrics


def worker_records(run_dir: Path) -> list[dict]:
    """Every metrics record of every worker of ``run_dir``."""
    return [r for path in sorted((run_dir / "metrics").glob("w*.jsonl"))
            for r in read_metrics(path)]


def last_committed_outer_step(records: list[dict]) -> int:
    """The highest outer step committed in ``records`` (0: none yet)."""
    return max((r["outer_step"] for r in records if r["kind"] == "sync" and r.get("committed")),
               default=0)


def committed_outer_steps(run_dir: Path) -> int:
    return last_committed_outer_step(worker_records(run_dir))


def run_with_churn(cfg: RunConfig, kills_per_100: float, max_kills: int, seed: int = 0,
                   timeout: float = 1800.0) -> dict:
    from farlink.data import prepare_data

    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    rng = random.Random(seed)
    lighthouse = Lighthouse(cfg.host, min_replicas=cfg.min_replicas, join_timeout=cfg.join_timeout,
                            heartbeat_timeout=cfg.heartbeat_timeout,
                            log_path=cfg.run_dir / "lighthouse.log").start()
    procs = {i: spawn_worker(cfg, i, lighthouse.address, resume=False) for i in range(cfg.workers)}
    every = 100.0 / kills_per_100 if kills_per_100 > 0 else float("inf")
    # kills fall in the middle of each interval of `every` rounds, so a run of exactly
    # 100 / rate rounds still sees its kill (at the interval's end it would be past the last)
    next_kill, kills, events = every / 2, 0, []
    deadline = time.time() + timeout
    try:
        while any(p.poll() is None for p in procs.values()):
            if time.time() > deadline:
                raise TimeoutError(f"churn run did not finish within {timeout:.0f}s")
            step = committed_outer_steps(cfg.run_dir)
            total_rounds = cfg.steps // cfg.inner_steps
            if kills < max_kills and step >= next_kill and step < total_rounds - 1:
                alive = [i for i, p in procs.items() if p.poll() is None]
                victim = rng.choice(alive)
                os.kill(procs[victim].pid, signal.SIGKILL)
                procs[victim].wait()
                events.append({"kill": victim, "outer_step": step, "time": time.time()})
                kills += 1
                next_kill += every
                procs[victim] = spawn_worker(cfg, victim, lighthouse.address, resume=True,
                                             join=True)
            time.sleep(0.3)
    finally:
        _stop_all(list(procs.values()))
        lighthouse.stop()
    audit = audit_run(cfg.run_dir)
    return {"kills": kills, "events": events, "audit": audit, "summary": summarize(cfg),
            "returncodes": [p.returncode for p in procs.values()]}


def run(out: Path, rates: list[float], steps: int, inner_steps: int, workers: int) -> dict:
    set_aside_earlier_runs(out)
    rows, series = [], {}
    for rate in rates:
        cfg = load_config(None, {
            "steps": steps, "inner_steps": inner_steps, "workers": workers, "min_replicas": 2,
            "join_timeout": 10, "heartbeat_timeout": 3, "round_timeout": 20,
            # a checkpoint every round (what a restart resumes from), a loss point every 5
            "eval_every": 5,
            "run_dir": out / "runs" / f"kills-{rate:g}",
        })
        rounds = steps // inner_steps
        result = run_with_churn(cfg, rate, max_kills=max(0, int(rate * rounds / 100 + 0.999)))
        a = result["audit"]
        rows.append({"kills_per_100_outer_steps": rate, "kills": result["kills"],
                     "killed_at_outer_steps": [e["outer_step"] for e in result["events"]],
                     "outer_steps": a["outer_steps"], "consistent": a["consistent"],
                     "lost_committed_steps": a["lost_committed_steps"],
                     "lost_committed_tokens": a["lost_committed_steps"] * inner_steps
                     * cfg.tokens_per_step * workers,
                     "final_heldout_loss": result["summary"]["final_heldout_loss"],
                     "returncodes": result["returncodes"]})
        series[f"{rate:g} kills/100 rounds"] = [
            (e["tokens"], e["loss"]) for e in result["summary"]["evals"]]
    write_json(out / "churn.json", "churn", rows, {"steps": steps, "inner_steps": inner_steps})
    plot_curves(out / "churn_loss_vs_tokens.png", series, "tokens (evaluating worker)",
                "held-out loss", "held-out loss under churn")
    return {"rows": rows}


def run_long(out: Path, kills: int, lighthouse_kills: int, corruptions: int, steps: int,
             inner_steps: int, workers: int, seed: int = 0) -> dict:
    """The long mode (:mod:`farlink.bench.churn_long`): its figures go into ``churn.json`` under
    ``long``, next to the kill-rate rows, and a timeline PNG."""
    import json

    from farlink.bench.churn_long import plot_timeline, run_long_churn

    set_aside_earlier_runs(out)

    cfg = load_config(None, {
        "steps": steps, "inner_steps": inner_steps, "workers": workers, "min_replicas": 2,
        # a live worker slowed by a busy machine is waited for (a dead one stops heartbeating
        # and is dropped after 2 s): one left out of the last round would wait for a quorum
        # that never comes
        "join_timeout": 30, "heartbeat_timeout": 2, "round_timeout": 15, "quorum_timeout": 90,
        # every inner step logged: the driver aims its kills by the workers' own records
        "log_every": 1, "eval_every": 10, "run_dir": out / "runs" / "long",
    })
    started = time.time()
    result = run_long_churn(cfg, kills, lighthouse_kills, corruptions, seed=seed)
    result["seed"] = seed
    result["cpus"] = os.cpu_count()
    path = out / "churn.json"
    doc = json.loads(path.read_text()) if path.exists() else None
    if doc is None:
        write_json(path, "churn", [], {"steps": steps, "inner_steps": inner_steps})
        doc = json.loads(path.read_text())
    doc["long"] = {k: v for k, v in result.items() if k != "evals"}
    doc["long"]["bench_wall_s"] = round(time.time() - started, 1)
    path.write_text(json.dumps(doc, indent=1, default=str))
    plot_timeline(out / "churn_long_timeline.png", result, cfg.run_dir)
    return result
