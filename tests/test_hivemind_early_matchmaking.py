"""Matchmaking ahead of the round (``expect_round``) on real hivemind daemons and sockets: the
group is formed before any member reaches its boundary, ``begin_round`` only collects it, and a
member that leaves between forming and the round fails that round alone; the next forms without
it. The sync layer hints each round from the training time between the last two."""

from __future__ import annotations

import time

import torch
from torch import nn

from farlink.codecs import make_compressor
from farlink.comm.hivemind_backend import HivemindCollective
from farlink.comm.inprocess import InProcessCollective, InProcessGroup
from farlink.config import RunConfig
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange
from farlink.testing import in_threads

torch.set_num_threads(1)
FAST = dict(matchmaking_time=1.5, request_timeout=1.0, allreduce_timeout=8.0, gather_timeout=8.0,
            commit_timeout=6.0, round_timeout=60.0)
# a dead groupmate is waited for until these run out: short, so the failed round ends soon
SHORT = {**FAST, "allreduce_timeout": 4.0, "gather_timeout": 4.0, "commit_timeout": 3.0}


def one_round(name: str, coll: HivemindCollective) -> tuple:
    info = coll.begin_round()
    x = [torch.full((50,), float(ord(name)))]
    coll.all_reduce_sum(x)
    return info, x[0], coll.commit()


