"""``farlink swarm start | join`` as a person runs them: real processes, real output."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from swarm_output import read_multiaddress

# The swarm sub-app on its own typer app, as farlink.cli wires it via register(app, bench_app).
LAUNCH = (
    "import typer, sys; from farlink.comm.swarm_command import register; "
    "app = typer.Typer(); register(app, typer.Typer()); app()"
)


def swarm(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "swarm", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_start_prints_full_multiaddress_and_stops_on_ctrl_c() -> None:
    proc = swarm("start", "--host", "127.0.0.1", "--port", "0")
    try:
        addr = read_multiaddress(proc)
        assert "/p2p/12D3KooW" in addr
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert "shutting down" in out
    finally:
        proc.kill()


def test_join_with_bad_address_says_how_to_fix() -> None:
    proc = swarm("join", "--initial-peers", "127.0.0.1:4000")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "not a valid multiaddress" in err and "farlink swarm start" in err


@pytest.mark.slow
def test_two_joiners_run_demo_rounds() -> None:
    boot = swarm("start")
    joiners = []
    try:
        addr = read_multiaddress(boot)
        args = ("join", "--initial-peers", addr, "--rounds", "2", "--run-id", "clitest")
        joiners = [swarm(*args), swarm(*args, "--client-mode")]
        outs = [j.communicate(timeout=240)[0] for j in joiners]
        for out in outs:
            lines = [line for line in out.splitlines() if line.startswith("round ")]
            assert len(lines) == 2, out
            for line in lines:
                assert (
                    "group of 2" in line
                    and "sum of ones = 2" in line
                    and "NOT committed" not in line
                )
    finally:
        boot.send_signal(signal.SIGINT)
        boot.communicate(timeout=30)
        for j in joiners:
            j.kill()
