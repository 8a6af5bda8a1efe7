"""The Lighthouse is the organizational mode's single point of failure for membership (it holds
no training state): kill it with SIGKILL mid-run, restart it on the same address, and the
workers' rounds continue from the same step with the same participants. The Lighthouse is a
process (it is what gets killed); the two peers are threads of the test's process."""

from __future__ import annotations

import queue as queues
import threading
import time
from pathlib import Path

import pytest
import torch

from farlink.train.lighthouse import Lighthouse, free_port

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads
ROUNDS = 8  # the Lighthouse is killed after round 4: rounds 5-7 commit after the restart


def _peer(index: int, address: str, rounds: int, queue, quorum_timeout: float = 90,  # noqa: ANN001
          join_timeout: float = 3) -> None:
    from farlink.comm.torchft_backend import QuorumUnavailable, TorchftCollective

    coll = TorchftCollective(f"p{index}", address, min_replicas=2, round_timeout=10,
                             quorum_timeout=quorum_timeout, join_timeout=join_timeout)
    coll.register_state(lambda: {"x": torch.zeros(1)}, lambda s: None)
    log = []
    try:
        for _ in range(rounds):
            try:
                info = coll.begin_round()
            except QuorumUnavailable as exc:
                queue.put(("error", index, str(exc)))
                return
            t = torch.ones(3)
            coll.all_reduce_sum([t])
            log.append((info.round_id, info.world_size, t[0].item(), coll.commit(), time.time()))
            queue.put(("round", index, info.round_id))
            time.sleep(0.3)
        queue.put(("done", index, log))
    finally:
        coll.close()


def test_run_survives_a_lighthouse_restart() -> None:
    port = free_port()
    lighthouse = Lighthouse(port=port, min_replicas=2, join_timeout=3).start()
    queue = queues.Queue()
    procs = [threading.Thread(target=_peer, args=(i, lighthouse.address, ROUNDS, queue),
                              daemon=True) for i in range(2)]
    for p in procs:
        p.start()
    logs, killed_at = {}, None
    try:
        while len(logs) < 2:
            kind, index, payload = queue.get(timeout=120)
            if kind == "round" and payload == 4 and killed_at is None:
                lighthouse.stop(kill=True)
                killed_at = time.time()
                time.sleep(2)
                lighthouse = Lighthouse(port=port, min_replicas=2, join_timeout=3).start()
            elif kind == "done":
                logs[index] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
        lighthouse.stop()
    assert not any(p.is_alive() for p in procs), "a peer still runs"
    assert killed_at is not None
    for log in logs.values():
        assert [r[0] for r in log] == list(range(ROUNDS))  # no round lost or repeated
        assert all(world == 2 and value == 2.0 and ok for _, world, value, ok, _ in log)
        assert any(t > killed_at + 2 for *_, t in log)  # rounds committed after the restart


def _restart_run(quorum_timeout: float, join_timeout: float, outage: float) -> dict:
    """Two peers, the Lighthouse SIGKILLed after round 2 and back ``outage`` s later."""
    port = free_port()
    lighthouse = Lighthouse(port=port, min_replicas=2, join_timeout=join_timeout).start()
    queue = queues.Queue()
    procs = [threading.Thread(target=_peer, args=(i, lighthouse.address, 6, queue, quorum_timeout,
                                                  join_timeout), daemon=True) for i in range(2)]
    for p in procs:
        p.start()
    logs, killed = {}, False
    try:
        while len(logs) < 2:
            kind, index, payload = queue.get(timeout=120)
            if kind == "round" and payload == 2 and not killed:
                lighthouse.stop(kill=True)
                killed = True
                time.sleep(outage)
                lighthouse = Lighthouse(port=port, min_replicas=2,
                                        join_timeout=join_timeout).start()
            elif kind in ("done", "error"):
                logs[index] = (kind, payload)
    finally:
        for p in procs:
            p.join(timeout=30)
        lighthouse.stop()
    assert not any(p.is_alive() for p in procs), "a peer still runs"
    return logs


@pytest.mark.parametrize("outage", [pytest.param(3.0, marks=pytest.mark.slow),
                                     pytest.param(5.0, marks=pytest.mark.slow)])
def test_short_quorum_timeout_rides_out_a_restart(outage: float) -> None:
    """--quorum-timeout at or below --join-timeout + 10 s used to leave a single attempt that a
    request stuck on the killed Lighthouse used up entirely; an outage shorter than
    --quorum-timeout must be ridden out whatever the two are set to, even one that ends just
    before the quorum timeout (5 s of 6: the wait counts from the first failed attempt,
    which comes after the kill)."""
    logs = _restart_run(quorum_timeout=6, join_timeout=3, outage=outage)
    for kind, payload in logs.values():
        assert kind == "done", payload
        assert [r[0] for r in payload] == list(range(6))
        assert all(world == 2 and value == 2.0 and ok for _, world, value, ok, _ in payload)


@pytest.mark.slow  # about a minute: each failed quorum request waits out torchft's timeouts
def test_no_quorum_message_tells_a_down_lighthouse_from_missing_peers() -> None:
    """A Lighthouse that is up (e.g. it was restarted) but gets too few peers must not be
    reported as down ("restart it"); one that stays down must be."""
    from farlink.comm.torchft_backend import QuorumUnavailable, TorchftCollective

    lighthouse = Lighthouse(min_replicas=2, join_timeout=1).start()
    coll = TorchftCollective("alone", lighthouse.address, min_replicas=2, round_timeout=5,
                             quorum_timeout=1, join_timeout=1)
    coll.register_state(lambda: {"x": torch.zeros(1)}, lambda s: None)
    try:
        with pytest.raises(QuorumUnavailable) as up:
            coll.begin_round()
        lighthouse.stop(kill=True)
        with pytest.raises(QuorumUnavailable) as down:
            coll.begin_round()
    finally:
        coll.close()
        lighthouse.stop()
    assert "is up, but fewer than min_replicas=2 peers" in str(up.value)
    assert "restart" not in str(up.value).lower()
    assert "does not answer" in str(down.value) and "restart it" in str(down.value)


def test_a_lighthouse_whose_port_another_process_took_is_not_taken_for_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The port picked for a Lighthouse can be taken by another process before the Lighthouse
    binds it (seen under -n: the Lighthouse died with "Address already in use" while ``start``
    had connected to the other process and returned, and every quorum then failed). A port it
    picked is picked again; a port the caller named is refused, saying so."""
    import socket

    from farlink.train import lighthouse as module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = iter([port])
        real = module.free_port
        monkeypatch.setattr(module, "free_port", lambda host="127.0.0.1": next(picks, None)
                            or real(host))
        picked = Lighthouse(log_path=tmp_path / "picked.log").start()
        try:
            time.sleep(1.0)  # the Lighthouse it started would have died on the taken port by now
            assert picked.port != port and picked.proc.poll() is None
        finally:
            picked.stop()
        named = Lighthouse(port=port, log_path=tmp_path / "named.log")
        with pytest.raises(RuntimeError, match="in use by another process"):
            named.start()
