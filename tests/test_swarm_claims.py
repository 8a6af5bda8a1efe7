"""Shard claims are their writer's word, so what they say is bounded: a hostile member that
marks every shard taken for a year under invented peer ids, and announces round 1e9, neither
keeps an honest newcomer out nor moves its join round. Real DHT peers."""

from __future__ import annotations

import logging

from farlink.comm.swarm_shards import CLAIM_TTL, ShardClaim, claim_problem, join_round

YEAR = 365 * 24 * 3600.0


def test_claim_problem_bounds_what_a_claim_says() -> None:
    now = 1000.0
    assert claim_problem([1, 900.0, 5], now + CLAIM_TTL, now, 4) is None
    assert "lease of" in claim_problem([1, 900.0, 5], now + YEAR, now, 4)
    assert "does not have" in claim_problem([7, 900.0, 5], now + 5, now, 4)
    assert "future" in claim_problem([1, now + 3600, 5], now + 5, now, 4)
    assert "malformed" in claim_problem(["x", 1, 2], now + 5, now, 4)
    assert "malformed" in claim_problem([1, 2], now + 5, now, 4)
    assert join_round([10, 11, 10**9]) == 11 and join_round([10, 10**9]) == 10
    assert join_round([]) == 0


class HostileClaim(ShardClaim):
    """A member that writes claims for peers that do not exist, for a year, at round 1e9."""

    def forge(self) -> None:
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        for shard in range(self.num_shards):
            self.dht.store(self.key, [shard, 0.0, 10**9], now + YEAR, subkey=f"Invented{shard}")


def test_a_hostile_members_year_long_claims_are_ignored(caplog) -> None:
    from farlink.comm.hivemind_net import dht_options, start_dht, tcp_maddr

    first = start_dht([], **dht_options([tcp_maddr("127.0.0.1")]))
    dhts = [first]
    try:
        peers = [str(m) for m in first.get_visible_maddrs()]
        dhts.append(start_dht(peers, **dht_options([tcp_maddr("127.0.0.1")])))
        hostile = HostileClaim(first, "run_shards", 4, str(first.peer_id), settle=1.0)
        hostile.forge()
        honest = ShardClaim(dhts[1], "run_shards", 4, str(dhts[1].peer_id), settle=1.0)
        with caplog.at_level(logging.WARNING, "farlink.comm.swarm_shards"):
            shard = honest.acquire()  # before: SwarmFull, every shard "held" for a year
        assert 0 <= shard < 4 and honest.join_round == 0
        ignored = [r.getMessage() for r in caplog.records]
        assert any("shard claim of Invented0 ignored: a lease of" in m for m in ignored), ignored
        honest.release()
    finally:
        for dht in dhts:
            dht.shutdown()
