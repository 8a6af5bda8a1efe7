"""``farlink emulate check | profiles | measure | cleanup``: the WAN emulator from the command line.

Bad input (an unknown profile, a machine without namespaces) ends with one clear line on stderr
and exit status 2; ``check`` exits 1 when the namespace emulator cannot run here.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer

emulate_app = typer.Typer(help="Wide-area links on one machine: namespaces, tbf, NFQUEUE delay.",
                          no_args_is_help=True)


def _fail(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


def _rate(mbit: float | None) -> str:
    return "unshaped" if mbit is None else f"{mbit:g} Mbit/s"


@emulate_app.command("check")
def check_command(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Probe whether namespaces, tc shaping and NFQUEUE delay work on this machine."""
    from farlink.emulate.capabilities import detect_capabilities

    caps = detect_capabilities()
    if as_json:
        typer.echo(json.dumps(asdict(caps)))
    else:
        for name in ("netns", "tc", "nfqueue"):
            typer.echo(f"{name:8s} {'yes' if getattr(caps, name) else 'no'}")
        typer.echo("namespace emulation available" if caps.full
                   else f"falling back to in-process emulation: {caps.reason}")
    raise typer.Exit(0 if caps.full else 1)


@emulate_app.command("profiles")
def profiles_command() -> None:
    """List the named link profiles."""
    from farlink.links import load_links

    for name, p in load_links().items():
        typer.echo(f"{name:17s} up {_rate(p.up_mbit):>14s}  down {_rate(p.down_mbit):>14s}  "
                   f"one-way {p.latency_ms:g} ms  jitter {p.jitter_ms:g} ms  loss {p.loss:g}")


@emulate_app.command("measure")
def measure_command(
    profile: Annotated[str, typer.Option(help="Link profile of both workers.")] = "cross-region",
    bandwidth: Annotated[float | None, typer.Option(
        help="Scale the profile to this upload rate in Mbit/s (same delay).", min=0.001)] = None,
    window: Annotated[float, typer.Option(help="Seconds of bulk transfer measured.", min=0.5)] = 3.0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Build a 2-worker topology on PROFILE, measure TCP throughput and RTT, tear it down."""
    from farlink.emulate.capabilities import detect_capabilities
    from farlink.emulate.measure import measure_link
    from farlink.emulate.errors import EmulationError
    from farlink.links import LinkError, get_profile, scaled
    from farlink.emulate.topology import Topology

    try:
        link = scaled(profile, bandwidth) if bandwidth else get_profile(profile)
    except LinkError as exc:
        _fail(str(exc))
    caps = detect_capabilities()
    if not caps.full:
        _fail(f"namespace emulation unavailable here: {caps.reason}")
    try:
        with Topology(2, link) as topo:
            m = measure_link(topo, 0, 1, window_s=window)
    except EmulationError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"profile": link.name, **asdict(m)}))
        return
    exp_tp = m.expected_throughput_mbit
    typer.echo(f"profile {link.name}: throughput {m.throughput_mbit:.1f} Mbit/s "
               f"(profile {_rate(exp_tp)}), RTT {m.rtt_ms:.1f} ms (profile {m.expected_rtt_ms:g} ms), "
               f"TCP connect {m.connect_ms:.1f} ms")


@emulate_app.command("cleanup")
def cleanup_command() -> None:
    """Remove namespaces left by emulator runs whose process is gone (never anyone else's)."""
    from farlink.emulate.registry import cleanup_stale, marker_dir

    report = cleanup_stale()
    typer.echo(f"markers in {marker_dir()}: removed {len(report.removed)} namespace(s)"
               + (f": {', '.join(report.removed)}" if report.removed else ""))
    if report.live_runs:
        typer.echo(f"left alone (owner still running): {', '.join(report.live_runs)}")
    if report.refused:
        typer.echo(f"refused (not created by the recorded run): {', '.join(report.refused)}")
    if report.bad_markers:
        typer.echo(f"unreadable markers: {', '.join(report.bad_markers)}")


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    app.add_typer(emulate_app, name="emulate")
