"""Namespace emulation: measured TCP throughput and RTT against the profiles, a shared
bottleneck split between concurrent senders, cleanup on exit,
on exceptions and after SIGKILL, and refusal to delete what the emulator did not create."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from farlink.emulate import registry, sysnet
from farlink.emulate.capabilities import detect_capabilities
from farlink.emulate.measure import measure_link, measure_links
from farlink.links import LinkProfile, scaled
from farlink.emulate.topology import Topology

CAPS = detect_capabilities()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not CAPS.full, reason=f"namespace emulation unavailable: {CAPS.reason}"),
]


def within(measured: float, expected: float, tol: float = 0.2) -> bool:
    return abs(measured - expected) <= tol * expected


def host_state() -> tuple[list[str], str, str]:
    """What must never change on the host: its interfaces, iptables rules, routes."""
    links = sysnet.run(["ip", "-o", "link", "show"]).stdout
    names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())
    rules = sysnet.run(["iptables", "-w", "-S"]).stdout
    routes = sysnet.run(["ip", "route", "show"]).stdout
    return names, rules, routes


def namespaces_with(prefix: str) -> list[str]:
    return [ns for ns in sysnet.list_namespaces() if ns.startswith(prefix)]


@pytest.mark.parametrize("profile", [
    scaled("cross-region", 50),
    # the same assertions on a longer RTT and lower rate: cross-region's run stands in by default
    pytest.param(scaled("intercontinental", 30), marks=[pytest.mark.slow, pytest.mark.serial]),
], ids=lambda p: p.name)
def test_measured_link_matches_profile(profile: LinkProfile) -> None:
    before = host_state()
    with Topology(2, profile) as topo:
        m = measure_link(topo, 0, 1)
        prefix = topo.prefix
    print(f"{profile.name}: {m.throughput_mbit:.1f} Mbit/s, RTT {m.rtt_ms:.1f} ms "
          f"(connect {m.connect_ms:.1f} ms)")
    assert m.expected_rtt_ms == 2 * profile.latency_ms
    assert within(m.throughput_mbit, profile.bandwidth_mbit), m
    assert within(m.rtt_ms, m.expected_rtt_ms), m
    assert not namespaces_with(prefix)
    assert host_state() == before


@pytest.mark.slow  # per-link shaping; the measured-link test covers the emulator by default
@pytest.mark.serial  # measured rates and RTTs: alone on the machine
def test_heterogeneous_links() -> None:
    """A home-like worker (20 up / 80 down, 60 ms) and a cross-region one (50, 40 ms): the path
    delay is the mean, the rate the sender's upload or the receiver's download, whichever is
    lower."""
    fast, home = scaled("cross-region", 50), scaled("home", 20)
    with Topology(2, fast, overrides={1: home}) as topo:
        up = measure_link(topo, 1, 0, window_s=2.0)
        down = measure_link(topo, 0, 1, window_s=2.0)
    print(f"home->dc {up.throughput_mbit:.1f} Mbit/s RTT {up.rtt_ms:.1f} ms; "
          f"dc->home {down.throughput_mbit:.1f} Mbit/s")
    assert up.expected_rtt_ms == 100.0 and up.expected_throughput_mbit == 20
    assert down.expected_throughput_mbit == 50
    assert within(up.rtt_ms, 100.0) and within(up.throughput_mbit, 20)
    assert within(down.throughput_mbit, 50)


def test_unshaped_loopback_profile_is_fast() -> None:
    with Topology(2, "loopback") as topo:
        assert not topo._delayers  # nothing to delay: no NFQUEUE rule, no delayer
        m = measure_link(topo, 0, 1, window_s=1.0)
    assert m.rtt_ms < 5 and m.throughput_mbit > 500, m


def test_cleanup_on_exit_and_on_exception() -> None:
    before = host_state()
    with Topology(3, scaled("cross-region", 20)) as topo:
        prefix, marker = topo.prefix, Path(topo.record.path)
        assert len(namespaces_with(prefix)) == 4 and marker.exists()
        rules = sysnet.iptables_rules(topo.namespace(1))
        assert any("NFQUEUE" in r for r in rules)
        delayers = list(topo._delayers.values())
    assert not namespaces_with(prefix) and not marker.exists()
    assert all(p.poll() is not None for p in delayers)
    with pytest.raises(RuntimeError, match="boom"), \
            Topology(2, scaled("intercontinental", 20)) as topo:
        prefix = topo.prefix
        topo.spawn(0, ["sleep", "60"])
        raise RuntimeError("boom")
    assert not namespaces_with(prefix)
    assert host_state() == before


CRASHER = textwrap.dedent("""
    import sys, time
    from farlink.emulate.topology import Topology
    from farlink.links import scaled
    topo = Topology(2, scaled("cross-region", 20)).__enter__()
    topo.spawn(1, ["sleep", "300"])
    print(topo.prefix, topo.record.path, flush=True)
    time.sleep(300)
