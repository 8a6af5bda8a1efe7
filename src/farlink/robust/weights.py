"""How much a peer's claimed token count may weigh in a round.

A peer's update is weighted by the tokens it says it trained on, and nothing checks the claim:
a member claiming 1e30 tokens would be the whole of a token-weighted mean. So every claim is
bounded twice before it weighs anything:

- absolutely, by ``max_weight``: the tokens one peer can process in a round under the run's
  configuration (:func:`round_token_bound`);
- relatively, with 3 or more contributing peers: at most ``CLAIM_FACTOR`` x the round's median
  positive claim (the lower middle one for an even count). A member then cannot buy a share
  larger than ``CLAIM_FACTOR / (n - 1 + CLAIM_FACTOR)`` of a round of ``n`` (1.5/3.5 of three,
  never twice an honest share), under every rule including the plain mean. Honest claims of
  one round are about equal (the same batch and inner steps), so this only costs a peer that
  ran much more than the median (a fast device in a time-budgeted round, a peer that carried
  tokens over failed rounds): it counts as ``CLAIM_FACTOR`` x the median.

In a time-budgeted round peers of different speeds legitimately claim different counts, so the
relative bound is ``TIMED_CLAIM_FACTOR`` (8) x the median there: a member's share of a round of
n is at most ``8 / (n - 1 + 8)``.

Zero claims (a healed or joining peer that only receives) stay zero and do not count towards
the median. The exchange credits the bounded count in the ledger, and records that it capped.
"""

from __future__ import annotations

CLAIM_FACTOR = 1.5
#: the relative bound of a time-budgeted round (``round_seconds``), where peers of different
#: speeds legitimately process different token counts in one round (the fast worker of
#: ``farlink bench hetero``'s 1:1:2:4 processes 4x the median): what one claim may weigh there
TIMED_CLAIM_FACTOR = 8.0
#: rounds' worth of tokens one claim may carry: a peer whose last rounds failed carries their
#: tokens over into the next round's claim
ROUND_SLACK = 4
#: the inner steps per second assumed for a time-budgeted round (no round has a step count):
#: far above any real step of a language model, so only an invented claim exceeds it
MAX_STEPS_PER_SECOND = 1000.0


def round_token_bound(tokens_per_step: int, inner_steps: int,
                      round_seconds: float | None = None) -> float:
    """The most tokens one peer can claim for one round: ``ROUND_SLACK`` rounds of
    ``inner_steps`` steps of ``tokens_per_step`` (grad_accum x batch_size x seq_len); in a
    time-budgeted round, ``MAX_STEPS_PER_SECOND`` x ``round_seconds`` steps instead."""
    steps = inner_steps if round_seconds is None else round_seconds * MAX_STEPS_PER_SECOND
    return float(ROUND_SLACK * max(1.0, steps) * tokens_per_step)


def bound_claims(
    claims: dict[str, float], max_weight: float | None = None,
    factor: float | None = CLAIM_FACTOR,
) -> tuple[dict[str, float], dict[str, str]]:
    """Each peer's weight for the round, and why a claim was capped (peer -> reason).

    ``claims`` are finite and >= 0 (the envelope refuses others); ``factor`` None turns the
    relative cap off (a level whose members legitimately differ in size)."""
    bounded, capped = {}, {}
    for peer, claim in claims.items():
        if max_weight is not None and claim > max_weight:
            capped[peer] = (f"claims {claim:.4g} tokens, more than the {max_weight:.4g} one peer "
                            "can process in a round under this run's config")
            claim = max_weight
        bounded[peer] = float(claim)
    positive = sorted(w for w in bounded.values() if w > 0)
    if factor is not None and len(positive) >= 3:
        limit = factor * positive[(len(positive) - 1) // 2]
        for peer, weight in bounded.items():
            if weight > limit:
                capped[peer] = (f"claims {claims[peer]:.4g} tokens, more than {factor:g} x the "
                                f"round's median claim ({limit / factor:.4g})")
                bounded[peer] = limit
    return bounded, capped
