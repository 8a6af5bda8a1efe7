"""Whether a rollout came from the policy version its worker claims: one forward pass checks it.

The trainer recomputes the logits of the claimed version over the prompt and completion (a
forward pass, far cheaper than generating token by token) and checks three things:

- **commitments**: the worker's top-k logits every n tokens match the recomputed ones (a
  different model, or weights older than claimed, computes different logits);
- **sampling**: every token is the one inverse-CDF sampling picks for the job's seed under the
  recomputed distribution, within a tolerance on the CDF (a fabricated answer, or text from
  anywhere else, is almost never what the seeded draw gives);
- **log-probabilities**: the behaviour log-probabilities the worker sent (which weigh the
  importance ratio) are the recomputed ones.

Honest workers do not compute bit-identical logits (thread counts and batch shapes change
reduction orders, bf16 rounds), so each check has a tolerance. A worker says which precision its
forward ran in (``Rollout.precision``) and the trainer recomputes in the same one, so what is
left to tolerate is reduction order: measured over 1600 honest completions each (sorting:3,
the bench's base model), fp32 draws never land outside their token's CDF interval; bf16 draws
do in 0.25% of completions, by at most 0.009 (0.011 when bf16 is checked in fp32). Every token must be the seeded draw
within :attr:`Tolerance.cdf`; no fraction of misses is forgiven, because a fabricated
completion usually differs from the draw at one token of six (allowing a quarter of the tokens
to miss let fabricated groups through). A draw a little further out (up to
:attr:`Tolerance.cdf_clear`) is a **near-tie**: rounding can do it (the bf16 misses above,
all at the first completion token, whose forward had another shape on the worker), and so can a forged token next to the draw, so the group is
refused but the worker is only banned when near-ties repeat (the trainer's
``near_ties_to_ban``). Beyond ``cdf_clear`` it is not rounding, and the worker is banned.
``farlink bench rl`` reports the honest refusal rate (``false_rejects``) and whether any forged
group reached a step (``cheats``).

:func:`check` returns the first failure as a reason ``"kind: detail"`` (what the ledger counts
by kind) or None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch import nn

from farlink.rl.policy import PRECISIONS, Rollout, completion_logits, scaled, uniform


#: the kind of a refusal that honest rounding can also cause (a draw just past its token's
#: interval): the group is refused, the worker banned only when it keeps happening
NEAR_TIE = "near-tie"


@dataclass(frozen=True)
class Tolerance:
    logit_abs: float = 0.15  # fingerprint logits: |claimed - recomputed| <= abs + rel * |value|
    logit_rel: float = 0.02
    cdf: float = 0.004  # the seeded draw may land this far outside the token's CDF interval
    #: further outside than this is not rounding (10x the largest honest bf16 miss measured):
    #: the worker is banned; between ``cdf`` and this the group is refused as a near-tie
    cdf_clear: float = 0.1
    logprob: float = 0.1  # |claimed - recomputed| behaviour log-probability


@torch.no_grad()
def recomputed_logits(model: nn.Module, rollouts: list[Rollout]) -> list[torch.Tensor]:
    """The completion logits ``model`` computes for one group, in the precision its worker
    says it ran in (so honest rounding differs only by reduction order)."""
    dtype = PRECISIONS[rollouts[0].precision]
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        return [rows.float() for rows in completion_logits(model, rollouts)]


def check(rollout: Rollout, logits: torch.Tensor, temperature: float, every: int,
          tol: Tolerance = Tolerance()) -> str | None:
    """Why ``rollout`` is not what the policy whose completion ``logits`` are given computed
    (``"kind: detail"``), or None when it is. ``every``: the commitment interval the protocol
    asks for (a fingerprint at completion positions 0, every, 2 * every, ...)."""
    n = len(rollout.completion_ids)
    if n == 0 or len(rollout.logprobs) != n or logits.shape[0] != n:
        return f"malformed: {n} tokens, {len(rollout.logprobs)} log-probabilities"
    logits = logits.detach().float()
    if [fp.position for fp in rollout.fingerprints] != list(range(0, n, every)):
        return f"fingerprint: not one every {every} tokens"
    for fp in rollout.fingerprints:
        if not 0 <= fp.position < n or len(fp.ids) != len(fp.values) or not fp.ids:
            return f"fingerprint: malformed at position {fp.position}"
        row = logits[fp.position]
        claimed = torch.tensor(fp.values)
        recomputed = row[torch.tensor(fp.ids)]
        allowed = tol.logit_abs + tol.logit_rel * claimed.abs()
        if bool(((claimed - recomputed).abs() > allowed).any()):
            worst = float((claimed - recomputed).abs().max())
            return f"fingerprint: logits off by {worst:.3f} at token {fp.position}"
        others = row.clone()
        others[torch.tensor(fp.ids)] = float("-inf")
        if float(others.max()) > float(claimed.min()) + float(allowed.max()):
            return f"fingerprint: a larger logit left out at token {fp.position}"
    probs = torch.softmax(scaled(logits, temperature), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    tokens = torch.tensor(rollout.completion_ids)
    upper = cdf.gather(1, tokens.unsqueeze(1)).squeeze(1)
    lower = upper - probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    draws = torch.tensor([uniform(rollout.seed, t) for t in range(n)], dtype=torch.float32)
    outside = torch.maximum(lower - draws, draws - upper)  # > 0: not the token's interval
    if bool((outside > tol.cdf_clear).any()):
        return (f"sampling: {int((outside > tol.cdf).sum())} of {n} tokens are not the "
                f"seeded draw")
    recomputed_logprobs = torch.log(probs.gather(1, tokens.unsqueeze(1)).squeeze(1).clamp_min(1e-30))
    gap = (torch.tensor(rollout.logprobs) - recomputed_logprobs).abs()
    if float(gap.max()) > tol.logprob:
        return f"logprob: claimed log-probabilities off by {float(gap.max()):.3f}"
    if bool((outside > tol.cdf).any()):
        return (f"{NEAR_TIE}: {int((outside > tol.cdf).sum())} of {n} tokens off the seeded "
                f"draw by at most {float(outside.max()):.4f}")
    return None
