"""``farlink bench frontier``: held-out loss against bytes per token, every method tuned.

A comparison of communication-efficient methods is only fair when each runs at its own best
learning rates: DiLoCo at DDP's AdamW lr, or DDP at a lr tuned for DiLoCo, says more about the lr
than about the method. So every *family* (DDP, DiLoCo, SparseLoCo in the paper's and in its
authors' variant, DeMo) first runs a small grid
of inner lr (and outer lr where it has one) at a shorter token budget (``sweep_steps``); the lrs
with the lowest held-out loss there are used by the family's methods for the full budget. Variants
of one family share its sweep (DiLoCo's codecs and Streaming DiLoCo use DiLoCo's lrs; SparseLoCo's
densities use SparseLoCo's), which the JSON records next to every sweep point.

Every run sees the same tokens (same seed, shards, batch and steps), trains its workers as threads
of one process (:mod:`farlink.bench.inprocess`: the real algorithms, exchange, codecs and byte
accounting) and reports the bytes each worker sent per token it trained on, as ``bench probe`` and
``bench algorithms`` do. The report marks the Pareto front (no other method is both cheaper and
better) and checks two targets, met or not, as measured:

* some method sends >= 1000x fewer bytes per token than DDP at a held-out loss within 2% of DDP's;
* SparseLoCo reaches DiLoCo-fp32's loss (or lower) with >= 10x fewer bytes than DiLoCo int8.

Each finished run is one JSON file under ``out/frontier/``; ``reuse`` reads back those whose
configuration matches, so an interrupted sweep continues where it stopped. A run file may carry
a ``source`` (where a read-back row was measured); it is kept in the row and the sweep point.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farlink.bench.report import pyplot, save_figure, write_json

REDUCTION_TARGET = 1000.0  # bytes per token, DDP / method
LOSS_TOLERANCE = 0.02  # held-out loss within 2% of DDP's
SPARSELOCO_VS_INT8_TARGET = 10.0


@dataclass(frozen=True)
class Family:
    """Methods that share one lr sweep: ``grid`` lists the lr settings tried first (RunConfig
    fields). A family whose ``base`` sets a smaller ``batch_size`` than the benchmark's runs
    proportionally more steps (and warmup steps), so it still sees the same tokens."""

    name: str
    base: dict[str, Any]
    grid: list[dict[str, Any]]


@dataclass(frozen=True)
class Method:
    label: str
    family: str
    overrides: dict[str, Any] = field(default_factory=dict)


def grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
    """Every combination of the given values: ``grid(lr=[1, 2], outer_lr=[3])``."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*axes.values())]


SMALL_BATCH = 2  # sequences per worker per step of the small-batch DDP row (8 in all for 4)
MAX_EXTENSIONS = 3  # rounds of grid extension per family before its edge is reported as such


def families(inner_steps: int, small_batch: int = SMALL_BATCH) -> list[Family]:
    """The default sweep, around each method's published defaults. DiLoCo's outer lr reaches
    down to 0.1: with momentum 0.9 a steady outer step is about ``lr / (1 - 0.9)`` = 10 lr
    pseudo-gradients, and the paper's 0.7 (7 of them) need not suit a small model and budget.
    ``ddp-small-batch`` is DDP at ``small_batch`` sequences per worker per step (more steps,
    the same tokens): whether DDP's lead over the local-update methods is its batch per step."""
    local = {"inner_steps": inner_steps}
    return [
        Family("ddp", {"algorithm": "ddp"}, grid(lr=[1e-3, 3e-3, 1e-2])),
        Family("ddp-small-batch", {"algorithm": "ddp", "batch_size": small_batch},
               grid(lr=[1e-3, 3e-3])),
        Family("diloco", {"algorithm": "diloco", **local},
               grid(lr=[3e-3, 1e-2], outer_lr=[0.1, 0.3, 0.5, 0.7])),
        Family("sparseloco", {"algorithm": "sparseloco", **local},
               grid(lr=[1e-2, 3e-2], sparseloco_lr=[1.0, 1.5, 2.0])),
        Family("sparseloco-authors",
               {"algorithm": "sparseloco", "sparseloco_variant": "authors", **local},
               grid(lr=[1e-2, 3e-2], sparseloco_lr=[0.5, 1.0, 1.5])),
        Family("demo", {"algorithm": "demo"}, grid(demo_lr=[1e-3, 3e-3, 1e-2])),
    ]


