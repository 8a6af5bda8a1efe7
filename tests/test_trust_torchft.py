"""``Collective.fail_round`` on torchft (a real Lighthouse, two worker processes): torchft
decides a commit per replica, and the exchange's equivocation check fails the round on every
replica (each compares the same digests): the round commits on neither, the next on both."""

from __future__ import annotations

import multiprocessing as mp

import torch

from farlink.train.lighthouse import Lighthouse


def _peer(index: int, address: str, queue) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    from farlink.comm.errors import CommError
    from farlink.comm.torchft_backend import TorchftCollective

    coll = TorchftCollective(f"p{index}", address, min_replicas=2, round_timeout=20)
    coll.register_state(lambda: {"x": torch.zeros(1)}, lambda s: None)
    out = []
    try:
        for r in range(2):
            info = coll.begin_round()
            coll.all_gather_bytes(bytes([index]) * 8)
            if r == 0:
                coll.fail_round(CommError("member 0 sent different updates to different members"))
            out.append((info.round_id, coll.commit()))
        queue.put((index, out))
    finally:
        coll.close()


def test_a_round_the_torchft_replicas_fail_commits_on_neither() -> None:
    lighthouse = Lighthouse(min_replicas=2, join_timeout=10).start()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(i, lighthouse.address, queue)) for i in range(2)]
    try:
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.stop()
    for index in range(2):
        (first_round, first_ok), (second_round, second_ok) = results[index]
        assert not first_ok, index  # failed: committed nowhere
        assert second_ok and second_round == first_round, index  # retried and committed
