"""A worker behind the emulator's NAT dials a public worker (which sees it at its router's
public address), and no public worker can open a connection to it: not at the router's public
address, and not at its private address even with a route to it. Its links keep their delay."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from farlink.emulate import nat, sysnet
from farlink.emulate.capabilities import detect_capabilities
from farlink.emulate.errors import EmulationError
from farlink.emulate.measure import measure_link
from farlink.emulate.topology import Topology
from farlink.links import scaled

CAPS = detect_capabilities()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not CAPS.full, reason=f"namespace emulation unavailable: {CAPS.reason}"),
]
PORT = 24117

# Accepts one connection and answers with the address it came from.
SERVER = textwrap.dedent(f"""
    import socket
    s = socket.create_server(("0.0.0.0", {PORT}))
    print("listening", flush=True)
    conn, (host, _) = s.accept()
    conn.sendall(host.encode())
    conn.close()
""")
# Prints what a connection to argv[1] got: the server's answer, or the error's name.
CLIENT = textwrap.dedent(f"""
    import socket, sys
    try:
        with socket.create_connection((sys.argv[1], {PORT}), timeout=float(sys.argv[2])) as c:
            print(c.recv(64).decode())
    except OSError as exc:
        print(type(exc).__name__)
""")


def serve(topo: Topology, worker: int) -> subprocess.Popen:
    server = topo.spawn(worker, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    return server


def dial(topo: Topology, worker: int, host: str, timeout_s: float = 2.0) -> str:
    out = subprocess.run(["ip", "netns", "exec", topo.namespace(worker), sys.executable, "-c",
                          CLIENT, host, str(timeout_s)], capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout.strip()


def test_a_natted_worker_dials_out_and_nobody_dials_in() -> None:
    with Topology(3, "loopback", behind_nat={1}) as topo:
        assert topo.address(1) == "10.78.1.2" and topo.wan_address(1) == "10.77.0.2"
        server = serve(topo, 0)
        assert dial(topo, 1, topo.address(0)) == topo.wan_address(1)  # masqueraded
        server.wait(10)

        server = serve(topo, 1)
        assert dial(topo, 2, topo.wan_address(1)) == "TimeoutError"  # the router drops it
        # even a peer that routes the private address to the router is not let through
        sysnet.ip(topo.namespace(2), "route", "add", "10.78.1.0/24", "via", topo.wan_address(1))
        assert dial(topo, 2, topo.address(1)) == "TimeoutError"
        assert dial(topo, 1, topo.address(1)) == topo.address(1)  # it was listening all along
        server.wait(10)
        # the router's own account: whom the worker dialed, and the dials it turned away
        assert nat.dialed(topo.nat_namespace(1)) == {(topo.address(0), PORT)}
        assert nat.dropped_inbound_packets(topo.nat_namespace(1), "flkn1") >= 2


def test_a_natted_workers_path_keeps_its_delay_and_rate() -> None:
    with Topology(2, scaled("home", 20), behind_nat={1}) as topo:
        m = measure_link(topo, 1, 0, window_s=2.0, pings=6)
        with pytest.raises(EmulationError, match="behind a NAT"):  # it would wait for nothing
            measure_link(topo, 0, 1)
    assert abs(m.rtt_ms - m.expected_rtt_ms) < 0.15 * m.expected_rtt_ms, m
    assert m.throughput_mbit > 0.8 * m.expected_throughput_mbit, m


def test_serving_two_natted_workers_at_once_takes_at_least_the_uplinks_time() -> None:
    """The serving probe moves real bytes through the shaper: two clients behind NATs asking
    the same server at once share its uplink, so each transfer takes at least both payloads
    over the upload rate, and a repeat on the same connection is timed again."""
    from farlink.emulate.measure import measure_serving

    rate_mbit, nbytes = 20.0, 1_000_000
    with Topology(3, scaled("home", rate_mbit), behind_nat={1, 2}) as topo:
        seconds = measure_serving(topo, 0, [1, 2], nbytes, repeats=2, period_s=3.0)
        with pytest.raises(EmulationError, match="behind a NAT"):
            measure_serving(topo, 1, [0], nbytes)
    floor = 2 * nbytes * 8 / (rate_mbit * 1e6)  # 0.8 s: both payloads over the one uplink
    assert set(seconds) == {1, 2} and all(len(s) == 2 for s in seconds.values())
    # both asked at once, each transfer shares the uplink: started d seconds apart (a busy
    # machine starts threads late), both take floor - d, never less than one payload alone
    assert min(min(s) for s in seconds.values()) > 0.9 * floor / 2, seconds
    assert all(max(s) > 0.9 * floor for s in seconds.values()), seconds
    assert max(max(s) for s in seconds.values()) < 4 * floor + 2.0, seconds
