"""A volunteer learns from the bootstrap peer whether a NAT stands between: real p2p daemons in
the emulator's namespaces, one fetching from a public address, one from behind a NAT."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from farlink.emulate.capabilities import detect_capabilities
from farlink.emulate.topology import Topology

CAPS = detect_capabilities()
pytestmark = [
    # four Python processes in namespaces; on one machine the same fetch runs by default in
    # test_hivemind_cli::test_the_bootstrap_peer_tells_a_volunteer_on_its_machine_where_it_came_from
    # and the NAT case of nat_in_between in test_hivemind_cli::test_a_nat_is_seen_when_...
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.serial,  # its links are shaped by user-space delayers: alone on the machine
    pytest.mark.skipif(not CAPS.full, reason=f"namespace emulation unavailable: {CAPS.reason}"),
]

SERVE = textwrap.dedent("""
    import sys
    from farlink.comm.hivemind_net import best_address, start_bootstrap_peer
    from farlink.swarm.definition import DefinitionServer
    dht, maddrs = start_bootstrap_peer(sys.argv[1], 0, False)
    server = DefinitionServer(dht, b'{"run": "nat"}')
    print(best_address(maddrs), flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
    server.close()
    dht.shutdown()
""")
FETCH = textwrap.dedent("""
    import json, sys
    from farlink.comm.hivemind_net import nat_in_between
    from farlink.swarm.definition import fetch_definition
    got = fetch_definition([sys.argv[1]], None, sys.argv[2], timeout=60)
    print(json.dumps([got.blob.decode(), nat_in_between(got.seen_from, got.own_maddrs)]))
""")


def test_the_bootstrap_peer_tells_a_natted_volunteer_where_it_came_from() -> None:
    with Topology(3, "loopback", behind_nat={2}) as topo:
        boot = topo.spawn(0, [sys.executable, "-c", SERVE, topo.address(0)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            maddr = boot.stdout.readline().strip()
            assert maddr.startswith(f"/ip4/{topo.address(0)}/tcp/"), maddr
            seen = {}
            # its own machine, a public peer, a NATed one; each on every interface, as the
            # join command the bootstrap peer prints says (--host 0.0.0.0)
            for i in (0, 1, 2):
                out = subprocess.run(["ip", "netns", "exec", topo.namespace(i), sys.executable,
                                      "-c", FETCH, maddr, "0.0.0.0"], capture_output=True,
                                     text=True, timeout=120)
                assert out.returncode == 0, out.stderr[-3000:]
                blob, seen[i] = json.loads(out.stdout.strip().splitlines()[-1])
                assert blob == '{"run": "nat"}'
        finally:
            boot.stdin.close()
            boot.wait(30)
    assert seen == {0: None, 1: None, 2: topo.wan_address(2)}  # only the NATed one finds one
