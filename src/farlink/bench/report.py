"""Writing benchmark results: one JSON table and matplotlib PNGs (Agg, no display needed)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from farlink.extras import require


def pyplot():  # noqa: ANN201 (matplotlib is the optional ``plots`` extra)
    """matplotlib's pyplot on the Agg backend (no display needed), imported on first plot."""
    require("matplotlib", "plots (PNG files)").use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> Path:  # noqa: ANN001 (a matplotlib Figure)
    """Lay out ``fig``, write it to ``path`` (its directory made if missing) and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def write_json(path: Path, name: str, rows: list[dict], extra: dict[str, Any] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        # timings depend on what else the machine ran; losses and byte counts do not
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "load_average_1_5_15_min": list(os.getloadavg())},
        "rows": rows,
        **(extra or {}),
    }
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def plot_curves(
    path: Path,
    series: dict[str, list[tuple[float, float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        if not points:
            continue
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_panels(
    path: Path,
    panels: dict[str, dict[str, list[tuple[float, float]]]],
    xlabel: str,
    ylabel: str,
    columns: int = 4,
    logy: bool = False,
) -> Path:
    """One small plot per panel (title -> series), sharing axes: for grids of runs where one
    crowded plot would be unreadable."""
    rows = -(-len(panels) // columns)
    plt = pyplot()
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.0 * rows), sharex=True,
                             sharey=True, squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items()):
        for label, points in series.items():
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", markersize=2, label=label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if logy:
            ax.set_yscale("log")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    axes.flat[0].legend(fontsize=7)
    return save_figure(fig, path, dpi=110)