""")


def test_cleanup_stale_after_sigkill() -> None:
    before = host_state()
    proc = subprocess.Popen([sys.executable, "-c", CRASHER], stdout=subprocess.PIPE, text=True)
    try:
        prefix, marker = proc.stdout.readline().split()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(namespaces_with(prefix)) == 3  # the crash left them behind
    inside = [pid for ns in namespaces_with(prefix) for pid in sysnet.namespace_pids(ns)]
    assert inside  # at least the orphaned `sleep` (delayers exit when their parent dies)
    report = registry.cleanup_stale()
    assert sorted(report.removed) == sorted(f"{prefix}-{s}" for s in ("r", "w0", "w1"))
    assert not namespaces_with(prefix) and not Path(marker).exists()
    assert not [pid for pid in inside if registry.process_running(pid)], inside
    assert host_state() == before


def test_live_runs_are_not_cleaned() -> None:
    with Topology(1, "loopback") as topo:
        report = registry.cleanup_stale()
        assert topo.prefix in report.live_runs
        assert len(namespaces_with(topo.prefix)) == 2


def test_refuses_namespaces_it_did_not_create(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    foreign = f"flk-foreign-{os.getpid()}"
    lookalike = f"flk-{dead.pid}-0-w9"  # carries a plausible prefix but is in no marker
    for ns in (foreign, lookalike):
        sysnet.add_namespace(ns)
    try:
        # 1. a live run's own record refuses names outside it
        record = registry.RunRecord.new(tmp_path)
        with pytest.raises(registry.ForeignResourceError):
            registry.remove_namespace(record, foreign)
        with pytest.raises(registry.ForeignResourceError):
            registry.remove_namespace(record, f"{record.prefix}-w0")  # prefix, but unrecorded
        # 2. a dead run's marker that lists a foreign name (forged or corrupted) is refused
        forged = {"prefix": f"flk-{dead.pid}-0", "pid": dead.pid, "start_ticks": 1,
                  "created": 0.0, "namespaces": [foreign, f"flk-{dead.pid}-0-w0"],
                  "interfaces": {}}
        (tmp_path / f"flk-{dead.pid}-0.json").write_text(json.dumps(forged))
        report = registry.cleanup_stale(tmp_path)
        assert foreign in report.refused
        assert foreign in sysnet.list_namespaces()
        assert lookalike in sysnet.list_namespaces()  # never listed: never touched
        assert (tmp_path / f"flk-{dead.pid}-0.json").exists()  # kept for a human to inspect
        with pytest.raises(registry.ForeignResourceError):
            forged_record = registry.RunRecord.load(tmp_path / f"flk-{dead.pid}-0.json")
            registry.remove_namespace(forged_record, foreign)
        registry.release(record)
    finally:
        for ns in (foreign, lookalike):
            sysnet.delete_namespace(ns)


@pytest.mark.slow  # three timed transfers; the measured-link test covers the emulator by default
@pytest.mark.serial  # measured rates: alone on the machine
def test_shared_bottleneck_is_split_between_concurrent_senders() -> None:
    """Four workers on 50 Mbit/s links behind one 20 Mbit/s shared bottleneck: one sender alone
    gets the whole shared rate, two sending at once (to different receivers, so no worker's own
    link is shared) each get about half of it, and together the whole. Tolerance: 20% of the
    expected rate, as for the single-link measurements above."""
    shared = 20.0
    with Topology(4, scaled("cross-region", 50), shared=scaled("cross-region", shared)) as topo:
        assert topo.expected_throughput_mbit(0, 2) == shared
        alone = measure_link(topo, 0, 2, window_s=3.0, pings=2)
        both = measure_links(topo, [(0, 2), (1, 3)], window_s=3.0, pings=2)
    rates = [m.throughput_mbit for m in both]
    print(f"alone {alone.throughput_mbit:.1f} Mbit/s; together {rates[0]:.1f} + "
          f"{rates[1]:.1f} = {sum(rates):.1f} Mbit/s (shared {shared})")
    assert within(alone.throughput_mbit, shared), alone
    assert all(within(r, shared / 2) for r in rates), rates
    assert within(sum(rates), shared), rates
