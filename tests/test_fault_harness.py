"""The fault harness (``farlink.testing``) does what it says: faults fire where named, a lost
member fails its round everywhere and comes back healed, over real torchft and in-process."""

from __future__ import annotations

import pytest
import threading
import time

import torch

from farlink.comm.torchft_backend import TorchftCollective
from farlink.testing import (
    FaultyCollective,
    Faults,
    HealingGroup,
    in_threads,
    lighthouse_server,
    run_replicas,
)

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

torch.set_num_threads(1)


def test_a_lost_member_fails_the_round_everywhere_and_comes_back_healed() -> None:
    group = HealingGroup(3, timeout=30)
    lost_at = 1
    states = {m: torch.full((2,), float(m)) for m in range(3)}
    back = threading.Event()  # the survivors committed a round without member 2

    def member(m: int, coll) -> list:  # noqa: ANN001
        coll.register_state(lambda: states[m].clone(), lambda s: states[m].copy_(s))
        out = []
        for r in range(4):
            if m == 2 and r == lost_at:
                coll.begin_round()
                group.lose(2)  # mid-round: the survivors' collectives see it gone
                back.wait(30)
                continue
            if m == 2 and r == lost_at + 1:
                continue
            if m == 0 and r == lost_at + 2:
                group.rejoin(2)  # this round waits for it
                back.set()
            info = coll.begin_round()
            t = states[m].clone()
            coll.all_reduce_sum([t])
            ok = coll.commit()
            if ok:
                states[m] = t / info.world_size
            out.append((info.world_size, info.healed, ok))
        return out

    results = in_threads(member, {m: group.member(m) for m in range(3)}, timeout=60)
    # the round member 2 was lost in commits nowhere; the next runs without it, the last
    # with it again, healed: it came back behind
    for survivor in (0, 1):
        assert results[survivor] == [(3, False, True), (3, False, False), (2, False, True),
                                     (3, False, True)]
    assert results[2] == [(3, False, True), (3, True, True)]
    assert torch.equal(states[0], states[1]) and torch.equal(states[0], states[2])


def test_torchft_replica_crashed_at_a_round_restarts_and_heals_and_a_failed_exchange_commits_nowhere(
) -> None:
    faults = Faults().fail_at(replica=1, round=2).fail_exchange_at(round=0)
    # quorums of both: the survivor's next round waits for the restarted replica, which heals
    with lighthouse_server(min_replicas=2, join_timeout_s=1, heartbeat_timeout_s=1) as address:
        def train(replica: int, attempt: int) -> list:
            state = {"x": torch.full((3,), 10.0 * (replica + 1) * (attempt + 1))}
            coll = FaultyCollective(
                TorchftCollective(f"r{replica}", address, min_replicas=2, round_timeout=3),
                faults, replica)
            coll.register_state(lambda: {"x": state["x"].clone()},
                                lambda s: state.update(x=s["x"].clone()))
            out = []
            try:
                for _ in range(4 if attempt == 0 else 2):
                    info = coll.begin_round()
                    t = state["x"].clone()
                    coll.all_reduce_sum([t])
                    ok = coll.commit()
                    if ok:
                        state["x"] = t / info.world_size
                    out.append((info.healed, info.world_size, ok))
            finally:
                coll.close()
            return [attempt, out, state["x"].tolist()]

        results = run_replicas(train, replicas=2, attempts=2, timeout=120)
    assert (1, 2, "crash") in faults.fired and (0, 0, "exchange") in faults.fired
    assert results[0][1][0] == (False, 2, False)  # the failed exchange committed nowhere
    attempt, out, final = results[1]
    assert attempt == 1 and out[0][0]  # restarted, and healed in its first round back
    assert final == results[0][2]


def test_a_dropped_payload_arrives_empty_a_delayed_one_late_and_a_barrier_orders_threads() -> None:
    group = HealingGroup(2, timeout=30)
    faults = (Faults().drop_payload(replica=1, round=0).delay_payload(replica=0, round=1,
                                                                      seconds=0.5)
              .barrier_at("commit", round=1, parties=3))  # both replicas and the test thread
    stamps = {}  # when replica 0 began its delayed gather, when the barrier let the test go

    def member(m: int, coll) -> list:  # noqa: ANN001
        coll = FaultyCollective(coll, faults, m)
        coll.register_state(lambda: None, lambda s: None)
        out = []
        for r in range(2):
            coll.begin_round()
            if (m, r) == (0, 1):
                stamps["gather"] = time.monotonic()
            gathered = coll.all_gather_bytes(bytes([m + 1]) * 4)
            out.append((gathered, coll.commit()))
        return out

    def observer(_: object, __: object) -> None:
        faults.wait("commit", 1)  # released only when both replicas reached round 1's commit
        stamps["release"] = time.monotonic()

    results = in_threads(lambda m, c: observer(m, c) if m == "test" else member(m, c),
                         {0: group.member(0), 1: group.member(1), "test": None}, timeout=60)
    assert results[0][0] == ([bytes([1]) * 4, b""], True)  # replica 1's payload dropped
    assert results[0][1] == ([bytes([1]) * 4, bytes([2]) * 4], True)
    # replica 0's round-1 payload was held half a second, and the barrier waited for it (timed
    # from replica 0's own gather, not from the observer thread's start, which a busy machine
    # may schedule after the delay began)
    assert stamps["release"] - stamps["gather"] >= 0.5
    assert [f[2] for f in faults.fired] == ["drop", "delay"]
