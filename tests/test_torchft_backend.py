"""The torchft collective: torchft's real Lighthouse (served in-process) and replicas as threads
over real Gloo (``farlink.testing``); the Lighthouse binary and worker processes are covered by
the ``farlink train`` runs of processes in test_orphans.py (the run whose launcher is SIGKILLed),
test_resume.py (Ctrl-C) and test_listeners.py."""

from __future__ import annotations

import pytest
import torch

from farlink.comm.base import ring_allgather_bytes, ring_allreduce_bytes
from farlink.comm.torchft_backend import TorchftCollective
from farlink.testing import in_threads, lighthouse_server

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

torch.set_num_threads(1)


def _peer(index: int, address: str, rounds: int) -> list:
    coll = TorchftCollective(f"p{index}", address, min_replicas=2, round_timeout=20)
    coll.register_state(lambda: {"x": torch.zeros(1)}, lambda s: None)
    out = []
    try:
        for r in range(rounds):
            info = coll.begin_round()
            t = torch.full((5,), float(index + 1) * (r + 1))
            before = coll.stats.bytes_sent
            coll.all_reduce_sum([t])
            reduce_bytes = coll.stats.bytes_sent - before
            payload = bytes([index]) * (10 + index)  # unequal lengths on purpose
            before = coll.stats.bytes_sent
            gathered = coll.all_gather_bytes(payload)
            gather_bytes = coll.stats.bytes_sent - before
            ok = coll.commit()
            out.append((info.round_id, info.world_size, t.tolist(), gathered, ok,
                        reduce_bytes, gather_bytes))
        return out
    finally:
        coll.close()


def test_two_replicas_allreduce_and_allgather_exact() -> None:
    with lighthouse_server(min_replicas=2, join_timeout_s=10) as address:
        results = in_threads(lambda i, _: _peer(i, address, 3), {0: None, 1: None}, timeout=120)
    for index in range(2):
        for r, (round_id, world, summed, gathered, ok, rb, gb) in enumerate(results[index]):
            assert ok and world == 2 and round_id == r
            assert summed == [3.0 * (r + 1)] * 5  # (1 + 2) * (r + 1)
            assert gathered == [bytes([0]) * 10, bytes([1]) * 11]
            assert rb == ring_allreduce_bytes(5 * 4, 2)
            # lengths (one int64) then payloads padded to the longest (11 bytes)
            assert gb == ring_allgather_bytes(8, 2) + ring_allgather_bytes(11, 2)
