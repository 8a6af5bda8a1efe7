"""A run on loopback (the default --host) listens on loopback only: no process of it (launcher,
Lighthouse, workers, their torchft or hivemind servers) binds every interface. docs/trust.md
lists the sockets; this reads the real ones from /proc during a real run."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procfs import command_line, descendants, listening, parent

from farlink.train.metrics import read_metrics

BASE = {"model": "nano",
        "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2, "workers": 2,
        "steps": 400, "inner_steps": 2, "warmup_steps": 1, "join_timeout": 10}


def rounds_committed(run_dir: Path) -> int:
    return min((sum(r["kind"] == "sync" and r["committed"] for r in read_metrics(path))
                for path in (run_dir / "metrics").glob("w*.jsonl")), default=0)


# one process run by default (torchft, 1 rank); the hivemind run and the replica-group run go
# with the slow scenarios: test_hivemind_peers_of_a_loopback_run_listen_on_loopback_only (the
# same listeners built in this process) and
# test_a_replica_group_without_an_agent_hosts_its_store_on_master_addr stand in for them
@pytest.mark.parametrize(("backend", "ranks_per_worker"),
                         [("torchft", 1), pytest.param("hivemind", 1, marks=pytest.mark.slow),
                          pytest.param("torchft", 2, marks=pytest.mark.slow)])
def test_loopback_run_binds_no_public_interface(tmp_path: Path, cache_dir: Path, backend: str,
                                                ranks_per_worker: int) -> None:
    """With ``ranks_per_worker=2`` each worker is a replica group: torchrun's agent, its store, the
    replica group's own process group and rank 0's torchft store join the listeners checked."""
    run_dir = tmp_path / "run"
    options = {**BASE, "backend": backend, "ranks_per_worker": ranks_per_worker}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    launcher = subprocess.Popen(
        [sys.executable, "-c", "from farlink.cli import main; main()", "train", *flags,
         "--run-dir", str(run_dir), "--cache-dir", str(cache_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        # after two committed rounds every listener exists (Gloo's pairs, the state server)
        while (run_dir / "metrics").exists() is False or rounds_committed(run_dir) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "no rounds"
            time.sleep(0.5)
        pids = descendants(launcher.pid) | {launcher.pid}
        sockets = listening(pids)
        names = {pid: command_line(pid) for pid in pids}
        # a worker's own processes (a DHT process, torchrun's ranks) carry its command line;
        # a worker is forked from the launcher's fork server or started by the launcher
        workers = {p: descendants(p) | {p} for p in descendants(launcher.pid)
                   if "farlink.worker" in names[p]
                   and "farlink.worker" not in names.get(parent(p), "")}
    finally:
        launcher.terminate()
        launcher.wait(timeout=60)
    assert len(workers) == 2, names
    for tree in workers.values():  # the scan sees each worker's listeners (or its p2pd's)
        assert any(pid in tree for pid, _, _ in sockets), (tree, sockets)
    public = [(names[pid][:80], host, port) for pid, host, port in sockets
              if not ipaddress.ip_address(host).is_loopback]
    assert not public, public


def test_a_replica_group_without_an_agent_hosts_its_store_on_master_addr(
        monkeypatch) -> None:  # noqa: ANN001
    """Ranks started without torchrun's agent (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by hand):
    rank 0 hosts the replica group's store, on MASTER_ADDR only (torch's own: every interface)."""
    from farlink.parallel.sharding import ReplicaGroup
    from farlink.train.lighthouse import free_port

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = ReplicaGroup(rank=0, size=2)._rendezvous()
    store.set("up", "1")
    assert [(host, p) for _, host, p in listening({os.getpid()}) if p == port] == [
        ("127.0.0.1", port)]


def test_hivemind_peers_of_a_loopback_run_listen_on_loopback_only(tmp_path: Path) -> None:
    """The listeners of a hivemind run on the default --host, built in this process as the
    launcher (its bootstrap DHT) and a worker (its collective) build them: their DHT processes
    and p2p daemons listen, and on loopback only."""
    from farlink.comm.hivemind_net import start_bootstrap_peer
    from farlink.compose import build_collective
    from farlink.config import load_config

    cfg = load_config(None, {**BASE, "backend": "hivemind", "run_dir": tmp_path / "run"})
    before = descendants(os.getpid())
    bootstrap, maddrs = start_bootstrap_peer(cfg.host)
    collective = None
    try:
        collective = build_collective(cfg, "w0", ",".join(maddrs))
        started = descendants(os.getpid()) - before
        sockets = listening(started)
        names = {pid: command_line(pid) for pid in started}
    finally:
        if collective is not None:
            collective.close()
        bootstrap.shutdown()
    daemons = {pid for pid in started if "p2pd" in names[pid]}
    assert len(daemons) == 2, names  # the bootstrap peer's and the worker's
    assert {pid for pid, _, _ in sockets} >= daemons, (daemons, sockets)
    public = [(names[pid][:80], host, port) for pid, host, port in sockets
              if not ipaddress.ip_address(host).is_loopback]
    assert not public, public
