"""``farlink bench hetero``: workers of different (emulated) speeds, fixed H vs time-budgeted.

Device speed is emulated: worker i's every step is padded to f_i x ``pace_seconds`` (slowdown
factors, default 1:1:2:4), so a worker with f=4 runs at a quarter of the speed whatever else
shares the cores (without a pace, it sleeps (f_i - 1) times its own real step, which a busy
machine distorts). With a fixed H every round waits for the slowest worker (or, elastic, goes on
without it); with time-budgeted rounds every worker runs as many inner steps as fit in the round
and the outer step weights each pseudo-gradient by the tokens it was computed on. The time budget
is derived from the fixed-H run itself (the time a full-speed worker needed for H steps), and the
budgeted run gets the same wall-clock. The target is the wall-clock to the fixed-H run's final
loss: that of the state most of its workers ended on (see ``final_replicas`` in run summaries).

:func:`run_islands` adds network heterogeneity: the same workers in two islands joined by a slow
link, where hierarchical DiLoCo keeps frequent averaging inside islands and sends only one
pseudo-gradient per island across.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from farlink.bench.report import plot_curves, write_json
from farlink.bench.runner import run_variant


def wall_to_loss(evals: list[dict], target: float) -> float | None:
    for e in sorted(evals, key=lambda e: e["wall_s"]):
        if e["loss"] <= target:
            return e["wall_s"]
    return None


def _device_emulation(pace_seconds: float | None) -> str:
    return ("device speed: every step padded to slowdown x pace_seconds" if pace_seconds
            else "device speed: per-step sleep of (slowdown - 1) x the real step")


TARGETS = {"min_utilization": 0.9, "speedup_to_target": 1.5}


def time_budget(fixed: dict, inner_steps: int) -> tuple[float, int]:
    """The round budget (what a full-speed worker needed for H steps in the fixed-H run) and the
    number of budgeted rounds that fit in the fixed-H run's wall-clock (with 15% to spare)."""
    fast = min(fixed["per_worker"].values(), key=lambda w: w["compute_s"] / max(w["tokens"], 1))
    step_s = fast["compute_s"] / (fast["tokens"] / fixed["tokens_per_step"])
    budget = step_s * inner_steps
    return budget, max(1, int(fixed["wall_s"] / (budget * 1.15)))


def compare(runs: list[dict], extra: Callable[[dict], dict] | None = None) -> list[dict]:
    """One row per run, the first being fixed H: per-worker utilization and the wall-clock to
    the fixed-H run's final loss, against :data:`TARGETS`."""
    target = runs[0]["final_heldout_loss"]
    rows = []
    for r in runs:
        row = {k: v for k, v in r.items() if k not in ("evals", "per_worker")}
        row.update(extra(r) if extra else {})
        row["utilization_per_worker"] = {w: round(v["compute_utilization"], 3)
                                         for w, v in r["per_worker"].items()}
        row["min_utilization"] = min(row["utilization_per_worker"].values())
        row["wall_to_fixed_final_loss"] = wall_to_loss(r["evals"], target)
        rows.append(row)
    reference = rows[0]["wall_to_fixed_final_loss"]
    for row in rows[1:]:
        reached = row["wall_to_fixed_final_loss"]
        row["speedup_to_target"] = reference / reached if reference and reached else None
        row["meets_targets"] = (row["min_utilization"] >= TARGETS["min_utilization"]
                                and (row["speedup_to_target"] or 0)
                                >= TARGETS["speedup_to_target"])
    return rows


def run(out: Path, slowdown: str, steps: int, inner_steps: int,
        pace_seconds: float | None = None, reuse: bool = False) -> dict:
    workers = len(slowdown.split(","))
    base = {"workers": workers, "slowdown": slowdown, "eval_batches": 8, "inner_steps": inner_steps,
            "pace_seconds": pace_seconds}
    fixed = run_variant(f"fixed-H{inner_steps}", base, out, reuse, steps=steps)
    budget, rounds = time_budget(fixed, inner_steps)
    timed = run_variant(f"time-budget-{budget:.1f}s", base, out, reuse,
                        steps=rounds * inner_steps, round_seconds=budget)
    rows = compare([fixed, timed])
    write_json(out / "hetero.json", "hetero", rows,
               {"slowdown": slowdown, "pace_seconds": pace_seconds,
                "emulation": _device_emulation(pace_seconds), "round_seconds": budget,
                "target_loss": fixed["final_heldout_loss"], "targets": TARGETS})
    plot_curves(out / "hetero_loss_vs_wall.png",
                {r["label"]: [(e["wall_s"], e["loss"]) for e in r["evals"]] for r in (fixed, timed)},
                "wall-clock (s)", "held-out loss", f"slowdowns {slowdown.replace(',', ':')}")
    return {"rows": rows}


