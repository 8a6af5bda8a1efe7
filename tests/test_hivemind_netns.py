"""``farlink swarm start | join`` across the emulator's namespaces: the bootstrap peer and two
volunteers each in their own network namespace behind a shaped, delayed home link, one volunteer
in client mode (it accepts no connections and reaches the others only through connections it
opens itself). The volunteers fetch the run from the bootstrap peer, train it together and end on
one state."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from swarm_output import stop

from farlink.emulate.capabilities import detect_capabilities
from farlink.emulate.topology import Topology
from farlink.links import scaled
from farlink.train.metrics import read_metrics

CAPS = detect_capabilities()
FLAGS = ("--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2",
         "--workers", "2", "--steps", "30", "--inner-steps", "10", "--warmup-steps", "5")

pytestmark = [
    pytest.mark.slow,  # three p2p daemons and two trainers over 60 ms links, on 2 cores
    pytest.mark.netns,
    pytest.mark.serial,  # shaped 60 ms links (user-space delayers): alone on the machine
    pytest.mark.skipif(not CAPS.full, reason=f"namespace emulation unavailable: {CAPS.reason}"),
]


def farlink_in(topo: Topology, index: int, *args: str) -> subprocess.Popen:
    return topo.spawn(index, [sys.executable, "-m", "farlink.cli", "swarm", *args],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_join_command(proc: subprocess.Popen) -> list[str]:
    for line in proc.stdout:
        if line.strip().startswith("farlink swarm join "):
            return line.split()[1:]
    raise AssertionError(f"no join command printed; stderr: {proc.stderr.read()}")


def test_volunteers_train_across_namespaces_with_a_client_mode_peer(tmp_path: Path,
                                                                     cache_dir: Path) -> None:
    with Topology(3, scaled("home", 20)) as topo:
        boot = farlink_in(topo, 0, "start", "--host", topo.address(0), *FLAGS,
                          "--run-dir", str(tmp_path / "boot"), "--cache-dir", str(cache_dir))
        volunteers: list[subprocess.Popen] = []
        try:
            command = read_join_command(boot)[1:]  # without "swarm"
            volunteers = [
                farlink_in(topo, i, *command, "--host", topo.address(i), "--run-dir",
                           str(tmp_path / f"v{i}"), "--cache-dir", str(tmp_path / f"cache{i}"),
                           *(["--client-mode"] if i == 2 else []))
                for i in (1, 2)]
            outs = [v.communicate(timeout=600) for v in volunteers]
        finally:
            stop(boot)
            for v in volunteers:
                if v.poll() is None:
                    v.kill()
    for (out, err), volunteer in zip(outs, volunteers):
        assert volunteer.returncode == 0, (out, err[-3000:])
    ends, groups = [], []
    for i in (1, 2):
        records = [r for path in (tmp_path / f"v{i}" / "metrics").glob("w*.jsonl")
                   for r in read_metrics(path)]
        ends.append([r for r in records if r["kind"] == "end"][-1])
        groups += [r["world_size"] for r in records if r["kind"] == "sync" and r["committed"]]
    assert all(e["finished"] for e in ends) and ends[0]["fingerprint"] == ends[1]["fingerprint"]
    assert groups and set(groups) == {2}  # every committed round averaged both volunteers


def test_volunteers_behind_nat_train_through_a_reachable_one(tmp_path: Path) -> None:
    """``farlink bench swarm``'s scenario: home links of 50-150 ms, a reachable bootstrap peer,
    a reachable volunteer and two volunteers each behind its own NAT, which join in client mode
    by themselves (same command, no --client-mode). No relays:
    the NATed ones average through connections they dial to the reachable one."""
    from farlink.bench.swarm import run

    # five rounds: the first volunteers may train a round or two before the last one is in, and
    # a joiner's first round gives no upload (its bytes hold the joining), so three rounds could
    # leave a volunteer without one round whose every member's bytes are known
    result = run(tmp_path, steps=50, inner_steps=10, bandwidth_mbit=20, timeout_s=600)
    volunteers = [r for r in result["rows"] if r["role"] == "volunteer"]
    assert [r["exit_code"] for r in volunteers] == [0, 0, 0], result["rows"]
    assert result["same_state"], result["rows"]
    for row in volunteers:
        # the first volunteers train without waiting for the rest (a group follows the live
        # swarm), and once all three are in, every round has all three: the groups only grow
        sizes = row["group_sizes"]
        assert sizes and sizes == sorted(sizes) and sizes[-1] == 3, row
        assert row["bytes_sent"] > 0
        natted = row["reachability"] == "client mode behind NAT"
        assert natted == (row["address"] != row["seen_at"])
        # the same command everywhere: a NATed volunteer finds its NAT and says so
        assert natted == any(n.startswith("note: behind NAT") for n in row["console_notes"])
        if natted:  # its router saw it dial the bootstrap peer and the reachable volunteer only
            assert set(row["dialed_peers"]) == {0, 1}, row
    assert result["path"].startswith("direct, no relay"), result["path"]
    # no round beats its transfer time, nor plain TCP serving the same bytes the uplink's rate
    for row in volunteers:
        assert row["round_over_transfer"], row
        assert all(r["ratio"] > 1.0 for r in row["round_over_transfer"]), row
    serving = result["tcp_serving"]
    assert serving["median_s"] > 0.9 * 2 * serving["bytes_per_client"] * 8 / 20e6, serving
