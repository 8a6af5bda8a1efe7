"""A hostile member of a hivemind group (real daemons on loopback, ``--auth secret`` updates)
cannot fill other members' slots, split the replicas by sending different updates to different
groupmates, or poison the round with an invalid token count.

The hostile member is the library's own :class:`HivemindCollective` with what it puts on the
wire overridden: it pushes forged envelopes (valid MACs: it holds the run's secret) under the
other members' ranks before they send theirs, or pushes one update to one groupmate and another
to the rest.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

pytest.importorskip("hivemind")

from test_hivemind_early_matchmaking import FAST, in_threads  # noqa: E402

from farlink.codecs import envelope, make_compressor  # noqa: E402
from farlink.comm.hivemind_backend import HivemindCollective  # noqa: E402
from farlink.robust.aggregators import make_aggregator  # noqa: E402
from farlink.robust.auth import make_authenticator  # noqa: E402
from farlink.robust.ledger import ContributionLedger  # noqa: E402
from farlink.sync.exchange import Exchange  # noqa: E402

RUN, SECRET = "trust-seams", "s3cret"
HONEST = torch.tensor([1.0, 0.0])


class Hostile(HivemindCollective):
    """A member that lies on the wire in the round's first all-gather (its update)."""

    forge = None  # slot owner's PeerID -> the bytes pushed into that owner's slot everywhere
    equivocate = None  # target PeerID -> the payload that target gets instead (None: the real)

    async def _exchange(self, group, key, data, timeout, kind="data"):  # noqa: ANN001, ANN201
        if self.forge is not None and key.endswith(b"/g1"):
            pushes = [self._request(group.peers[target], "put",
                                    {"key": key, "rank": slot, "part": 0, "parts": 1},
                                    [self.forge(group.peers[slot])])
                      for target in range(group.size) if target != group.me
                      for slot in range(group.size) if slot not in (group.me, target)]
            self.answers = await asyncio_gather(pushes)
        return await super()._exchange(group, key, data, timeout, kind)

    async def _request(self, peer, handler, header, bodies):  # noqa: ANN001, ANN201
        if handler == "put" and self.equivocate is not None \
                and bytes(header["key"]).endswith(b"/g1"):
            other = self.equivocate(peer)
            bodies = bodies if other is None else [other]
        return await super()._request(peer, handler, header, bodies)


async def asyncio_gather(coros):  # noqa: ANN001, ANN201
    import asyncio

    return await asyncio.gather(*coros, return_exceptions=True)


def _auth(name: str):  # noqa: ANN202
    return make_authenticator("secret", secret=SECRET, peer_id=name)


def _signed(name: str, round_id: int, tensor: torch.Tensor, weight: float = 10.0) -> bytes:
    compressor = make_compressor("none")
    return _auth(name).sign(envelope.pack(name, round_id, weight,
                                          {"u": compressor.encode("u", tensor)},
                                          {"u": tuple(tensor.shape)}, {"u": torch.float32}))


@pytest.fixture(scope="module")
def group():  # noqa: ANN201
    # a busy machine (tests in parallel) may take seconds to deliver a payload; the rounds
    # here end when every payload is in, so a longer limit costs a passing test nothing
    opts = dict(target_group_size=3, min_group_size=3, **{**FAST, "gather_timeout": 20.0})
    first = HivemindCollective(RUN, **opts)
    members = {"w0": first, "w1": HivemindCollective(RUN, first.maddrs, **opts),
               "bad": Hostile(RUN, first.maddrs, **opts)}
    yield members
    for coll in members.values():
        coll.close()


def _round(members: dict, hostile_update: torch.Tensor, hostile_weight: float = 10.0,
           honest_delay: float = 0.0) -> dict:
    ledgers = {name: ContributionLedger() for name in members}
    lock = threading.Lock()

    def one(name: str, coll: HivemindCollective):  # noqa: ANN202
        with lock:
            ex = Exchange(coll, make_compressor("none"), sender=name,
                          aggregator=make_aggregator("median"), authenticator=_auth(name),
                          ledger=ledgers[name])
        info = coll.begin_round()
        hostile = name == "bad"
        if not hostile:
            time.sleep(honest_delay)  # the honest members compute; the forger is ready first
        result = ex.average({"u": hostile_update if hostile else HONEST},
                            hostile_weight if hostile else 10.0, info.round_id)
        ok = coll.commit()
        ex.settle(result, info.round_id, ok)
        return info, result, ok, ledgers[name]

    return in_threads(one, members, timeout=120)


def test_an_invalid_token_claim_is_refused_and_the_round_stays_finite(group: dict) -> None:
    results = _round(group, HONEST, hostile_weight=1e39)
    for name in ("w0", "w1"):
        info, result, ok, ledger = results[name]
        assert ok, name
        assert torch.isfinite(result.tensors["u"]).all()
        torch.testing.assert_close(result.tensors["u"], HONEST)
        assert result.rejected["bad"].startswith("InvalidWeight"), result.rejected
        assert ledger.get("bad").updates_rejected == 1 and ledger.get("bad").tokens_accepted == 0


