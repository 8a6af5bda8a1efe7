"""A swarm with fewer volunteers than shards trains: its first volunteer alone, then two
together, and its groups grow as others claim shards; more volunteers than shards are told
the run is full. Real DHT peers and collectives (in this process), real shard claims."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from farlink.comm.swarm_shards import group_bounds

SHARDS = 4  # the run's --workers: its room, and min_replicas = 4 as `swarm start` defaults it


def test_group_bounds_follow_the_live_swarm_up_to_the_runs_bounds() -> None:
    assert group_bounds(4, 4, 1) == (1, 1)  # the first volunteer trains alone
    assert group_bounds(4, 4, 2) == (2, 2)
    assert group_bounds(4, 4, 4) == (4, 4)
    assert group_bounds(2, 4, 6) == (2, 4)  # never above the run's group size
    assert group_bounds(2, None, 1) == (1, None)
    assert group_bounds(3, 4, 0) == (1, 1)  # a count not yet read: this volunteer is live


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.mark.slow  # six peers' DHTs and daemons, four rounds of matchmaking: about a minute
def test_first_volunteers_train_whatever_the_shard_count_and_groups_grow(tmp_path) -> None:
    from farlink.comm.hivemind_backend import HivemindCollective
    from farlink.comm.hivemind_net import identity_key
    from farlink.comm.swarm_shards import ShardClaim, SwarmFull

    peers: list[str] = []
    volunteers: list[tuple[HivemindCollective, ShardClaim]] = []
    arrivals = itertools.count()

    def arrive() -> tuple[HivemindCollective, ShardClaim]:
        identity = str(tmp_path / f"identity{next(arrivals)}.key")  # called from threads
        coll = HivemindCollective("growth", peers, min_group_size=SHARDS, identity_path=identity,
                                  target_group_size=SHARDS, matchmaking_time=1.5,
                                  request_timeout=0.5, round_timeout=45.0, commit_timeout=15.0)
        state = {"w": torch.zeros(8)}
        coll.register_state(lambda: dict(state), state.update)
        peers[:] = peers or coll.maddrs
        claim = ShardClaim(coll.dht, "growth_shards", SHARDS, identity_key(identity),
                           progress=lambda: coll.round_id, ttl=9.0, settle=1.0)
        volunteers.append((coll, claim))
        claim.acquire()
        coll.swarm_size = lambda: claim.live  # as `farlink swarm join` wires it
        return coll, claim

    def round_of(members) -> list[int]:
        _wait_for(lambda: all(c.live == len(members) for _, c in members),
                  f"{len(members)} holders counting {len(members)}")
        with ThreadPoolExecutor(len(members)) as pool:
            sizes = list(pool.map(lambda m: m[0].begin_round().world_size, members))
            assert all(pool.map(lambda m: m[0].commit(), members))
        return sizes

    try:
        first = arrive()
        assert round_of([first]) == [1]  # alone, in a run with room for four
        second = arrive()
        assert round_of([first, second]) == [2, 2]
        with ThreadPoolExecutor(4) as pool:  # four more at once, for the two shards left
            late = list(pool.map(lambda _: _try(arrive, SwarmFull), range(4)))
        assert sorted(r is None for r in late) == [False, False, True, True], late
        members = [first, second, *[r for r in late if r is not None]]
        assert sorted(c.shard for _, c in members) == list(range(SHARDS))
        assert round_of(members) == [4, 4, 4, 4]
        assert [c.round_id for c, _ in members] == [3, 3, 3, 3]  # the newcomers healed
    finally:
        for coll, claim in volunteers:
            claim.release()
            coll.close()


def _try(make, refused: type[Exception]):
    try:
        return make()
    except refused:
        return None
