"""Human-readable units and the rich table ``farlink plan`` prints (one column per algorithm)."""

from __future__ import annotations

import math

from rich.table import Table

from farlink.plan.model import PlanResult


def seconds(value: float) -> str:
    if not math.isfinite(value):
        return "never"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    if value >= 1:
        return f"{value:.1f} s"
    return f"{value * 1e3:.1f} ms"


def nbytes(value: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.3g} B"


def bitrate(value: float) -> str:
    if not math.isfinite(value):
        return "unreachable"
    for unit, size in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.3g} bit/s"


def money(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    if value >= 1e6:
        return f"${value / 1e6:.2f}M"
    if value >= 1e3:
        return f"${value / 1e3:.1f}k"
    return f"${value:.2f}"


def header(result: PlanResult, model_label: str) -> str:
    s = result.scenario
    return (
        f"{model_label} on {s.n_workers} workers x {result.gpus_per_worker} {s.gpu} "
        f"({result.gpu.bf16_tflops:g} TFLOP/s bf16, mfu {s.mfu:g}), link '{s.profile}' "
        f"({bitrate(result.link.bandwidth_bps)}, {result.link.latency_ms:g} ms one way), "
        f"{s.batch_tokens:,} tokens/worker/step, budget {s.token_budget:.3g} tokens, "
        f"backend {s.backend}"
    )


def table(results: list[PlanResult]) -> Table:
    out = Table(title="farlink plan", show_lines=False)
    out.add_column("", style="bold", no_wrap=True)
    for r in results:
        out.add_column(r.algorithm, justify="right")
    target = results[0].target_utilization if results else 0.95
    rows = [
        ("codec", lambda r: r.codec),
        ("inner steps per round", lambda r: str(r.round.steps_per_round)),
        ("syncs per round", lambda r: str(r.round.syncs_per_round)),
        ("time per round", lambda r: seconds(r.round.round_seconds)),
        ("  compute", lambda r: seconds(r.round.compute_seconds)),
        ("  waiting for stragglers", lambda r: seconds(r.round.straggler_seconds)),
        ("  communication (exposed)", lambda r: seconds(r.round.exposed_comm_seconds)),
        ("  communication (overlapped)", lambda r: seconds(r.round.hidden_comm_seconds)),
        ("compute utilization", lambda r: f"{100 * r.round.utilization:.1f}%"),
        ("bytes sent / worker / round", lambda r: nbytes(r.round.bytes_sent_per_round)),
        ("bytes sent / worker / token", lambda r: f"{r.bytes_per_token:.4g} B"),
        (f"bandwidth for {100 * target:.0f}% utilization", lambda r: bitrate(r.bandwidth_for_target_bps)),
        ("wall-clock for budget", lambda r: seconds(r.wall_clock_seconds)),
        ("GPU-hours", lambda r: f"{r.gpu_hours:,.0f}"),
        ("cost on-demand", lambda r: money(r.cost_on_demand_usd)),
        ("cost spot", lambda r: money(r.cost_spot_usd)),
        ("model states / GPU", lambda r: f"{r.memory_gib_per_gpu:.1f} GiB" + ("" if r.fits_memory else " (does not fit)")),
    ]
    for label, cell in rows:
        out.add_row(label, *(cell(r) for r in results))
    return out
