"""Steady-state rounds of a finished run, read from its workers' metric logs.

The planner predicts a round of a long run; a benchmark run is short, and its first round also
pays one-off costs (process-group setup: TCP and Gloo connections over the emulated WAN, several
round trips each). So the comparison uses the rounds after the first one: time, compute share,
the worker's own per-sync work, and how unevenly the workers computed between syncs (straggler
spread: per round, or per fragment's sync where a round holds several). Every
figure here is a difference of cumulative counters the workers log, so evaluation and
checkpoint time (logged apart) never enters: ``utilization`` is the planner's round utilization,
compute / (compute + blocked in rounds). A run's utilization over all its wall-clock is
``compute_utilization`` in the run's summary.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from farlink.train.metrics import read_metrics


@dataclass(frozen=True)
class SteadyRounds:
    """Means over workers of the rounds after the first one."""

    rounds: float  # rounds in the measured window (per worker)
    round_seconds: float  # wall-clock per round: compute plus time blocked in rounds
    utilization: float  # compute / (compute + blocked): the round's, not the run's wall-clock
    step_seconds: float  # inner compute per step
    local_seconds: float  # per sync: round time not spent on the quorum or the wire
    quorum_seconds: float  # per sync: waiting for the quorum (absorbs stragglers)
    network_seconds: float  # per sync: inside the collectives
    straggler_sigma: float  # log-sd of per-round compute across workers
    first_round_extra_seconds: float  # how much longer the first round took than the others

    def to_dict(self) -> dict:
        return asdict(self)


def _records(path: Path) -> list[dict]:
    return [r for r in read_metrics(path) if r["kind"] in ("step", "sync") and "compute_s" in r]


def sync_points(records: list[dict], steps_per_round: int, syncs_per_round: int) -> dict:
    """Cumulative compute at each of a worker's syncs after the first round, where a round
    holds several (Streaming DiLoCo's fragments); empty otherwise. A sync waits for the slowest
    worker since the last sync, so the straggler spread that prices those waits is that of the
    compute between syncs (a few steps: wider than a whole round's, whose sum averages it out);
    the model's straggler factor applies per synchronization."""
    if syncs_per_round <= 1:
        return {}
    return {r["step"]: r["compute_s"] for r in records
            if r["kind"] == "sync" and r["step"] >= steps_per_round}


def steady_rounds(run_dir: Path, steps_per_round: int, syncs_per_round: int = 1) -> SteadyRounds:
    """Rounds of ``steps_per_round`` inner steps (``syncs_per_round`` collectives each) after the
    first, averaged over the run's workers. Raises ValueError when the logs hold fewer than two
    rounds after the first (nothing steady to measure)."""
    logs = sorted((run_dir / "metrics").glob("w*.jsonl"))
    if not logs:
        raise ValueError(f"no worker metrics under {run_dir}")
    per_worker, boundaries = [], []
    for path in logs:
        records = _records(path)
        ends = {r["step"]: r for r in records if r["step"] % steps_per_round == 0}
        after_first = [s for s in sorted(ends) if s >= steps_per_round]
        if len(after_first) < 2:
            raise ValueError(f"{path.name}: fewer than two logged rounds after the first")
        a, b = ends[after_first[0]], ends[after_first[-1]]
        steps = b["step"] - a["step"]
        compute, blocked = b["compute_s"] - a["compute_s"], b["comm_s"] - a["comm_s"]
        rounds = steps / steps_per_round
        syncs = rounds * syncs_per_round
        split = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in ("quorum_s", "network_s", "rounds_s")}
        first = a["compute_s"] + a["comm_s"]
        later = (compute + blocked) / rounds
        per_worker.append({
            "rounds": rounds,
            "round_seconds": later,
            "utilization": compute / (compute + blocked),
            "step_seconds": compute / steps,
            "local_seconds": max(0.0, split["rounds_s"] - split["quorum_s"] - split["network_s"])
            / syncs,
            "quorum_seconds": split["quorum_s"] / syncs,
            "network_seconds": split["network_s"] / syncs,
            "first_round_extra_seconds": first / (a["step"] / steps_per_round) - later,
        })
        boundaries.append(sync_points(records, steps_per_round, syncs_per_round)
                          or {s: ends[s]["compute_s"] for s in after_first})
    common = sorted(set.intersection(*(set(b) for b in boundaries)))
    deviations = []
    for s0, s1 in zip(common, common[1:]):
        work = [b[s1] - b[s0] for b in boundaries]
        mean = statistics.fmean(work)
        deviations += [math.log(w / mean) for w in work if w > 0 and mean > 0]
    sigma = statistics.pstdev(deviations) if len(deviations) > 1 else 0.0
    mean = {k: statistics.fmean(w[k] for w in per_worker) for k in per_worker[0]}
    return SteadyRounds(straggler_sigma=sigma, **mean)
