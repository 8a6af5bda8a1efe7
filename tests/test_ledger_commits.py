"""The contribution ledger credits what reached the model: a round that failed and was retried
counts each peer's update once, and a member whose update never arrived is not blamed for one.

Two real hivemind peers (own p2p daemons, loopback) under ``farlink.Optimizer`` with ``--auth
secret``. In its first attempt at round 0, peer w1 withholds its update and fails its part of
the round, as a replica group does when one of its ranks failed: w0's all-gather waits its timeout,
gets nothing from w1, and the round is voted down. The retry commits.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import farlink
from farlink.comm.errors import CommError

pytest.importorskip("hivemind")
torch.set_num_threads(1)

TIMEOUTS = {"matchmaking_time": 1.5, "request_timeout": 1.0, "allreduce_timeout": 8.0,
            "gather_timeout": 3.0, "commit_timeout": 6.0, "round_timeout": 60.0}
INNER, TOKENS = 3, 16


class WithholdsFirstUpdate:
    """A real collective whose member sends nothing in its first round's all-gathers (its
    update, then its report of what it received) and fails that round (what a replica group's rank 0
    does when another of its ranks failed)."""

    def __init__(self, inner) -> None:
        self.inner, self.withheld = inner, False

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        if self.withheld:
            return self.inner.all_gather_bytes(payload)
        self.inner.fail_round(CommError("withheld this member's update"))
        return [b""] * self.inner._current().size

    def commit(self) -> bool:
        self.withheld = True  # the round that withheld is over
        return self.inner.commit()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_retried_round_credits_each_update_once_and_blames_no_one_for_a_missing_one() -> None:
    from test_hivemind_early_matchmaking import in_threads

    from farlink.comm.hivemind_backend import HivemindCollective

    first = HivemindCollective("ledger", min_group_size=2, **TIMEOUTS)
    peers = {"w0": first,
             "w1": HivemindCollective("ledger", first.maddrs, min_group_size=2, **TIMEOUTS)}
    init = threading.Lock()

    def member(name: str, collective):
        rank = int(name[1])
        with init:
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        coll = WithholdsFirstUpdate(collective) if rank == 1 else collective
        sync = farlink.Optimizer(model, opt, collective=coll, index=rank, backend="hivemind",
                                 algorithm="diloco", inner_steps=INNER, min_replicas=2,
                                 auth="secret", secret="s3cret", steps=INNER)
        gen = torch.Generator().manual_seed(rank)
        outcome = None
        for _ in range(INNER):
            x = torch.randn(TOKENS, 4, generator=gen)
            nn.functional.mse_loss(model(x).squeeze(-1), x.sum(-1)).backward()
            outcome = sync.step(tokens=TOKENS)
        return outcome, sync.ledger.to_dict()["peers"], collective.stats.failed_rounds

    try:
        results = in_threads(member, peers)
    finally:
        for peer in peers.values():
            peer.close()
    for name, (outcome, ledger, failed) in results.items():
        assert outcome.committed and outcome.outer_step == 1, (name, outcome)
        assert failed == 1, (name, failed)  # the first attempt was voted down, the retry held
        # exactly the two updates that reached the model, each credited once, no one blamed
        assert sorted(ledger) == ["w0", "w1"], (name, ledger)
        for record in ledger.values():
            assert record["updates_accepted"] == 1 and record["updates_rejected"] == 0, ledger
            assert record["tokens_accepted"] == INNER * TOKENS, ledger
