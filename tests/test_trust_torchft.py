"""``Collective.fail_round`` on torchft (torchft's Lighthouse in-process, replicas as threads over
real Gloo): torchft decides a commit per replica, and the exchange's equivocation check fails the
round on every replica (each compares the same digests): the round commits on neither, the next
on both."""

from __future__ import annotations

import pytest
import torch

from farlink.comm.errors import CommError
from farlink.testing import torchft_replicas

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

torch.set_num_threads(1)


def test_a_round_the_torchft_replicas_fail_commits_on_neither() -> None:
    def peer(index: int, coll) -> list:  # noqa: ANN001
        out = []
        for r in range(2):
            info = coll.begin_round()
            coll.all_gather_bytes(bytes([index]) * 8)
            if r == 0:
                coll.fail_round(CommError("member 0 sent different updates to different "
                                          "members"), blame=[0])
            out.append((info.round_id, coll.commit()))
        return out

    results = torchft_replicas(2, peer, round_timeout=20)
    for index in range(2):
        (first_round, first_ok), (second_round, second_ok) = results[index]
        assert not first_ok, index  # failed: committed nowhere
        assert second_ok and second_round == first_round, index  # retried and committed
