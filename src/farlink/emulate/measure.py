"""Measure what an emulated link really delivers, with a real TCP transfer between namespaces.

:func:`measure_links` measures several links at once (links behind a shared bottleneck
compete for it); :func:`measure_serving` times one worker serving several at once
(:mod:`farlink.emulate.serve_probe`).

The probe's server runs in worker ``b``, its client in worker ``a``: RTT is the median of
one-byte ping-pongs (TCP_NODELAY, so no Nagle or delayed-ACK wait), throughput is ``a`` -> ``b``
goodput counted at the receiver over a window that starts after a warm-up long enough for TCP
slow start on that path (about 8 round trips), so the number reflects the link, not the ramp.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from farlink.emulate.errors import EmulationError
from farlink.emulate.probe import LISTENING
from farlink.emulate.serve_probe import LISTENING as SERVE_LISTENING
from farlink.emulate.topology import Topology


@dataclass(frozen=True)
class LinkMeasurement:
    throughput_mbit: float  # TCP goodput a -> b
    rtt_ms: float  # median application-level ping-pong
    connect_ms: float  # TCP handshake (one round trip plus setup)
    rtt_samples_ms: tuple[float, ...]
    expected_throughput_mbit: float | None  # the profile's rate (None: unshaped)
    expected_rtt_ms: float  # 2 x the path's one-way delay


def measure_link(topology: Topology, a: int, b: int, window_s: float = 3.0, pings: int = 10,
                 port: int | None = None, timeout_s: float = 120.0) -> LinkMeasurement:
    """RTT and throughput from worker ``a`` to worker ``b`` of a started topology."""
    return measure_links(topology, [(a, b)], window_s, pings, port, timeout_s)[0]


def measure_links(topology: Topology, pairs: list[tuple[int, int]], window_s: float = 3.0,
                  pings: int = 10, port: int | None = None,
                  timeout_s: float = 120.0) -> list[LinkMeasurement]:
    """:func:`measure_link` for every ``(a, b)`` in ``pairs`` at once, so links that share a
    bottleneck compete for it; each transfer's window lies inside the others' transfers (they
    start within a warm-up of each other and send a margin past their window)."""
    for a, b in pairs:
        if a == b:
            raise EmulationError("measure_link needs two different workers")
        if b in topology.behind_nat:
            raise EmulationError(f"worker {b} is behind a NAT: nobody can dial it. Measure from "
                                 f"it instead: measure_link(topology, {b}, {a})")
    topology.check()
    expected_rtt = [2 * topology.expected_one_way_ms(a, b) for a, b in pairs]
    warmup = max(0.5, min(4.0, 8 * max(expected_rtt) / 1000))
    port = port or random.randint(20000, 60000 - len(pairs))
    py = [sys.executable, "-m", "farlink.emulate.probe"]
    servers, clients = [], []
    try:
        for k, (_, b) in enumerate(pairs):
            servers.append(topology.spawn(
                b, [*py, "server", "--host", topology.address(b), "--port", str(port + k),
                    "--warmup", str(warmup), "--window", str(window_s)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for server in servers:
            assert server.stdout is not None
            line = server.stdout.readline().strip()
            if line != LISTENING:
                raise EmulationError(f"probe server did not start: {line} "
                                     f"{server.stderr.read()}")
        for k, (a, b) in enumerate(pairs):
            clients.append(topology.spawn(
                a, [*py, "client", "--host", topology.address(b), "--port", str(port + k),
                    "--seconds", str(warmup + window_s + 1.0), "--pings", str(pings)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        c_outs = [client.communicate(timeout=timeout_s) for client in clients]
        s_outs = [server.communicate(timeout=timeout_s) for server in servers]
    finally:
        for proc in (*servers, *clients):
            if proc.poll() is None:
                proc.kill()
    failed = [f"client {c.returncode} {ce.strip()} | server {s.returncode} {se.strip()}"
              for c, s, (_, ce), (_, se) in zip(clients, servers, c_outs, s_outs)
              if c.returncode or s.returncode]
    if failed:
        raise EmulationError(f"probe failed: {'; '.join(failed)}")
    topology.check()
    found = []
    for (a, b), rtt, (c_out, _), (s_out, _) in zip(pairs, expected_rtt, c_outs, s_outs):
        c, s = json.loads(c_out.splitlines()[-1]), json.loads(s_out.splitlines()[-1])
        found.append(LinkMeasurement(
            throughput_mbit=s["throughput_mbit"], rtt_ms=c["rtt_ms"],
            connect_ms=c["connect_ms"], rtt_samples_ms=tuple(c["rtt_samples_ms"]),
            expected_throughput_mbit=topology.expected_throughput_mbit(a, b),
            expected_rtt_ms=rtt))
    return found


def measure_serving(topology: Topology, server: int, clients: list[int], nbytes: int,
                    repeats: int = 4, period_s: float = 6.0, port: int | None = None,
                    timeout_s: float = 180.0) -> dict[int, list[float]]:
    """Seconds from request to last byte when every worker in ``clients`` asks worker
    ``server`` for ``nbytes`` at the same moment, ``repeats`` times over one connection each,
    ``period_s`` apart (:mod:`farlink.emulate.serve_probe`); by client."""
    if server in topology.behind_nat:
        raise EmulationError(f"worker {server} is behind a NAT: nobody can dial it")
    topology.check()
    port = port or random.randint(20000, 60000)
    host = topology.address(server)
    py = [sys.executable, "-m", "farlink.emulate.serve_probe"]
    serving = topology.spawn(server, [*py, "server", "--host", host, "--port", str(port),
                                      "--clients", str(len(clients))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    asking: dict[int, subprocess.Popen] = {}
    try:
        assert serving.stdout is not None
        line = serving.stdout.readline().strip()
        if line != SERVE_LISTENING:
            raise EmulationError(f"serve probe did not start: {line} {serving.stderr.read()}")
        start_at = time.time() + 5.0  # every client connected by then
        for i in clients:
            asking[i] = topology.spawn(i, [*py, "client", "--host", host, "--port", str(port),
                                           "--nbytes", str(nbytes), "--start-at", str(start_at),
                                           "--repeats", str(repeats),
                                           "--period-s", str(period_s)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outputs = {i: proc.communicate(timeout=timeout_s) for i, proc in asking.items()}
        serving.communicate(timeout=timeout_s)
    finally:
        for proc in (serving, *asking.values()):
            if proc.poll() is None:
                proc.kill()
    failed = {i: err.strip() for i, (_, err) in outputs.items() if asking[i].returncode}
    if failed or serving.returncode:
        raise EmulationError(f"serve probe failed: clients {failed}, server {serving.returncode}")
    return {i: json.loads(out.splitlines()[-1])["seconds"] for i, (out, _) in outputs.items()}