def equal_tokens(values: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """``values`` with steps and warmup scaled so that a run at ``values['batch_size']`` sees
    the tokens a run at ``batch_size`` would (the benchmark's batch)."""
    factor = batch_size / values["batch_size"]
    if factor == 1:
        return values
    if factor != int(factor):
        raise ValueError(f"batch_size {values['batch_size']} does not divide the benchmark's "
                         f"{batch_size}: pick a divisor so every run sees the same tokens")
    out = {**values, "steps": values["steps"] * int(factor)}
    if "warmup_steps" in out:
        out["warmup_steps"] = out["warmup_steps"] * int(factor)
    return out


def edge_extensions(tried: list[dict[str, Any]], best: dict[str, Any]) -> list[dict[str, Any]]:
    """The points to try next when ``best`` lies on an edge of the grid ``tried``: for each axis
    on whose smallest or largest value the best sits, one step further out (geometric, by the
    ratio of that edge to its neighbour), the other axes held at the best's values. Axes with a
    single value have no edge to judge and are not extended."""
    out = []
    for axis in best:
        values = sorted({p[axis] for p in tried})
        if len(values) < 2:
            continue
        if best[axis] == values[-1]:
            nxt = values[-1] * values[-1] / values[-2]
        elif best[axis] == values[0]:
            nxt = values[0] * values[0] / values[1]
        else:
            continue
        point = {**best, axis: float(f"{nxt:.3g}")}
        if point not in tried:
            out.append(point)
    return out


def methods(sparse_topks: Sequence[int] = (64, 32), longer_h: Sequence[int] = ()) -> list[Method]:
    """The frontier's points, in the order they run (cheapest families first). ``longer_h``
    adds SparseLoCo and DiLoCo int4, both with Muon inside, at each of those H: fewer rounds
    at the same tokens, so bytes per token fall as 1/H (at the lrs swept at the bench's H)."""
    out = [
        Method("ddp", "ddp"),
        Method("ddp-small-batch", "ddp-small-batch"),
        Method("diloco-fp32", "diloco"),
        Method("diloco-int8", "diloco", {"codec": "int8+ef"}),
        Method("diloco-int4", "diloco", {"codec": "int4+ef"}),
        Method("streaming-diloco-int4", "diloco",
               {"algorithm": "streaming_diloco", "codec": "int4+ef"}),
    ]
    out += [Method(f"sparseloco-k{k}", "sparseloco", {"sparseloco_topk": k}) for k in sparse_topks]
    out += [Method(f"sparseloco-authors-k{k}", "sparseloco-authors", {"sparseloco_topk": k})
            for k in sparse_topks]
    # Muon inside (MuLoCo) at the lrs swept with AdamW inside: Muon's step is matched to
    # AdamW's size (farlink.sync.muon), so the same lr is its natural starting point
    out += [Method("diloco-muon", "diloco", {"inner": "muon"}),
            Method(f"sparseloco-muon-k{sparse_topks[0]}", "sparseloco",
                   {"sparseloco_topk": sparse_topks[0], "inner": "muon"})]
    out += [m for h in longer_h for m in (
        Method(f"sparseloco-muon-k{sparse_topks[0]}-H{h}", "sparseloco",
               {"sparseloco_topk": sparse_topks[0], "inner": "muon", "inner_steps": h}),
        Method(f"diloco-muon-int4-H{h}", "diloco",
               {"inner": "muon", "codec": "int4+ef", "inner_steps": h}))]
    # the outer step off the critical path (farlink.sync.delayed): its loss cost, at the lrs
    # swept for the blocking step
    out += [Method("diloco-delayed", "diloco", {"outer_overlap": "delayed"}),
            Method("diloco-eager", "diloco", {"outer_overlap": "eager"}),
            Method("diloco-muon-eager", "diloco", {"inner": "muon", "outer_overlap": "eager"})]
    out.append(Method("demo", "demo"))
    return out


def ablations(inner_steps: int) -> list[Method]:
    """Runs that ask why DiLoCo trails DDP, at the final budget and DiLoCo's swept lrs: fewer
    and more inner steps per round (H/2, 2H), plain parameter averaging instead of the outer
    Nesterov step (outer lr 1, no momentum), and one worker alone (the floor that averaging
    four replicas must beat; a quarter of the tokens, at DDP's swept lr). Outer lrs are part
    of DiLoCo's sweep itself (see :func:`families`)."""
    return [
        Method(f"diloco-fp32-H{max(1, inner_steps // 2)}", "diloco",
               {"inner_steps": max(1, inner_steps // 2)}),
        Method(f"diloco-fp32-H{2 * inner_steps}", "diloco", {"inner_steps": 2 * inner_steps}),
        Method("local-sgd-averaging", "diloco", {"algorithm": "local_sgd"}),
        Method("one-worker", "ddp", {"workers": 1}),
    ]


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each (bytes, loss), whether no other point is at most as costly and at most as lossy
    and strictly better in one of the two (lower is better in both)."""
    def dominated(i: int) -> bool:
        x, y = points[i]
        return any(xj <= x and yj <= y and (xj < x or yj < y)
                   for j, (xj, yj) in enumerate(points) if j != i)

    return [not dominated(i) for i in range(len(points))]


Trainer = Callable[[str, dict[str, Any], int], dict]


def _train(label: str, values: dict[str, Any], eval_points: int) -> dict:
    from farlink.bench.inprocess import train_in_process

    return train_in_process(label, values, eval_points=eval_points)


class RunStore:
    """One JSON file per finished run; with ``reuse`` a file whose config matches is read back
    instead of training again (a different config is trained and overwrites it)."""

    def __init__(self, root: Path, reuse: bool, train: Trainer = _train) -> None:
        self.root, self.reuse, self.train = root, reuse, train

    def run(self, phase: str, label: str, values: dict[str, Any], eval_points: int) -> dict:
        path = self.root / phase / f"{label}.json"
        wanted = {k: v for k, v in values.items() if k not in ("run_dir", "cache_dir")}
        if self.reuse and path.is_file():
            row = json.loads(path.read_text())
            if row.get("config") == json.loads(json.dumps(wanted)):
                return row
        row = self.train(label, values, eval_points)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row, indent=1, default=str))
        return row


def _lr_tag(point: dict[str, Any]) -> str:
    return "-".join(f"{k}{v:g}" for k, v in point.items())


def targets(rows: list[dict]) -> dict[str, Any]:
    """The two frontier targets, as measured (``met`` is False when a needed row is missing)."""
    by_label = {r["label"]: r for r in rows}
    ddp = by_label.get("ddp")
    candidates = [r for r in rows if not r["label"].startswith("ddp")]
    within = [r for r in candidates if ddp is not None and r["loss_vs_ddp"] <= LOSS_TOLERANCE]
    best = max(within, key=lambda r: r["bytes_per_token_reduction_vs_ddp"], default=None)
    cheapest = max(candidates,
                   key=lambda r: r.get("bytes_per_token_reduction_vs_ddp", 0), default=None)
    first = {
        "goal": f">= {REDUCTION_TARGET:g}x fewer bytes/token than DDP, held-out loss within "
                f"{LOSS_TOLERANCE:.0%} of DDP",
        "met": best is not None and best["bytes_per_token_reduction_vs_ddp"] >= REDUCTION_TARGET,
        "best_within_tolerance": None if best is None else {
            k: best[k] for k in ("label", "bytes_per_token_reduction_vs_ddp", "loss_vs_ddp")},
        "most_reduction": None if cheapest is None or ddp is None else {
            k: cheapest[k] for k in ("label", "bytes_per_token_reduction_vs_ddp", "loss_vs_ddp")},
    }
    fp32, int8 = by_label.get("diloco-fp32"), by_label.get("diloco-int8")
    sparse = [r for r in rows if r["label"].startswith("sparseloco")]
    second: dict[str, Any] = {
        "goal": f"SparseLoCo at DiLoCo-fp32's loss or lower with >= "
                f"{SPARSELOCO_VS_INT8_TARGET:g}x fewer bytes/token than DiLoCo int8",
        "met": False, "candidates": []}
    if fp32 is not None and int8 is not None:
        for r in sparse:
            fewer = int8["bytes_per_token"] / r["bytes_per_token"]
            ok = (r["final_heldout_loss"] <= fp32["final_heldout_loss"]
                  and fewer >= SPARSELOCO_VS_INT8_TARGET)
            second["candidates"].append({
                "label": r["label"], "loss": r["final_heldout_loss"],
                "diloco_fp32_loss": fp32["final_heldout_loss"],
                "bytes_per_token_fewer_than_diloco_int8": fewer, "met": ok})
            second["met"] = second["met"] or ok
    return {"reduction_within_2pct_of_ddp": first, "sparseloco_vs_diloco": second}


def compare(rows: list[dict]) -> list[dict]:
    """Adds to each row its reduction of bytes per token and its loss against DDP, and whether it
    is on the Pareto front of (bytes per token, held-out loss)."""
    ddp = next((r for r in rows if r["label"] == "ddp"), None)
    front = pareto_front([(r["bytes_per_token"], r["final_heldout_loss"]) for r in rows])
    for r, on_front in zip(rows, front):
        r["pareto"] = on_front
        if ddp is not None:
            r["bytes_per_token_reduction_vs_ddp"] = ddp["bytes_per_token"] / r["bytes_per_token"]
            r["loss_vs_ddp"] = r["final_heldout_loss"] / ddp["final_heldout_loss"] - 1
    return rows


def plot_frontier(path: Path, rows: list[dict], swept: bool = True) -> Path:
    """Held-out loss against bytes per token (log x), the Pareto front drawn through its points,
    and DDP's +2% line; ``swept``: whether the lrs came from the bench's sweep (the title says
    which)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in rows:
        ax.scatter(r["bytes_per_token"], r["final_heldout_loss"], s=40,
                   marker="*" if r["pareto"] else "o", zorder=3, label=r["label"])
        if "heldout_loss_range" in r:  # the seeds' range around their mean
            low, high = r["heldout_loss_range"]
            mean = r["final_heldout_loss"]
            ax.errorbar(r["bytes_per_token"], mean, yerr=[[mean - low], [high - mean]],
                        fmt="none", ecolor="grey", capsize=3, linewidth=0.8, zorder=2)
        ax.annotate(r["label"], (r["bytes_per_token"], r["final_heldout_loss"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    front = sorted((r["bytes_per_token"], r["final_heldout_loss"]) for r in rows if r["pareto"])
    if front:
        xs, ys = zip(*front)
        ax.step(xs, ys, where="post", color="black", linewidth=1, alpha=0.6,
                label="Pareto front", zorder=2)
    ddp = next((r for r in rows if r["label"] == "ddp"), None)
    if ddp is not None:
        ax.axhline(ddp["final_heldout_loss"] * (1 + LOSS_TOLERANCE), color="grey",
                   linestyle="--", linewidth=0.8, label="DDP + 2%")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker per token")
    ax.set_ylabel("held-out loss")
    seeds = max((len(r.get("seeds", [0])) for r in rows), default=1)
    ax.set_title("held-out loss vs bytes per token ("
                 + ("each method at its swept lrs" if swept else "lrs given, not swept") + ")"
                 + (f";\nmean of {seeds} seeds, bars: their range" if seeds > 1 else ""))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def seeded_runs(store: RunStore, phase: str, label: str, values: dict[str, Any], seeds: int,
                eval_points: int) -> dict:
    """``label`` trained with seeds 0..seeds-1 (init and data order; seed 0 is the run without
    a ``seed`` key, so a table of one seed reads back as before), as one row: the seeds' mean
    held-out loss as ``final_heldout_loss``, each seed's loss, their sample standard deviation
    and range, the mean loss curve, and the mean bytes per token."""
    runs = [store.run(phase, label if s == 0 else f"{label}-seed{s}",
                      values if s == 0 else {**values, "seed": s}, eval_points)
            for s in range(seeds)]
    if seeds == 1:
        return runs[0]
    losses = [r["final_heldout_loss"] for r in runs]
    mean = sum(losses) / len(losses)
    std = (sum((x - mean) ** 2 for x in losses) / (len(losses) - 1)) ** 0.5
    curve = [{**point, "loss": sum(r["evals"][i]["loss"] for r in runs) / len(runs),
              "loss_seeds": [r["evals"][i]["loss"] for r in runs]}
             for i, point in enumerate(runs[0]["evals"])]
    compute = [r["compute_s_per_step"] for r in runs if "compute_s_per_step" in r]
    row = {**runs[0], "final_heldout_loss": mean, "seeds": list(range(seeds)),
           "heldout_loss_seeds": losses, "heldout_loss_std": std,
           "heldout_loss_range": [min(losses), max(losses)], "evals": curve,
           "bytes_per_token": sum(r["bytes_per_token"] for r in runs) / len(runs),
           "bytes_per_token_seeds": [r["bytes_per_token"] for r in runs],
           "wall_s": sum(r["wall_s"] for r in runs)}
    if compute:  # measured in the runs that record it (rows read back from older tables lack it)
        row["compute_s_per_step"] = sum(compute) / len(compute)
        row["compute_s_per_step_runs"] = len(compute)
    return row


def run(out: Path, base: dict[str, Any], sweep_steps: int, inner_steps: int,
        family_list: list[Family] | None = None, method_list: list[Method] | None = None,
        only: list[str] | None = None, reuse: bool = False, plot: bool = True,
        train: Trainer = _train, ablation_list: list[Method] | None = None,
        max_extensions: int = MAX_EXTENSIONS, seeds: int = 1,
        profiles: Sequence[str] = ()) -> dict:
    """Sweep each family at ``sweep_steps``, then run its methods for ``base['steps']`` at the
    best lrs; writes ``out/frontier.json`` (after every run, so a partial table is never lost)
    and ``out/frontier.png``. ``ablation_list`` (see :func:`ablations`) runs afterwards, at the
    same budget and lrs, into the JSON's ``ablations`` (not on the frontier). A family whose
    best sweep point lies on an edge of its grid is swept one step further out on that axis,
    up to ``max_extensions`` rounds (see :func:`edge_extensions`). With ``seeds`` > 1 every
    final run is repeated with seeds 1..seeds-1 (:func:`seeded_runs`; the sweep runs seed 0):
    rows, targets and the plot use the seeds' mean and show their spread. ``profiles`` (link
    profiles): each method's time to reach DDP's and the best local method's loss on them, the
    curves and the compute measured, the links priced by the planner
    (:mod:`farlink.bench.time_to_loss`), into the JSON's ``time_to_loss`` and
    ``out/frontier-time-to-loss.png``. ``sweep_steps=0`` sweeps nothing: every family runs at
    the one lr point its grid names (lrs carried over from a sweep at another size, where a
    sweep at this one does not fit the machine); a family with several points is refused."""
    store = RunStore(out / "frontier", reuse, train)
    fams = {f.name: f for f in (family_list or families(inner_steps))}
    if sweep_steps == 0:  # lrs given, not swept: each family must name exactly one point
        several = [f.name for f in fams.values() if len(f.grid) != 1]
        if several:
            raise ValueError(f"sweep_steps=0 runs every family at its one given lr point; "
                             f"{', '.join(several)} list several: sweep them (sweep_steps > 0) "
                             f"or keep one point each")
    chosen = [m for m in (method_list or methods()) if not only or m.label in only]
    sweep: dict[str, dict[str, Any]] = {}
    rows: list[dict] = []
    extra_rows: list[dict] = []

    def report() -> dict:
        compare(rows)
        ddp = next((r for r in rows if r["label"] == "ddp"), None)
        for r in extra_rows:
            if ddp is not None:
                r["loss_vs_ddp"] = r["final_heldout_loss"] / ddp["final_heldout_loss"] - 1
        doc = {"sweep": sweep, "targets": targets(rows) if rows else {},
               "ablations": extra_rows,
               "settings": {**{k: v for k, v in base.items() if k != "cache_dir"},
                            "sweep_steps": sweep_steps, "inner_steps": inner_steps,
                            "seeds": seeds,
                            "workers_as": "threads of one process (InProcessGroup)"}}
        write_json(out / "frontier.json", "frontier", rows, doc)
        return doc

    def configured(fam: Family, values: dict[str, Any]) -> dict[str, Any]:
        return equal_tokens({**base, **fam.base, **values}, base["batch_size"])

    def best_lrs(fam: Family) -> dict[str, Any]:
        """The family's grid, extended outwards while its best point lies on an edge (at most
        MAX_EXTENSIONS rounds; the JSON records each added point and any edge left)."""
        if fam.name not in sweep and sweep_steps == 0:
            sweep[fam.name] = {"steps": 0, "grid": fam.grid, "extended": [], "points": [],
                               "best": fam.grid[0], "edge_left_untried": [],
                               "not_swept": "lrs given (sweep_steps=0)"}
        if fam.name not in sweep:
            points: list[dict[str, Any]] = []
            axes = list(fam.grid[0])
            todo, extended, rounds = list(fam.grid), [], 0
            while True:
                for point in todo:
                    values = configured(fam, {**point, "steps": sweep_steps})
                    row = store.run("sweep", f"{fam.name}-{_lr_tag(point)}", values,
                                    eval_points=1)
                    points.append({**point, "final_heldout_loss": row["final_heldout_loss"],
                                   "wall_s": row["wall_s"],
                                   **({"source": row["source"]} if "source" in row else {})})
                best = min(points, key=lambda p: p["final_heldout_loss"])
                best_point = {k: best[k] for k in axes}
                todo = edge_extensions([{k: p[k] for k in axes} for p in points], best_point)
                if not todo or rounds == max_extensions:
                    break
                rounds += 1
                extended += [{**p, "because_best_was_on_edge": best_point} for p in todo]
            sweep[fam.name] = {"steps": configured(fam, {"steps": sweep_steps})["steps"],
                               "grid": fam.grid, "extended": extended, "points": points,
                               "best": best_point, "edge_left_untried": todo}
        return sweep[fam.name]["best"]

    for phase, selected, into in (("final", chosen, rows),
                                  ("ablation", ablation_list or [], extra_rows)):
        for m in selected:
            fam = fams[m.family]
            values = configured(fam, {**best_lrs(fam), **m.overrides})
            row = seeded_runs(store, phase, m.label, values, seeds, eval_points=4)
            into.append({**row, "family": fam.name, "lrs_from_sweep": best_lrs(fam)})
            doc = report()
    if not rows:
        raise ValueError(f"no method selected by --only {only}; choose from "
                         f"{', '.join(m.label for m in method_list or methods())}")
    if profiles:
        from farlink.bench import time_to_loss

        doc["time_to_loss"] = time_to_loss.table(rows, tuple(profiles))
        saved = json.loads((out / "frontier.json").read_text())
        saved["time_to_loss"] = doc["time_to_loss"]
        (out / "frontier.json").write_text(json.dumps(saved, indent=1, default=str))
        if plot:
            time_to_loss.plot(out / "frontier-time-to-loss.png", doc["time_to_loss"])
    if plot:
        plot_frontier(out / "frontier.png", rows, swept=sweep_steps > 0)
    return {"rows": rows, **doc}