def test_a_member_cannot_fill_other_members_slots(group: dict, caplog) -> None:  # noqa: ANN001
    names = {coll.peer_id: name for name, coll in group.items()}
    bad = group["bad"]
    round_id = bad.round_id
    bad.forge = lambda owner: _signed(names[owner], round_id, torch.tensor([0.0, 100.0]))
    caplog.set_level(logging.WARNING, logger="farlink.comm.hivemind_backend")
    try:
        # its own update is the forged one too: with the forgeries, two of three slots
        # would hold it and the median would be the forger's
        results = _round(group, torch.tensor([0.0, 100.0]), honest_delay=1.0)
    finally:
        bad.forge = None
    states = []
    for name in ("w0", "w1"):
        info, result, ok, ledger = results[name]
        assert ok, name
        assert sorted(result.accepted) == ["bad", "w0", "w1"], result.rejected
        torch.testing.assert_close(result.tensors["u"], HONEST)  # the honest updates were used
        assert ledger.peers() == ["bad", "w0", "w1"]
        states.append(result.tensors["u"])
    torch.testing.assert_close(states[0], states[1])  # the replicas agree
    assert all(isinstance(a, tuple) for a in bad.answers)  # every forgery reached its target
    # ... and was refused: at once (its answer says why), or, when it reached its target before
    # the target knew the round's group, parked (answered "ok") and refused when filed; either
    # way the refusal is logged, once per forgery
    assert all("error" in a[0] or a[0].get("ok") for a in bad.answers), bad.answers
    refusals = [r.getMessage() for r in caplog.records if "refused a payload" in r.getMessage()]
    assert len(refusals) >= len(bad.answers), (refusals, bad.answers)
    assert all(str(bad.peer_id) in m and "slot" in m for m in refusals), refusals


def test_a_member_that_sends_different_updates_is_named_and_nothing_commits(group: dict) -> None:
    names = {coll.peer_id: name for name, coll in group.items()}
    bad = group["bad"]
    round_id = bad.round_id
    # w1 gets another, validly signed update than w0 and the hostile member itself
    bad.equivocate = lambda target: (_signed("bad", round_id, torch.tensor([0.0, 5.0]))
                                     if names[target] == "w1" else None)
    try:
        results = _round(group, torch.tensor([0.0, 1.0]))
    finally:
        bad.equivocate = None
    for name in ("w0", "w1", "bad"):
        info, result, ok, ledger = results[name]
        assert not ok, name  # no replica commits the round
        assert info.round_id == round_id and group[name].round_id == round_id
    for name in ("w0", "w1"):
        _, result, _, ledger = results[name]
        assert result.rejected["bad"].startswith("equivocation"), result.rejected
        assert result.tensors == {}
        assert ledger.get("bad").rejections == {"equivocation": 1}
        assert "equivocation" in str(group[name].last_failure)
        # ... and it counts toward excluding it: a member that keeps equivocating is left out
        assert group[name].strikes.count.get(str(bad.peer_id)) == 1


def test_a_senders_payloads_for_other_slots_do_not_take_the_place_of_its_own() -> None:
    """Payloads that arrive before this peer knows the round's group wait until it does. A
    member that pushed payloads for other members' slots first, then its own, must still get
    its own filed (its forgeries are refused when filed): the early mailbox once kept one payload
    per sender, the first, so the forger's own was dropped and every honest member waited for
    it until the round was discarded (seen under load in the round above)."""
    from hivemind.p2p import PeerID

    from farlink.comm.hivemind_backend import EARLY_CLAIMS, _Group, _Mailbox

    peers = [PeerID(bytes([0, 34, i]) + bytes(31)) for i in range(3)]
    me = object.__new__(HivemindCollective)  # only its mailbox: no daemon
    me._group, me._mailbox = None, _Mailbox()
    key = b"round-7/g1"
    forger = peers[0]
    assert me._deliver(key, forger, 1, b"forged for 1") is None  # held until the group is known
    assert me._deliver(key, forger, 2, b"forged for 2") is None
    assert me._deliver(key, forger, 0, b"its own") is None
    group = _Group(group_id=b"round-7", peers=peers, client=[False] * 3, bandwidth=[1.0] * 3,
                   committed=[7] * 3, me=2, round_id=7)
    me._adopt_early(group)
    assert me._mailbox.slots[key] == {0: b"its own"}  # the forgeries refused, its own filed
    # a bound on what one sender may leave before the group is known
    other = b"round-8/g1"
    for claim in range(EARLY_CLAIMS):
        assert me._deliver(other, forger, claim, b"x") is None
    assert "more than" in me._deliver(other, forger, EARLY_CLAIMS, b"x")
