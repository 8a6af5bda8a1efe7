"""``farlink swarm start | join`` across the emulator's namespaces: every peer in its own network
namespace behind a shaped, delayed home link, one of them in client mode (it accepts no
connections and reaches the others only through connections it opens itself)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from swarm_output import read_multiaddress

from farlink.emulate.capabilities import detect_capabilities
from farlink.links import scaled
from farlink.emulate.topology import Topology

CAPS = detect_capabilities()
LAUNCH = ("import typer; from farlink.comm.swarm_command import register; "
          "app = typer.Typer(); register(app, typer.Typer()); app()")

pytestmark = [
    pytest.mark.slow,  # three p2p daemons over 60 ms links: about a minute on 2 cores
    pytest.mark.netns,
    pytest.mark.skipif(not CAPS.full, reason=f"namespace emulation unavailable: {CAPS.reason}"),
]


def swarm_in(topo: Topology, index: int, *args: str) -> subprocess.Popen:
    return topo.spawn(index, [sys.executable, "-c", LAUNCH, "swarm", *args],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_swarm_across_namespaces_with_a_client_mode_peer() -> None:
    with Topology(3, scaled("home", 20)) as topo:
        boot = swarm_in(topo, 0, "start", "--host", topo.address(0))
        joiners: list[subprocess.Popen] = []
        try:
            addr = read_multiaddress(boot, topo.address(0), timeout=90)
            common = ("join", "--initial-peers", addr, "--rounds", "2", "--run-id", "netns",
                      "--pause", "2")
            joiners = [swarm_in(topo, 1, *common, "--host", topo.address(1)),
                       swarm_in(topo, 2, *common, "--host", topo.address(2), "--client-mode")]
            outs = [j.communicate(timeout=300) for j in joiners]
        finally:
            boot.send_signal(signal.SIGINT)
            try:
                boot.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                boot.kill()
            for j in joiners:
                if j.poll() is None:
                    j.kill()
    for (out, err), joiner in zip(outs, joiners):
        assert joiner.returncode == 0, err
        rounds = [line for line in out.splitlines() if line.startswith("round ")]
        assert len(rounds) == 2, (out, err)
        for line in rounds:
            # both peers met across the shaped links, summed and gathered, and committed
            assert "group of 2" in line and "sum of ones = 2" in line, line
            assert "gathered 2 payloads" in line and "NOT committed" not in line, line
