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


def _round(claim: float, aggregator: str = "mean", update=None, max_weight=None):  # noqa: ANN001, ANN202
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
