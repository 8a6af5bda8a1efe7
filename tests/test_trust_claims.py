"""A member's claimed token count cannot take over or poison a round, and a non-finite aggregate
is never applied (real exchanges over the in-process collective, members as threads, under
``--auth secret``: the gathered path, where each member's update and claim arrive apart; the
unauthenticated fp32 mean is a plain sum, where a member controls its contribution outright).

Three honest members send (1, 0) and claim 10 tokens; the hostile member sends (0, 1) with the
same norm and claims a huge, infinite or negative count. The second coordinate of the aggregate
is the hostile member's share of the round.
"""

from __future__ import annotations

import math

import pytest
import torch

from farlink.codecs import envelope, make_compressor
from farlink.codecs.base import CodecError
from farlink.comm.inprocess import InProcessGroup
from farlink.robust.aggregators import make_aggregator
from farlink.robust.auth import make_authenticator
from farlink.robust.ledger import ContributionLedger
from farlink.robust.weights import CLAIM_FACTOR, bound_claims, round_token_bound
from farlink.sync.exchange import Exchange

HONEST_TOKENS, MEMBERS, HOSTILE = 10.0, 4, 3


def _auth(rank: int):  # noqa: ANN202
    return make_authenticator("secret", secret="s3cret", peer_id=f"w{rank}")


def _round(claim: float, aggregator: str = "mean", update=None,  # noqa: ANN001, ANN202
           max_weight: float | None = None):
    ledgers = [ContributionLedger() for _ in range(MEMBERS)]

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        ex = Exchange(collective, make_compressor("none"), sender=f"w{rank}",
                      aggregator=make_aggregator(aggregator), ledger=ledgers[rank],
                      max_weight=max_weight, authenticator=_auth(rank))
        info = collective.begin_round()
        if update is not None:
            tensor = update(rank)
        else:
            tensor = torch.tensor([0.0, 1.0]) if rank == HOSTILE else torch.tensor([1.0, 0.0])
        result = ex.average({"u": tensor}, claim if rank == HOSTILE else HONEST_TOKENS,
                            info.round_id)
        ok = collective.commit()
        ex.settle(result, info.round_id, ok)
        return result, ok

    return InProcessGroup(MEMBERS).run(member), ledgers


CAPPED_SHARE = CLAIM_FACTOR / (MEMBERS - 1 + CLAIM_FACTOR)


@pytest.mark.parametrize("aggregator", ["mean", "norm_bounded", "trimmed_mean"])
def test_a_huge_claim_buys_no_more_than_the_capped_share(aggregator: str) -> None:
    results, ledgers = _round(1e30, aggregator)
    for (result, ok), ledger in zip(results, ledgers):
        assert ok
        share = float(result.tensors["u"][1])
        if aggregator != "trimmed_mean":  # the trimmed mean drops the outlier coordinate
            assert share == pytest.approx(CAPPED_SHARE, rel=1e-5), aggregator
        assert share <= CAPPED_SHARE + 1e-6 and share < 2 / MEMBERS  # never twice a fair share
        assert result.tokens["w3"] == CLAIM_FACTOR * HONEST_TOKENS
        assert "w3" in result.capped and "median" in result.capped["w3"]
        record = ledger.get("w3")  # credited the bounded count, and the cap is on record
        assert record.tokens_accepted == CLAIM_FACTOR * HONEST_TOKENS
        assert record.tokens_claimed == 1e30 and record.claims_capped == 1
        assert ledger.get("w0").tokens_accepted == HONEST_TOKENS


@pytest.mark.parametrize("claim", [1e39, math.inf, -1.0])
def test_a_claim_outside_float32_or_negative_is_refused_and_nothing_is_nan(claim: float) -> None:
    results, ledgers = _round(claim)
    for (result, ok), ledger in zip(results, ledgers):
        assert ok and torch.isfinite(result.tensors["u"]).all()
        torch.testing.assert_close(result.tensors["u"], torch.tensor([1.0, 0.0]))
        assert result.accepted == ["w0", "w1", "w2"]
        assert result.total_weight == 3 * HONEST_TOKENS
        assert "w3" not in ledger.peers() or ledger.get("w3").tokens_accepted == 0


def test_a_claim_over_the_runs_round_bound_counts_as_that_bound() -> None:
    """Two members (no median to compare with): the run's bound still holds."""
    bound = round_token_bound(tokens_per_step=2, inner_steps=1)  # = 8 tokens a round
    ledgers = [ContributionLedger() for _ in range(2)]

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        ex = Exchange(collective, make_compressor("none"), sender=f"w{rank}",
                      ledger=ledgers[rank], max_weight=bound, authenticator=_auth(rank))
        info = collective.begin_round()
        result = ex.average({"u": torch.tensor([float(rank)])}, 1e30 if rank else bound,
                            info.round_id)
        ex.settle(result, info.round_id, collective.commit())
        return result

    for result, ledger in zip(InProcessGroup(2).run(member), ledgers):
        assert float(result.tensors["u"]) == pytest.approx(0.5)  # equal weights: 8 and 8
        assert "w1" in result.capped and ledger.get("w1").tokens_accepted == bound


