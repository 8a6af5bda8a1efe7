"""Programs across the emulated WAN: a TCP ring over heterogeneous links, a Gloo all-reduce
bound to the namespace veth (GLOO_SOCKET_IFNAME), the torchft Lighthouse in the router, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
from typer.testing import CliRunner

from farlink.emulate import sysnet
from farlink.emulate.capabilities import detect_capabilities
from farlink.emulate.launch import launch_workers, start_lighthouse, wait_all, wait_for_port
from farlink.links import scaled
from farlink.emulate.topology import Topology

CAPS = detect_capabilities()
netns_only = pytest.mark.skipif(not CAPS.full,
                                reason=f"namespace emulation unavailable: {CAPS.reason}")


@pytest.mark.netns
@netns_only
def test_tcp_ring_across_heterogeneous_links() -> None:
    profiles = {0: scaled("cross-region", 40), 1: scaled("intercontinental", 20),
                2: scaled("home", 10)}
    nbytes = 1 << 20
    with Topology(3, profiles[0], overrides=profiles) as topo:
        peers = ",".join(topo.address(i) for i in range(3))
        handles = launch_workers(
            topo,
            lambda i: [sys.executable, "-m", "farlink.emulate.ringdemo", "--index", str(i),
                       "--peers", peers, "--nbytes", str(nbytes)],
            stdout=subprocess.PIPE, text=True)
        assert [h.ifname for h in handles] == ["flkw0", "flkw1", "flkw2"]
        assert wait_all(handles, timeout_s=90) == [0, 0, 0]
        results = [json.loads(h.process.stdout.read().splitlines()[-1]) for h in handles]
        one_way = [topo.expected_one_way_ms(i, (i + 1) % 3) for i in range(3)]
        rates = [topo.expected_throughput_mbit(i, (i + 1) % 3) for i in range(3)]
    for r, d, rate in zip(results, one_way, rates):
        print(f"w{r['index']} -> next: connect {r['connect_ms']:.1f} ms (RTT {2 * d:g}), "
              f"{nbytes} B in {r['seconds']:.2f} s (>= {nbytes * 8 / rate / 1e6:.2f} s at {rate} Mbit/s)")
        assert r["ok"] and r["received"] == nbytes
        assert r["address"] == handles[r["index"]].address  # bound to the emulated address
        assert r["connect_ms"] >= 2 * d * 0.9  # a handshake costs at least one round trip
        # each worker's transfer is paced by its own outgoing path (plus the incoming one it
        # waits for): never faster than its own path's rate allows
        assert r["seconds"] >= nbytes * 8 / rate / 1e6 * 0.9


GLOO_WORKER = textwrap.dedent("""
    import os, sys, time, datetime, torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank, world, master = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29400", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    t = torch.full((1 << 20,), float(rank + 1))  # 4 MiB
    dist.all_reduce(t)  # warm-up: connections and slow start
    t.fill_(float(rank + 1))
    start = time.perf_counter()
    dist.all_reduce(t)
    print(f"{t[0].item()} {time.perf_counter() - start:.3f}", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow  # two torch imports and a Gloo rendezvous over 80 ms RTT: ~40 s on 2 cores
@pytest.mark.serial  # times the all-reduce over shaped links: alone on the machine
@pytest.mark.netns
@netns_only
def test_gloo_all_reduce_over_the_emulated_wan() -> None:
    link = scaled("cross-region", 50)
    with Topology(2, link) as topo:
        master = topo.address(0)
        handles = launch_workers(
            topo, lambda i: [sys.executable, "-c", GLOO_WORKER, str(i), "2", master],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert all(h.process.wait(120) == 0 for h in handles), [
            h.process.stderr.read() for h in handles]
        outs = [h.process.stdout.read().split() for h in handles]
    for value, seconds in outs:
        assert float(value) == 3.0
        # 4 MiB each way over 50 Mbit/s is >= 0.67 s; a loopback shortcut would take ~10 ms
        assert float(seconds) >= 4 * 2**20 * 8 / 50e6 * 0.9, outs
        print(f"gloo all-reduce of 4 MiB over {link.name}: {float(seconds):.2f} s")


@pytest.mark.netns
@netns_only
def test_lighthouse_in_router_namespace() -> None:
    with Topology(2, scaled("cross-region", 20)) as topo:
        proc, address = start_lighthouse(topo, min_replicas=2)
        assert address == f"http://{topo.router_address}:29510"
        for i in range(2):
            t = time.perf_counter()
            wait_for_port(topo, topo.router_address, 29510, from_worker=i)
            assert time.perf_counter() - t < 10
        assert proc.poll() is None
        lighthouse_ns = topo.router_namespace
    assert lighthouse_ns not in sysnet.list_namespaces()
    assert proc.poll() is not None  # stopped with the topology


def test_cli_check_and_cleanup() -> None:
    from farlink.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["emulate", "check", "--json"])
    caps = json.loads(result.stdout)
    assert result.exit_code == (0 if caps["netns"] and caps["tc"] and caps["nfqueue"] else 1)
    assert caps["netns"] == CAPS.netns and caps["reason"] == CAPS.reason
    result = runner.invoke(app, ["emulate", "cleanup"])
    assert result.exit_code == 0 and "removed" in result.stdout
    result = runner.invoke(app, ["emulate", "measure", "--profile", "moon"])
    assert result.exit_code == 2


@pytest.mark.netns
@netns_only
def test_cli_measure() -> None:
    from farlink.cli import app

    result = CliRunner().invoke(app, ["emulate", "measure", "--profile", "cross-region",
                                      "--bandwidth", "20", "--window", "1.5", "--json"])
    assert result.exit_code == 0, result.stdout
    m = json.loads(result.stdout)
    assert m["profile"] == "cross-region@20mbit"
    assert abs(m["rtt_ms"] - 80) <= 16 and abs(m["throughput_mbit"] - 20) <= 4, m


@pytest.mark.slow  # two workers + Lighthouse through the delayer: ~30 s on 2 idle cores
@pytest.mark.serial  # the user-space delayer keeps its timing only on a machine otherwise idle
@pytest.mark.netns
@netns_only
def test_training_run_inside_namespaces(tmp_path, cache_dir) -> None:
    """`launch(network=...)`: workers in their namespaces, Lighthouse in the router; the rounds
    really cross the shaped 80 ms-RTT link, and the replicas still agree and learn."""
    from farlink.config import load_config
    from farlink.train.launcher import launch
    from farlink.train.metrics import read_metrics

    cfg = load_config(None, {"workers": 2, "steps": 20, "inner_steps": 10, "warmup_steps": 5,
                             "eval_batches": 2, "run_dir": tmp_path / "run",
                             "cache_dir": cache_dir})
    link = scaled("cross-region", 50)  # 40 ms one way: every round pays >= 2 round trips
    with Topology(2, link) as topo:
        result = launch(cfg, show_progress=False, network=topo)
    assert result.returncodes == [0, 0]
    syncs = [[r for r in read_metrics(tmp_path / "run" / "metrics" / f"w{i}.jsonl")
              if r["kind"] == "sync"] for i in range(2)]
    assert [len(s) for s in syncs] == [2, 2]
    for a, b in zip(*syncs):
        assert a["committed"] and b["committed"] and a["fingerprint"] == b["fingerprint"]
        assert a["world_size"] == 2
        # 5.5 MB of fp32 pseudo-gradient (ring of 2) through 50 Mbit/s: about 0.9 s per round
        assert a["round_s"] >= 0.4, a
    loss = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics" / "w0.jsonl")
            if r["kind"] in ("step", "sync")]
    assert loss[-1] < loss[0]
