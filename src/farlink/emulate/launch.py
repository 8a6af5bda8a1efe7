"""Start distributed programs across an emulated WAN: one process per worker namespace.

Each worker's environment gets :meth:`Topology.worker_env` (``GLOO_SOCKET_IFNAME`` = the veth
inside its namespace, ``FARLINK_EMULATED_HOST`` = its address), so Gloo binds the emulated link
and peers reach it by that address. A coordinator such as the torchft Lighthouse can run in the
router namespace (:func:`start_lighthouse`), where every worker reaches it at
``topology.router_address`` with half its own path delay.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from farlink.emulate.errors import EmulationError
from farlink.links import LinkProfile
from farlink.emulate.topology import Topology

Command = Sequence[str]


@dataclass
class WorkerHandle:
    index: int
    process: subprocess.Popen
    address: str  # the worker's address on the emulated network (its hostname for peers)
    ifname: str  # its interface inside the namespace (GLOO_SOCKET_IFNAME)
    namespace: str
    profile: LinkProfile


def launch_workers(
    topology: Topology,
    commands: Sequence[Command] | Callable[[int], Command],
    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
    **popen_kwargs: object,
) -> list[WorkerHandle]:
    """Run one command per worker inside its namespace; returns handles in worker order.

    ``commands`` is a list (one argv per worker) or ``index -> argv``; ``env`` is added on top of
    the worker's emulation variables (a mapping for all, or ``index -> mapping``).
    """
    n = topology.n_workers
    if not callable(commands) and len(commands) != n:
        raise EmulationError(f"{len(commands)} commands for {n} workers")
    handles = []
    for i in range(n):
        argv = commands(i) if callable(commands) else commands[i]
        extra = env(i) if callable(env) else (env or {})
        proc = topology.spawn(i, argv, {**topology.worker_env(i), **extra}, **popen_kwargs)
        handles.append(WorkerHandle(i, proc, topology.address(i), topology.ifname(i),
                                    topology.namespace(i), topology.profile(i)))
    return handles


def wait_for_port(topology: Topology, host: str, port: int, from_worker: int = 0,
                  timeout_s: float = 60.0) -> None:
    """Block until ``host:port`` accepts TCP connections as seen from a worker's namespace
    (the host itself has no route into the emulated network)."""
    code = ("import socket,sys,time\n"
            f"end=time.time()+{timeout_s}\n"
            "while time.time()<end:\n"
            "  try:\n"
            f"    socket.create_connection(({host!r},{port}),timeout=1).close(); sys.exit(0)\n"
            "  except OSError: time.sleep(0.1)\n"
            "sys.exit(1)\n")
    proc = topology.spawn(from_worker, [sys.executable, "-c", code])
    if proc.wait(timeout_s + 10) != 0:
        raise EmulationError(f"{host}:{port} not reachable from worker {from_worker} "
                             f"within {timeout_s:.0f}s")


def start_lighthouse(topology: Topology, min_replicas: int, port: int = 29510,
                     join_timeout_s: float = 30.0, heartbeat_timeout_s: float = 5.0,
                     log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Run ``torchft_lighthouse`` in the router namespace; returns it and its ``http://`` address
    (pass that as ``lighthouse_addr``/``TORCHFT_LIGHTHOUSE`` to the workers)."""
    binary = shutil.which("torchft_lighthouse") or str(
        Path(sys.executable).with_name("torchft_lighthouse"))
    if not Path(binary).exists():
        raise EmulationError("torchft_lighthouse not found (pip install torchft)")
    host = topology.router_address
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - child keeps it
    proc = topology.spawn_router(
        [binary, "--bind", f"{host}:{port}", "--min_replicas", str(min_replicas),
         "--join_timeout_ms", str(int(join_timeout_s * 1000)),
         "--heartbeat_timeout_ms", str(int(heartbeat_timeout_s * 1000)),
         "--quorum_tick_ms", "20"],
        stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port(topology, host, port)
    except EmulationError:
        proc.kill()
        raise
    return proc, f"http://{host}:{port}"


def wait_all(handles: Sequence[WorkerHandle], timeout_s: float) -> list[int]:
    """Exit codes in worker order; kills the rest and raises if the deadline passes."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for h in handles:
        try:
            codes.append(h.process.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in handles:
                if other.process.poll() is None:
                    other.process.kill()
            raise EmulationError(f"worker {h.index} still running after {timeout_s:.0f}s")
    return codes
