"""Shard claims are their writer's word, so what they say is bounded, and whose they are is
checked: a hostile member that writes claims under invented peer ids, under an honest
volunteer's id (unsigned, signed with its own key, or over the volunteer's own subkey), and
marks a shard its own for a year at round 1e9, neither keeps an honest newcomer out, nor takes
the volunteer's shard, nor moves the join round; each claim is ignored and named. Real DHT
peers."""

from __future__ import annotations

import logging

from farlink.comm.swarm_shards import (CLAIM_TTL, ShardClaim, claim_problem, claim_subkey,
                                       claimant, join_round, peer_id_of)

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


def test_a_claim_is_its_peers_only_when_the_owner_key_hashes_to_the_peer_id(tmp_path) -> None:
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.p2p import PeerID

    from farlink.comm.hivemind_net import identity_key

    paths = [tmp_path / "a.key", tmp_path / "b.key"]
    keys = [identity_key(str(p)) for p in paths]  # made as hivemind makes an identity
    ids = [PeerID.from_identity(p.read_bytes()).to_base58() for p in paths]  # as libp2p derives
    owners = [RSASignatureValidator(k).local_public_key for k in keys]
    assert [peer_id_of(k.get_public_key().to_bytes()) for k in keys] == ids
    assert claimant(claim_subkey(ids[0], owners[0])) == (ids[0], None)
    peer, why = claimant(claim_subkey(ids[0], owners[1]))  # a's id, b's key
    assert peer == ids[0] and why == f"signed by peer {ids[1]}, whose key is not {ids[0]}'s"
    assert "unsigned" in claimant(ids[0])[1] and claimant("Invented0")[0] == "Invented0"
    assert "no RSA public key" in claimant(ids[0] + "[owner:ssh-rsa AAAA]")[1]
    assert "malformed" in claimant(ids[0] + "[owner:ssh-rsa")[1]


class CarelessValidator:
    """What a hostile member's DHT runs instead of the signature check: it signs its own
    ``[owner:...]`` records and stores anyone's, signed or not."""

    @staticmethod
    def make(key):
        from hivemind.dht.crypto import RSASignatureValidator

        class Careless(RSASignatureValidator):
            def validate(self, record) -> bool:
                return True

        return Careless(key)


class HostileClaim(ShardClaim):
    """A member that writes claims for peers that do not exist and for an honest volunteer, at
    round 1e9, and holds a shard of its own for a year."""

    def forge(self, victim: ShardClaim) -> None:
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        lease = now + self.ttl  # a lease like an honest one: only whose claim it is gives it away
        for shard in range(self.num_shards):
            self.dht.store(self.key, [shard, 0.0, 10**9], lease, subkey=f"Invented{shard}")
        taken = [victim.shard, 0.0, 10**9]  # the victim's shard, "claimed" before it
        self.dht.store(self.key, taken, lease, subkey=victim.peer_id)  # unsigned
        self.dht.store(self.key, taken, lease, subkey=claim_subkey(victim.peer_id, self.owner))
        # the victim's own subkey, unsigned, expiring after its claim: would replace it
        self.dht.store(self.key, taken, lease + 5, subkey=victim.subkey)
        self.dht.store(self.key, [0, 0.0, 10**9], now + YEAR, subkey=self.subkey)


def test_claims_under_invented_or_another_peers_id_or_for_a_year_are_ignored_and_named(
        tmp_path, caplog) -> None:
    from farlink.comm.hivemind_net import dht_options, identity_key, start_dht, tcp_maddr

    keys = {name: str(tmp_path / f"{name}.key") for name in ("honest", "hostile", "newcomer")}
    first = start_dht([], **dht_options([tcp_maddr("127.0.0.1")]))  # the bootstrap peer
    dhts = [first]
    claims: list[ShardClaim] = []
    try:
        peers = [str(m) for m in first.get_visible_maddrs()]
        dht = start_dht(peers, **dht_options([tcp_maddr("127.0.0.1")],
                                             identity_path=keys["honest"]))
        dhts.append(dht)
        honest = ShardClaim(dht, "run_shards", 4, identity_key(keys["honest"]), settle=1.0)
        claims.append(honest)
        held = honest.acquire()

        opts = dht_options([tcp_maddr("127.0.0.1")], identity_path=keys["hostile"])
        opts["record_validators"] = [CarelessValidator.make(identity_key(keys["hostile"]))]
        dhts.append(start_dht(peers, **opts))
        hostile = HostileClaim(dhts[-1], "run_shards", 4, identity_key(keys["hostile"]))
        hostile.forge(victim=honest)

        dht = start_dht(peers, **dht_options([tcp_maddr("127.0.0.1")],
                                             identity_path=keys["newcomer"]))
        dhts.append(dht)
        newcomer = ShardClaim(dht, "run_shards", 4, identity_key(keys["newcomer"]), settle=1.0)
        claims.append(newcomer)
        with caplog.at_level(logging.WARNING, "farlink.comm.swarm_shards"):
            shard = newcomer.acquire()  # before: SwarmFull, every shard "held" by Invented*
        assert 0 <= shard < 4 and shard != held and newcomer.join_round == 0
        assert newcomer.live == 2  # the two honest volunteers, nobody invented
        assert newcomer.claims()[honest.peer_id] == (held, honest.since, 0)  # not replaced
        ignored = [r.getMessage() for r in caplog.records]
        expected = [
            "shard claim of Invented0 ignored: unsigned",
            f"shard claim of {honest.peer_id} ignored: unsigned",
            f"shard claim of {honest.peer_id} ignored: signed by peer {hostile.peer_id}, "
            f"whose key is not {honest.peer_id}'s",
            f"shard claim of {hostile.peer_id} ignored: a lease of",
        ]
        for line in expected:
            assert any(m.startswith(line) for m in ignored), (line, ignored)
    finally:
        for claim in claims:
            claim.release()
        for dht in dhts:
            dht.shutdown()