def test_the_envelope_names_an_invalid_weight() -> None:
    for weight in (1e39, -1.0, -0.5):
        with pytest.raises(envelope.InvalidWeight):
            envelope.unpack(envelope.pack("p", 0, weight, {}, {}, {}))
    for weight in (math.inf, math.nan):  # JSON's Infinity/NaN: refused as a corrupt header
        with pytest.raises(CodecError):
            envelope.unpack(envelope.pack("p", 0, weight, {}, {}, {}))
    assert issubclass(envelope.InvalidWeight, CodecError)
    assert envelope.unpack(envelope.pack("p", 0, envelope.MAX_WEIGHT, {}, {}, {})).weight \
        == envelope.MAX_WEIGHT


def test_bound_claims_policy() -> None:
    weights, capped = bound_claims({"a": 10, "b": 10, "c": 12, "d": 1e9, "r": 0})
    assert weights == {"a": 10, "b": 10, "c": 12, "d": 15, "r": 0}  # receivers stay at zero
    assert set(capped) == {"d"}
    # two contributors: no median to trust; only the absolute bound applies
    assert bound_claims({"a": 10, "b": 1e9})[0] == {"a": 10, "b": 1e9}
    assert bound_claims({"a": 10, "b": 1e9}, max_weight=100)[0] == {"a": 10, "b": 100}
    assert bound_claims({"a": 10, "b": 10, "c": 1e9}, factor=None)[0]["c"] == 1e9
    assert round_token_bound(1024, 50) == 4 * 50 * 1024
    assert round_token_bound(1024, 50, round_seconds=2.0) == 4 * 2000 * 1024


def test_an_aggregate_that_overflows_is_dropped_not_applied() -> None:
    """Every update is finite (3e38 passes every per-update check) but their mean overflows
    float32: the round's result carries no tensors and names why, on every member."""
    results, _ = _round(HONEST_TOKENS, update=lambda rank: torch.tensor([3e38, 3e38]))
    for result, ok in results:
        assert result.tensors == {} and result.total_weight == 0
        assert result.rejected["aggregate"].startswith("nonfinite")


def test_one_signing_key_in_two_slots_is_dropped_in_both(tmp_path) -> None:
    """Members 2 and 3 sign with one ed25519 key (a key copied to a second machine, or a
    member replaying another's signed update as its own): which slot is its own cannot be
    told, so both are dropped and the key is named; the other members' updates count."""
    from farlink.robust.keys import generate_keypair

    members = tmp_path / "members"
    for name in ("a", "b", "c"):
        generate_keypair(members / f"{name}.key")
    keys = ["a", "b", "c", "c"]
    ledgers = [ContributionLedger() for _ in range(MEMBERS)]

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        auth = make_authenticator("ed25519", key_file=members / f"{keys[rank]}.key",
                                  allowed_keys=members)
        ex = Exchange(collective, make_compressor("none"), sender=auth.peer_id,
                      authenticator=auth, ledger=ledgers[rank])
        info = collective.begin_round()
        update = torch.tensor([0.0, 1.0]) if keys[rank] == "c" else torch.tensor([1.0, 0.0])
        result = ex.average({"u": update}, HONEST_TOKENS, info.round_id)
        ex.settle(result, info.round_id, collective.commit())
        return result, auth.peer_id

    results = InProcessGroup(MEMBERS).run(member)
    shared = results[3][1]
    for (result, _), ledger in zip(results, ledgers):
        assert shared not in result.accepted and len(result.accepted) == 2
        assert result.rejected[shared].startswith("duplicate") and "[2, 3]" in \
            result.rejected[shared]
        torch.testing.assert_close(result.tensors["u"], torch.tensor([1.0, 0.0]))
        assert ledger.get(shared).rejections == {"duplicate": 2}


def test_a_failed_round_commits_on_no_in_process_member() -> None:
    """The contract the exchange relies on to stop a split round: one member's
    ``fail_round`` makes ``commit`` False on every member, and the next round commits."""
    from farlink.comm.errors import CommError

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        collective.begin_round()
        if rank == 1:
            collective.fail_round(CommError("member 1 saw a split"))
        first = collective.commit()
        collective.begin_round()
        return first, collective.commit(), collective.committed_rounds

    assert InProcessGroup(3).run(member) == [(False, True, 1)] * 3


def test_a_time_budgeted_round_keeps_a_fast_peers_tokens_and_still_bounds_a_liar() -> None:
    """Peers of different speeds claim different counts in a time-budgeted round (a worker 4x
    faster than the median processes 4x its tokens): there the relative bound is 8x the median,
    so honest heterogeneity keeps its weight; with a fixed H it is 1.5x."""
    from farlink.comm.inprocess import InProcessGroup
    from farlink.config import RunConfig
    from farlink.compose import build_exchange
    from farlink.robust.weights import TIMED_CLAIM_FACTOR

    timed = build_exchange(RunConfig(round_seconds=2.0), InProcessGroup(1).member(0), "w0", 0)
    fixed = build_exchange(RunConfig(), InProcessGroup(1).member(0), "w0", 0)
    assert (timed.claim_factor, fixed.claim_factor) == (TIMED_CLAIM_FACTOR, CLAIM_FACTOR)
    speeds = {"w0": 1000.0, "w1": 1000.0, "w2": 2000.0, "w3": 4000.0}  # bench hetero's 1:1:2:4
    bounded, capped = bound_claims(speeds, timed.max_weight, timed.claim_factor)
    assert bounded == speeds and not capped
    bounded, capped = bound_claims({**speeds, "w3": 1e30}, timed.max_weight, timed.claim_factor)
    assert bounded["w3"] == TIMED_CLAIM_FACTOR * 1000.0 and "w3" in capped
