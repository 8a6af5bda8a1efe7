"""``farlink bench replica-groups``: what a replica group of several ranks costs, against one rank
and plain torch.

Four measurements of the same model, batch and data, one replica group (one worker) each, so only
what happens inside a replica group is timed: a plain PyTorch loop (one process), farlink with one
rank, and farlink with ``--ranks-per-worker K`` under ``--sharding fsdp`` and ``--sharding ddp`` (K
torchrun ranks). Every rank takes ``batch_size`` rows, so a replica group of K ranks trains a K
times larger batch (weak scaling, as one adds GPUs to a node). Reported per configuration: tokens/s
of the replica group and per rank (steady-state steps only, from the workers' metrics), per-rank
throughput against one rank (the target: within 15%), and farlink's overhead against the plain loop
(the target: <= 5%).

Throughput on a shared machine is only as good as the cores it gets: the load average before and
after each measurement is recorded next to it, and K ranks need K free cores to run in parallel.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from farlink.bench.overhead import PLAIN_LOOP, farlink_tokens_per_s
from farlink.bench.report import pyplot, save_figure, write_json
from farlink.bench.runner import set_aside_earlier_runs

TARGET_PER_RANK = 0.15  # per-rank tokens/s of a K-rank replica group within 15% of one rank
TARGET_OVERHEAD = 0.05  # farlink with one rank within 5% of a plain torch loop


def load_average() -> float:
    """The 1-minute load average (how many runnable processes shared the cores)."""
    return round(os.getloadavg()[0], 2)


def measure(name: str, ranks: int, tokens_per_s) -> dict:  # noqa: ANN001 - a thunk
    before = load_average()
    rate = tokens_per_s()
    return {"config": name, "ranks": ranks, "replica_group_tokens_per_s": round(rate, 1),
            "tokens_per_s_per_rank": round(rate / ranks, 1), "load_before": before,
            "load_after": load_average()}


def run(out: Path, steps: int, model: str, ranks: int, batch_size: int, repeats: int = 1,
        cache_dir: Path | None = None) -> dict:
    set_aside_earlier_runs(out)
    from farlink.config import load_config
    from farlink.train.launcher import launch

    def config(name: str, **overrides):  # noqa: ANN202
        values = {"workers": 1, "steps": steps, "model": model, "log_every": 1,
                  "inner_steps": min(50, steps), "warmup_steps": min(30, steps // 2),
                  "batch_size": batch_size, "eval_every": 1000,
                  "run_dir": out / "runs" / name, **overrides}
        if cache_dir is not None:
            values["cache_dir"] = cache_dir
        return load_config(None, values)

    def plain() -> float:
        cfg = config("plain")
        proc = subprocess.run([sys.executable, "-c", PLAIN_LOOP, cfg.model_dump_json()],
                              capture_output=True, text=True, check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"]

    def farlink(name: str, **overrides) -> float:
        cfg = config(name, **overrides)
        result = launch(cfg, show_progress=False)
        if any(result.returncodes):
            raise RuntimeError(f"the {name} run failed; see {cfg.run_dir / 'logs'}")
        return farlink_tokens_per_s(cfg.run_dir)

    rows: list[dict] = []
    for repeat in range(repeats):  # alternated, so a burst of load hits every configuration
        group = [measure("plain torch", 1, plain),
                 measure("farlink, 1 rank", 1, lambda r=repeat: farlink(f"k1-{r}"))]
        for sharding in ("fsdp", "ddp"):
            group.append(measure(
                f"farlink, {ranks} ranks {sharding}", ranks,
                lambda s=sharding, r=repeat: farlink(f"k{ranks}-{s}-{r}", ranks_per_worker=ranks,
                                                     sharding=s, batch_size=batch_size * ranks)))
        one_rank = group[1]["tokens_per_s_per_rank"]
        for row in group:
            row["repeat"] = repeat
            row["per_rank_vs_one_rank"] = round(row["tokens_per_s_per_rank"] / one_rank, 3)
        group[1]["overhead_vs_plain"] = round(1 - group[1]["replica_group_tokens_per_s"]
                                              / group[0]["replica_group_tokens_per_s"], 3)
        rows += group

    def median_of(config: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["config"] == config)

    sited = sorted({r["config"] for r in rows if r["ranks"] > 1})
    summary = {
        "steps": steps, "model": model, "batch_size_per_rank": batch_size, "ranks": ranks,
        "repeats": repeats, "cpu_count": os.cpu_count(),
        "median_overhead_vs_plain": median_of("farlink, 1 rank", "overhead_vs_plain"),
        "overhead_target": TARGET_OVERHEAD, "per_rank_target": 1 - TARGET_PER_RANK,
        "median_per_rank_vs_one_rank": {c: median_of(c, "per_rank_vs_one_rank") for c in sited},
        "load_average_range": [min(r["load_before"] for r in rows),
                               max(r["load_after"] for r in rows)],
    }
    write_json(out / "replica_groups.json", "replica_groups", rows, summary)
    plot(out / "replica_groups.png", rows)
    return {"rows": rows, **summary}


def plot(path: Path, rows: list[dict]) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["config"] for r in rows]
    ax.scatter(names, [r["tokens_per_s_per_rank"] for r in rows], color="tab:blue")
    for r in rows:
        ax.annotate(f"load {r['load_before']:.1f}", (r["config"], r["tokens_per_s_per_rank"]),
                    ha="left", va="bottom", fontsize=7)
    ax.set_ylabel("tokens/s per rank")
    ax.set_title(f"one replica group on CPU, every repeat ({time.strftime('%Y-%m-%d')})")
    ax.tick_params(axis="x", labelsize=8)
    return save_figure(fig, path)