# --- two islands: network heterogeneity on top of device heterogeneity -------------------------

def _network_figures(row: dict, out: Path) -> dict:
    """Inter-island bytes and islands of a finished variant, from its summary."""
    import json

    summary = json.loads((out / "runs" / row["label"] / "summary.json").read_text())
    return {"inter_island_bytes": summary.get("inter_island_bytes"),
            "intra_island_bytes": summary.get("intra_island_bytes"),
            "islands": summary.get("network", {}).get("islands"),
            "islands_source": summary.get("network", {}).get("source")}


def run_islands(out: Path, slowdown: str, steps: int, inner_steps: int, topology: str,
                intra_link: str, inter_link: str, island_rounds: int,
                pace_seconds: float | None = None, reuse: bool = False) -> dict:
    """Workers of speeds ``slowdown`` in the islands of ``topology`` (links emulated in-process:
    ``intra_link`` inside an island, ``inter_link`` between islands). Four ways to train:

    * fixed-H DiLoCo, flat: every round waits for the slowest worker, and all pseudo-gradients
      cross the slow link (the ring is paced by its slow hops);
    * time-budgeted DiLoCo, flat: rounds of equal time, token-weighted;
    * hierarchical DiLoCo, time-budgeted: islands (measured by the launcher) average every
      budget / ``island_rounds`` seconds over their fast links; only island leaders cross the slow
      link, once per budget; members wait for the hand-off;
    * the same with the global round overlapped with the islands' training.

    The budget and the number of rounds derive from the fixed-H run as in :func:`run`. With
    ``pace_seconds`` every worker's step is padded to its slowdown x that many seconds, so the
    emulated speeds hold even when the worker processes outnumber the cores (otherwise a worker
    that waits frees a core for the others, which flatters the variants that wait most).
    """
    workers = len(slowdown.split(","))
    base = {"workers": workers, "slowdown": slowdown, "eval_batches": 8, "inner_steps": inner_steps,
            "topology": topology, "intra_link": intra_link, "inter_link": inter_link,
            "pace_seconds": pace_seconds}
    fixed = run_variant(f"islands-fixed-H{inner_steps}", base, out, reuse, steps=steps)
    budget, rounds = time_budget(fixed, inner_steps)
    timed = {"steps": rounds * inner_steps, "round_seconds": budget}
    hier = {**timed, "algorithm": "hierarchical_diloco", "island_seconds": budget / island_rounds}
    runs = [fixed,
            run_variant(f"islands-time-budget-{budget:.1f}s", base, out, reuse, **timed),
            run_variant(f"islands-hierarchical-{budget:.1f}s-x{island_rounds}", base, out, reuse,
                        **hier),
            run_variant(f"islands-hierarchical-overlap-{budget:.1f}s-x{island_rounds}", base, out,
                        reuse, **hier, overlap_global=True)]
    target = fixed["final_heldout_loss"]
    rows = compare(runs, lambda r: _network_figures(r, out))
    for row in rows[1:]:
        if rows[0]["inter_island_bytes"] and row["inter_island_bytes"] is not None:
            row["inter_island_bytes_vs_fixed"] = (row["inter_island_bytes"]
                                                  / rows[0]["inter_island_bytes"])
    write_json(out / "hetero-islands.json", "hetero-islands", rows, {
        "slowdown": slowdown, "topology": topology, "intra_link": intra_link,
        "inter_link": inter_link, "round_seconds": budget, "island_rounds": island_rounds,
        "pace_seconds": pace_seconds,
        "target_loss": target, "targets": TARGETS,
        "emulation": _device_emulation(pace_seconds)
        + "; links: in-process (each collective held for latency + bytes/bandwidth of its "
          "profile); islands measured by the launcher over shaped TCP relays on loopback",
        "inter_island_bytes": "hierarchical: bytes the island leaders sent on the global "
                              "collective; flat: bytes of workers whose ring successor (index "
                              "order) is in another island",
    })
    plot_curves(out / "hetero-islands.png",
                {r["label"]: [(e["wall_s"], e["loss"]) for e in r["evals"]] for r in runs},
                "wall-clock (s)", "held-out loss",
                f"islands {topology} ({intra_link} / {inter_link}), slowdowns "
                f"{slowdown.replace(',', ':')}")
    return {"rows": rows}
