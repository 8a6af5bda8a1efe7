"""The Lighthouse is the organizational mode's single point of failure for membership (it holds
no training state): kill it with SIGKILL mid-run, restart it on the same address, and the
workers' rounds continue from the same step with the same participants."""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from farlink.train.lighthouse import Lighthouse, free_port


def _peer(index: int, address: str, rounds: int, queue) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    from farlink.comm.torchft_backend import TorchftCollective

    coll = TorchftCollective(f"p{index}", address, min_replicas=2, round_timeout=10,
                             quorum_timeout=90, join_timeout=3)
    coll.register_state(lambda: {"x": torch.zeros(1)}, lambda s: None)
    log = []
    try:
        for _ in range(rounds):
            info = coll.begin_round()
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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(i, lighthouse.address, 14, queue)) for i in range(2)]
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
            if p.is_alive():
                p.kill()
        lighthouse.stop()
    assert killed_at is not None
    for log in logs.values():
        assert [r[0] for r in log] == list(range(14))  # no round lost or repeated
        assert all(world == 2 and value == 2.0 and ok for _, world, value, ok, _ in log)
        assert any(t > killed_at + 2 for *_, t in log)  # rounds committed after the restart
