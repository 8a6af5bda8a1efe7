"""Time to a held-out loss on a link profile: what a user picking a method decides by.

The frontier measures each method's held-out loss against tokens (its mean curve over seeds) and
the compute of an inner step (forward and backward, timed in every run on this machine). The
work of a step is the same in every method (one model, one batch), so one compute time serves
them all: the median over the runs (on a shared machine a run's own time says more about the
load it met than about its method; each run's is kept in the table). What a
link adds is priced by the planner (:func:`farlink.plan.predict_round`): the method's payload as
its codec encodes it (the algorithm's ``wire_spec``), the round's collectives on the profile's
bandwidth and latency, and the part of them no inner step computes through (Streaming's
fragments overlap tau steps, a delayed outer step a whole round). So per profile and method:

    seconds per inner step = round_seconds / steps_per_round      (planned, on measured compute)
    steps to the target    = first crossing of the measured curve  (linear between evaluations)
    time to the target     = their product; None when the run never reached the target

Targets: DDP's final held-out loss, the best local-update method's, and DiLoCo fp32's. Which
numbers are measured and which planned is written into every row.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PROFILES = ("datacenter", "cross-region", "intercontinental", "home")


def steps_to_loss(evals: list[dict], target: float) -> float | None:
    """The inner step at which the curve ``evals`` (``step``, ``loss``, in order) first reaches
    ``target``, linear between evaluations (from the first one: before it nothing is known);
    None if it never does."""
    previous = None
    for point in evals:
        if point["loss"] <= target:
            if previous is None or previous["loss"] <= target:
                return float(point["step"])
            frac = (previous["loss"] - target) / (previous["loss"] - point["loss"])
            return previous["step"] + frac * (point["step"] - previous["step"])
        previous = point
    return None


def price(row: dict, profile: str, step_seconds: float) -> Any:  # noqa: ANN401 - RoundPrediction
    """The planner's round of ``row``'s configuration on ``profile`` at ``step_seconds``."""
    from farlink.config import load_config
    from farlink.links import get_profile
    from farlink.plan import predict_round
    from farlink.sync import algorithm_class

    cfg = load_config(None, row["config"])
    algo = algorithm_class(cfg.algorithm)
    codec = algo.wire_spec(cfg).removesuffix("+ef")
    codec = "fp32" if codec == "none" else codec
    link = get_profile(profile)
    fragmented = algo.capabilities.fragments
    return predict_round(
        cfg.algorithm, cfg.workers, step_seconds, link.bandwidth_mbit * 1e6,
        link.latency_ms / 1e3, jitter_s=link.jitter_ms / 1e3, loss=link.loss,
        n_params=row["params"], inner_steps=cfg.inner_steps, codec=codec,
        fragments=cfg.fragments if fragmented else 1,
        overlap_steps=cfg.overlap_steps if fragmented else None,
        outer_overlap=getattr(cfg, "outer_overlap", "none"))


def targets(rows: list[dict]) -> dict[str, float]:
    by_label = {r["label"]: r for r in rows}
    out = {}
    if "ddp" in by_label:
        out["ddp_final"] = by_label["ddp"]["final_heldout_loss"]
    local = [r for r in rows if not r["label"].startswith("ddp")]
    if local:
        best = min(local, key=lambda r: r["final_heldout_loss"])
        out[f"best_local_final ({best['label']})"] = best["final_heldout_loss"]
    if "diloco-fp32" in by_label:
        out["diloco_fp32_final"] = by_label["diloco-fp32"]["final_heldout_loss"]
    return out


def table(rows: list[dict], profiles: tuple[str, ...] = PROFILES,
          step_seconds: float | None = None) -> dict[str, Any]:
    """Per profile: every method's planned round and its time to each target, and the winner
    of each target. ``step_seconds``: the compute of one inner step (default: the median of the
    rows' measured ones)."""
    goals = targets(rows)
    measured = sorted(r["compute_s_per_step"] for r in rows if "compute_s_per_step" in r)
    if step_seconds is None:
        if not measured:
            raise ValueError("no row has a measured compute time (compute_s_per_step)")
        step_seconds = measured[len(measured) // 2]
    out: dict[str, Any] = {"targets": goals, "profiles": {}, "measured": (
        "held-out loss curves (mean over seeds) and compute seconds per inner step, both from "
        "the runs of this table on this machine; one compute time for every method, the median "
        "of the runs' (the same forward and backward in each)"), "planned": (
        "each round's communication on the profile (farlink.plan.predict_round with the "
        "method's encoded payload), hence seconds per inner step and time to target")}
    for profile in profiles:
        entries = []
        for r in rows:
            pred = price(r, profile, step_seconds)
            per_step = pred.round_seconds / pred.steps_per_round
            entry = {"label": r["label"], "compute_s_per_step": step_seconds,
                     "compute_s_per_step_of_its_runs": r.get("compute_s_per_step"),
                     "round_seconds_planned": pred.round_seconds,
                     "exposed_comm_seconds_planned": pred.exposed_comm_seconds,
                     "utilization_planned": pred.utilization,
                     "seconds_per_step": per_step, "time_to_target_s": {}}
            for name, goal in goals.items():
                steps = steps_to_loss(r["evals"], goal)
                entry["time_to_target_s"][name] = None if steps is None else steps * per_step
            entries.append(entry)
        winners = {}
        for name in goals:
            timed = [(e["time_to_target_s"][name], e["label"]) for e in entries
                     if "time_to_target_s" in e and e["time_to_target_s"][name] is not None]
            winners[name] = min(timed)[1] if timed else None
        out["profiles"][profile] = {"rows": entries, "winner": winners}
    out["compute_s_per_step"] = step_seconds
    out["compute_s_per_step_of_the_runs"] = {"min": measured[0], "median": measured[
        len(measured) // 2], "max": measured[-1]} if measured else None
    return out


def plot(path: Path, result: dict[str, Any]) -> Path:
    """One panel per profile: each method's time to each target (log scale; missing bars: the
    run never reached it)."""
    from farlink.bench.report import pyplot, save_figure

    plt = pyplot()
    profiles = list(result["profiles"])
    fig, axes = plt.subplots(1, len(profiles), figsize=(4.2 * len(profiles), 4.8), sharey=True)
    axes = [axes] if len(profiles) == 1 else list(axes)
    goals = list(result["targets"])
    for ax, profile in zip(axes, profiles):
        rows = [e for e in result["profiles"][profile]["rows"] if "time_to_target_s" in e]
        labels = [e["label"] for e in rows]
        height = 0.8 / max(1, len(goals))
        for g, goal in enumerate(goals):
            values = [e["time_to_target_s"][goal] for e in rows]
            ys = [i + g * height for i in range(len(rows))]
            ax.barh([y for y, v in zip(ys, values) if v is not None],
                    [v for v in values if v is not None], height=height,
                    label=goal if ax is axes[0] else None)
        ax.set_yticks([i + 0.4 - height / 2 for i in range(len(rows))])
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("seconds to target (planned link, measured compute)")
        ax.set_title(profile)
        ax.grid(alpha=0.3, which="both", axis="x")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return save_figure(fig, path)


def summary(result: dict[str, Any]) -> list[str]:
    """One line per profile and target: the winner and its time."""
    lines = []
    for profile, body in result["profiles"].items():
        for goal, label in body["winner"].items():
            time = next((e["time_to_target_s"][goal] for e in body["rows"]
                         if e["label"] == label), math.nan) if label else math.nan
            lines.append(f"{profile:16s} {goal:40s} {label or 'none reached it'} "
                         f"({time:.1f} s)")
    return lines
