"""``farlink swarm start | join`` as a person runs them: real processes, real output."""

from __future__ import annotations

import signal
import subprocess
import sys

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


def test_start_prints_full_multiaddress_and_stops_on_ctrl_c(tmp_path, cache_dir) -> None:
    proc = swarm("start", "--host", "127.0.0.1", "--port", "0", "--vocab-size", "512",
                 "--run-dir", str(tmp_path / "boot"), "--cache-dir", str(cache_dir))
    try:
        addr = read_multiaddress(proc, timeout=300)  # after the run's data is prepared
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
