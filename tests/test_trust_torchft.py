"""``Collective.fail_round`` on torchft (torchft's Lighthouse in-process, replicas as threads over
real Gloo): torchft decides a commit per replica, and the exchange's equivocation check fails the
round on every replica (each compares the same digests): the round commits on neither, the next
on both."""

from __future__ import annotations

import pytest
import threading

import torch
from torchft._torchft import LighthouseServer

from farlink.comm.errors import CommError
from farlink.comm.torchft_backend import TorchftCollective

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

torch.set_num_threads(1)


def test_a_round_the_torchft_replicas_fail_commits_on_neither() -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def peer(index: int) -> None:
        coll = TorchftCollective(f"p{index}", lighthouse.address(), min_replicas=2,
                                 round_timeout=20)
        coll.register_state(lambda: {"x": torch.zeros(1)}, lambda s: None)
        try:
            out = []
            for r in range(2):
                info = coll.begin_round()
                coll.all_gather_bytes(bytes([index]) * 8)
                if r == 0:
                    coll.fail_round(CommError("member 0 sent different updates to different "
                                              "members"), blame=[0])
                out.append((info.round_id, coll.commit()))
            results[index] = out
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
        finally:
            coll.close()

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        lighthouse.shutdown()
    if errors:
        raise errors[0]
    for index in range(2):
        (first_round, first_ok), (second_round, second_ok) = results[index]
        assert not first_ok, index  # failed: committed nowhere
        assert second_ok and second_round == first_round, index  # retried and committed
