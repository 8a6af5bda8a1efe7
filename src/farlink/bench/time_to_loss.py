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

import json
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


def price(row: dict, profile: str, step_seconds: float,
          n_params: float | None = None) -> Any:  # noqa: ANN401 - RoundPrediction
    """The planner's round of ``row``'s configuration on ``profile`` at ``step_seconds``, for a
    model of ``n_params`` parameters (default: the row's own)."""
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
        n_params=row["params"] if n_params is None else n_params, inner_steps=cfg.inner_steps, codec=codec,
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
          step_seconds: float | None = None, n_params: float | None = None) -> dict[str, Any]:
    """Per profile: every method's planned round and its time to each target, and the winner
    of each target. ``step_seconds``: the compute of one inner step (default: the median of the
    rows' measured ones); ``n_params``: the model size the links are priced at (default: each
    row's own, the size that was run)."""
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
            pred = price(r, profile, step_seconds, n_params)
            per_step = pred.round_seconds / pred.steps_per_round
            entry = {"label": r["label"], "compute_s_per_step": step_seconds,
                     "compute_s_per_step_of_its_runs": r.get("compute_s_per_step"),
                     "round_seconds_planned": pred.round_seconds,
                     "exposed_comm_seconds_planned": pred.exposed_comm_seconds,
                     "utilization_planned": pred.utilization,
                     "bytes_per_round_planned": pred.bytes_sent_per_round,
                     "seconds_per_step": per_step, "time_to_target_s": {}}
            entry["steps_to_target"] = {}
            for name, goal in goals.items():
                steps = steps_to_loss(r["evals"], goal)
                entry["steps_to_target"][name] = steps
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
    at = result.get("priced_at")
    xlabel = ("seconds to target (planned link and compute, measured steps)" if at else
              "seconds to target (planned link, measured compute)")
    title = f" at {at['model']}" if at else ""
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
        ax.set_title(f"{profile}{title}")
        ax.grid(alpha=0.3, which="both", axis="x")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.supxlabel(f"{xlabel}; no bar: never reached", fontsize=9)
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


def rows_of(documents: list[dict]) -> list[dict]:
    """The frontier rows of several result documents, one per label (the first document's row
    where two hold the same label: the frontier's files share their common runs)."""
    seen: dict[str, dict] = {}
    for doc in documents:
        for row in doc["rows"]:
            seen.setdefault(row["label"], row)
    return list(seen.values())


def priced_at(rows: list[dict], size: str, profiles: tuple[str, ...] = PROFILES,
              gpu: str = "h100", gpus_per_worker: int | None = None, mfu: float = 0.4,
              batch_tokens: int = 2**20) -> dict[str, Any]:
    """:func:`table` for a model of ``size`` (a planner size: ``125m``, ``1b``, ``7e9``): the
    compute of an inner step from the planner's FLOP model (6 N T / (F * mfu * g) on ``gpu``)
    and each method's bytes from its codec at that size; the steps to each target are those
    the rows' measured curves took. That assumes the steps-to-target of every method carry
    over from the size that was run to this one (their ratios, which decide the winner): a
    pricing, not a measurement, recorded as such in the result."""
    from farlink.plan import load_hardware, parse_model_size
    from farlink.plan import step_seconds as planned_step
    from farlink.plan.tables import lookup

    n_params, read = parse_model_size(size)
    card = lookup(load_hardware(), gpu, "gpu")
    gpus = gpus_per_worker or card.default_per_worker
    step = planned_step(n_params, batch_tokens, card, mfu, gpus)
    result = table(rows, profiles, step_seconds=step, n_params=n_params)
    for body in result["profiles"].values():
        for entry in body["rows"]:
            del entry["compute_s_per_step_of_its_runs"]  # the run's size, not this one
    run_sizes = sorted({r["params"] for r in rows})
    result.pop("compute_s_per_step_of_the_runs")
    result["priced_at"] = {
        "model": size, "n_params": n_params, "read_as": read, "gpu": gpu,
        "gpus_per_worker": gpus, "mfu": mfu, "batch_tokens_per_worker_step": batch_tokens,
        "compute_s_per_step": step, "measured_at_params": run_sizes}
    result["measured"] = (
        f"held-out loss curves (mean over seeds) of runs at {run_sizes} parameters: the inner "
        "steps each method took to reach each target")
    result["planned"] = (
        "compute per inner step from the planner's FLOP model (6 N T / (F * mfu * g)) and each "
        "round's communication on the profile with the method's codec at this size "
        "(farlink.plan.predict_round), hence seconds per step and time to target")
    result["assumes"] = (
        "the steps to each target measured at the run's size carry over to this size for every "
        "method (so do their ratios, which decide the winner): a pricing, not a measurement")
    return result


def write_priced(out: Path, name: str, sources: list[Path], sizes: list[str],
                 profiles: tuple[str, ...] = PROFILES, plot_too: bool = True,
                 **assumptions: Any) -> dict[str, dict[str, Any]]:  # noqa: ANN401
    """Read the frontier results ``sources`` (no run is repeated) and write, per size,
    ``out/{name}-{size}.json`` (the :func:`priced_at` table) and its PNG."""
    from farlink.bench.report import write_json

    documents = [json.loads(Path(p).read_text()) for p in sources]
    rows = rows_of(documents)
    results = {}
    for size in sizes:
        result = priced_at(rows, size, profiles, **assumptions)
        result["sources"] = [str(p) for p in sources]
        write_json(out / f"{name}-{size}.json", "time-to-loss priced", [], result)
        if plot_too:
            plot(out / f"{name}-{size}.png", result)
        results[size] = result
    return results
