"""Predicted vs measured: relative errors of the planner on real (emulated) runs, JSON + PNG.

A run and its prediction are plain dicts of numbers (e.g. ``round_seconds``, ``utilization``,
``bytes_sent_per_round``, as in :meth:`RoundPrediction.to_dict`), so the benchmark that measures
emulator runs needs nothing from the planner but :func:`predict_round` and this module. Rows are
paired by their ``name`` when both sides have one, otherwise by position.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

DEFAULT_METRICS = ("round_seconds", "utilization", "bytes_sent_per_round", "comm_seconds",
                   "exposed_comm_seconds", "compute_seconds")


def _pairs(measured: list[dict], predicted: list[dict]) -> list[tuple[str, dict, dict]]:
    if all("name" in m for m in measured) and all("name" in p for p in predicted):
        by_name = {p["name"]: p for p in predicted}
        missing = [m["name"] for m in measured if m["name"] not in by_name]
        if missing:
            raise ValueError(f"no prediction for measured run(s): {', '.join(map(str, missing))}")
        return [(str(m["name"]), m, by_name[m["name"]]) for m in measured]
    if len(measured) != len(predicted):
        raise ValueError(
            f"{len(measured)} measured runs but {len(predicted)} predictions, and no 'name' keys "
            "to pair them by"
        )
    return [(str(m.get("name", i)), m, p) for i, (m, p) in enumerate(zip(measured, predicted))]


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def compare(measured: list[dict], predicted: list[dict],
            metrics: tuple[str, ...] | None = None) -> dict:
    """Per-run and per-metric relative errors (predicted - measured) / measured.

    A metric is compared wherever both sides carry a finite number and the measured value is not
    zero (a relative error of a zero measurement is undefined; such rows are counted as skipped).
    """
    if not measured:
        raise ValueError("nothing measured to compare against")
    pairs = _pairs(measured, predicted)
    if metrics is None:
        metrics = tuple(k for k in DEFAULT_METRICS
                        if any(_number(m.get(k)) is not None for _, m, _ in pairs))
    rows, per_metric = [], {k: [] for k in metrics}
    skipped = {k: 0 for k in metrics}
    for name, m, p in pairs:
        row = {"name": name}
        for key in metrics:
            mv, pv = _number(m.get(key)), _number(p.get(key))
            if mv is None or pv is None or mv == 0:
                skipped[key] += 1
                continue
            err = (pv - mv) / abs(mv)
            row[key] = {"measured": mv, "predicted": pv, "relative_error": err}
            per_metric[key].append(err)
        rows.append(row)
    summary = {}
    for key, errs in per_metric.items():
        if not errs:
            summary[key] = {"n": 0, "skipped": skipped[key]}
            continue
        abs_errs = sorted(abs(e) for e in errs)
        summary[key] = {
            "n": len(errs),
            "skipped": skipped[key],
            "mean_abs_relative_error": sum(abs_errs) / len(abs_errs),
            "median_abs_relative_error": abs_errs[len(abs_errs) // 2] if len(abs_errs) % 2
            else (abs_errs[len(abs_errs) // 2 - 1] + abs_errs[len(abs_errs) // 2]) / 2,
            "max_abs_relative_error": abs_errs[-1],
            "mean_relative_error": sum(errs) / len(errs),
        }
    return {"metrics": summary, "runs": rows}


def write_validation_report(measured: list[dict], predicted: list[dict], out_dir: str | Path,
                            metrics: tuple[str, ...] | None = None,
                            stem: str = "planner_validation",
                            inputs: dict | None = None) -> dict[str, Path]:
    """:func:`compare` as ``<stem>.json`` and a predicted-vs-measured scatter ``<stem>.png``.
    ``inputs`` (e.g. the measured runs and predictions as fed to the planner) are kept in the
    JSON beside the comparison, so a later model can re-predict the same runs from it."""
    from farlink.bench.report import pyplot

    plt = pyplot()

    result = compare(measured, predicted, metrics)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(result | ({"inputs": inputs} if inputs else {}), indent=2))

    keys = [k for k, s in result["metrics"].items() if s["n"] > 0]
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4 * max(len(keys), 1), 4),
                             squeeze=False)
    for ax, key in zip(axes[0], keys):
        points = [(r[key]["measured"], r[key]["predicted"], r["name"])
                  for r in result["runs"] if key in r]
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        lo, hi = min(xs + ys), max(xs + ys)
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--", label="predicted = measured")
        ax.scatter(xs, ys, color="tab:blue", zorder=3)
        for x, y, name in points:
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if lo > 0 and hi / lo > 20:
            ax.set_xscale("log")
            ax.set_yscale("log")
        stats = result["metrics"][key]
        ax.set_title(f"{key}\nmean |rel err| {100 * stats['mean_abs_relative_error']:.1f}%",
                     fontsize=9)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
    if not keys:
        axes[0, 0].text(0.5, 0.5, "no comparable metrics", ha="center")
    fig.tight_layout()
    png_path = out / f"{stem}.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return {"json": json_path, "png": png_path}