def wait_until(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_group_is_formed_before_the_boundary_and_collected_by_begin_round() -> None:
    a = HivemindCollective("early", target_group_size=2, **FAST)
    b = HivemindCollective("early", a.maddrs, target_group_size=2, **FAST)
    members = {"a": a, "b": b}
    try:
        in_threads(one_round, members)  # round 0 as before: matchmaking at the boundary
        for coll in (a, b):
            coll.expect_round(1.0)  # due within the matchmaking lead: look at once
        # nobody has called begin_round, and the group already exists on both sides
        wait_until(lambda: a._search.done() and b._search.done(), "the early group")
        groups = {name: c._search.result() for name, c in members.items()}
        assert groups["a"].group_id == groups["b"].group_id

        results = in_threads(one_round, members)
        expected = torch.full((50,), float(ord("a") + ord("b")))
        for info, summed, ok in results.values():
            assert ok and info.round_id == 1 and info.world_size == 2
            assert info.peers == [str(p) for p in groups["a"].peer_ids]  # the early group
            torch.testing.assert_close(summed, expected)
        assert a.round_id == b.round_id == 2

        # a hint for a round that never comes: close lets go of the search without hanging
        a.expect_round(30.0)
        b.expect_round(0.0)
        t0 = time.monotonic()
        b.close()
        a.close()
        assert time.monotonic() - t0 < 20
    finally:
        a.close()
        b.close()


def test_a_member_that_leaves_after_the_early_group_formed_fails_only_that_round() -> None:
    a = HivemindCollective("early-leave", target_group_size=3, **SHORT)
    b = HivemindCollective("early-leave", a.maddrs, target_group_size=3, **SHORT)
    c = HivemindCollective("early-leave", a.maddrs, target_group_size=3, **SHORT)
    try:
        first = in_threads(one_round, {"a": a, "b": b, "c": c})
        assert all(ok and info.world_size == 3 for info, _, ok in first.values())
        for coll in (a, b, c):
            coll.expect_round(0.5)
        wait_until(lambda: all(x._search.done() for x in (a, b, c)), "the early group of 3")
        c.close()  # leaves between forming the group and the round

        def failed_then_recovered(name: str, coll: HivemindCollective) -> tuple:
            broken = one_round(name, coll)
            return broken, one_round(name, coll)

        results = in_threads(failed_then_recovered, {"a": a, "b": b}, timeout=150)
        expected = torch.full((50,), float(ord("a") + ord("b")))
        for (broken_info, _, broken_ok), (info, summed, ok) in results.values():
            assert broken_info.world_size == 3 and not broken_ok  # c's round is discarded
            assert ok and info.world_size == 2 and info.round_id == 1
            torch.testing.assert_close(summed, expected)
    finally:
        for coll in (a, b, c):
            coll.close()


class HintRecorder(InProcessCollective):
    """An in-process member that keeps the round hints it is given, and which rounds it was
    told are the run's last (``final``, when hinted and when begun)."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        super().__init__(group, rank)
        self.hints: list[float] = []
        self.hinted_final: list[bool] = []
        self.begun_final: list[bool] = []

    def expect_round(self, in_seconds: float, final: bool = False) -> None:
        self.hints.append(in_seconds)
        self.hinted_final.append(final)

    def begin_round(self, final: bool = False, **round_options):  # noqa: ANN003, ANN201
        self.begun_final.append(final)
        return super().begin_round(final, **round_options)


def test_diloco_hints_each_round_with_the_training_time_since_the_last() -> None:
    collective = HintRecorder(InProcessGroup(1), 0)
    model = nn.Linear(4, 1, bias=False)
    cfg = RunConfig(algorithm="diloco", codec="none", steps=9, inner_steps=3, warmup_steps=0)
    algo = algorithm_class("diloco")(model, cfg, collective,
                                     Exchange(collective, make_compressor("none"), sender="r0"))
    step_seconds = 0.05
    rounds = 0
    while not algo.finished():
        model(torch.ones(2, 4)).sum().backward()
        time.sleep(step_seconds)  # the inner step's compute
        rounds += algo.step(tokens=2).synced
    assert rounds == 3
    # round 1 has no previous gap; round 2 hints the 3 inner steps before it; the last none
    assert len(collective.hints) == 1
    assert 3 * step_seconds <= collective.hints[0] < 3 * step_seconds + 1.0


def test_diloco_tells_the_collective_which_round_is_the_runs_last() -> None:
    """The last round is said as an argument (``begin_round(final=True)``, and in the hint
    before it), so a backend of small groups forms it with every live peer."""
    collective = HintRecorder(InProcessGroup(1), 0)
    model = nn.Linear(4, 1, bias=False)
    cfg = RunConfig(algorithm="diloco", codec="none", steps=9, inner_steps=3, warmup_steps=0)
    algo = algorithm_class("diloco")(model, cfg, collective,
                                     Exchange(collective, make_compressor("none"), sender="r0"))
    while not algo.finished():
        model(torch.ones(2, 4)).sum().backward()
        algo.step(tokens=2)
    assert collective.begun_final == [False, False, True]
    assert collective.hinted_final == [True]  # the hint after round 2 announces round 3


def test_client_mode_members_that_look_earlier_than_the_leader_join_it_at_once() -> None:
    """A client-mode member cannot lead, so its join request's expiration (its own schedule)
    ranks nobody: a leader whose schedule ends later than a client's must accept it, not
    turn it away until the leader's window runs out (the group formed a whole window late)."""
    server = HivemindCollective("late-leader", target_group_size=3, min_group_size=3, **FAST)
    clients = [HivemindCollective("late-leader", server.maddrs, client_mode=True,
                                  target_group_size=3, min_group_size=3, **FAST)
               for _ in range(2)]
    members = {"s": server, "c": clients[0], "d": clients[1]}
    try:
        in_threads(one_round, members)
        server.expect_round(3.0)  # the leader expects its boundary later than the clients
        for client in clients:
            client.expect_round(0.0)
        # the leader declares itself 1.5 s from now, for a window ending 4.5 s from now; the
        # clients, looking since now, ask it as soon as it is declared
        time.sleep(2.5)

        def timed_round(name: str, coll: HivemindCollective) -> tuple:
            start = time.monotonic()
            info = coll.begin_round()
            waited = time.monotonic() - start
            x = [torch.ones(50)]
            coll.all_reduce_sum(x)
            return info, waited, coll.commit()

        results = in_threads(timed_round, members)
        for name, (info, waited, ok) in results.items():
            assert ok and info.world_size == 3 and info.round_id == 1
            # before the leader's window ends (2 s from here): not a window late
            assert waited < 1.0, f"{name} waited {waited:.2f} s for a group of members all looking"
    finally:
        for coll in members.values():
            coll.close()


def test_a_group_is_full_with_the_live_swarm_not_with_the_runs_room() -> None:
    """A volunteer swarm has room for ``--workers`` peers but fewer live ones: a group is full,
    and starts at once, when every live peer (``swarm_size``) is in it. Without the count the
    same two peers wait out the whole matchmaking window for two that do not exist."""
    options = {**FAST, "matchmaking_time": 4.0}
    first = HivemindCollective("room", target_group_size=4, min_group_size=2, **options)
    members = {"a": first, "b": HivemindCollective("room", first.maddrs, target_group_size=4,
                                                   min_group_size=2, **options)}

    def timed_round(name: str, coll: HivemindCollective) -> tuple:
        start = time.monotonic()
        info, _, ok = one_round(name, coll)
        return info, time.monotonic() - start, ok

    try:
        waited_for_room = in_threads(timed_round, members)
        for coll in members.values():
            coll.swarm_size = lambda: 2
        live = in_threads(timed_round, members)
    finally:
        for coll in members.values():
            coll.close()
    for name in members:
        (info, room_s, ok), (live_info, live_s, live_ok) = waited_for_room[name], live[name]
        assert ok and live_ok and info.world_size == live_info.world_size == 2
        assert room_s >= 3.5, f"{name}: {room_s:.2f} s; a group of 2 of 4 waits the window"
        assert live_s < 2.0, f"{name} waited {live_s:.2f} s for a group of the whole live swarm"
