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

Honest workers do not compute bit-identical logits (thread counts change reduction orders,
bf16 rounds), so each check has a tolerance; :func:`check` returns the first failure as a
reason ``"kind: detail"`` (what the ledger counts by kind) or None. The tolerances are set so
the measured false-reject rate under fp32 vs bf16 and different thread counts stays below 1%
(``farlink bench rl`` reports it) while another model's logits are off by whole units.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from farlink.rl.policy import Rollout, scaled, uniform


@dataclass(frozen=True)
class Tolerance:
    logit_abs: float = 0.15  # fingerprint logits: |claimed - recomputed| <= abs + rel * |value|
    logit_rel: float = 0.02
    cdf: float = 0.02  # the seeded draw may land this far outside the token's CDF interval
    logprob: float = 0.1  # |claimed - recomputed| behaviour log-probability
    #: at most this fraction of positions may miss the sampling check (a near-tie flipped by
    #: rounding); a fabricated completion misses most of its tokens
    miss_fraction: float = 0.25


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
    missed = (draws < lower - tol.cdf) | (draws > upper + tol.cdf)
    if float(missed.float().mean()) > tol.miss_fraction or (n <= 2 and bool(missed.any())):
        return f"sampling: {int(missed.sum())} of {n} tokens are not the seeded draw"
    recomputed_logprobs = torch.log(probs.gather(1, tokens.unsqueeze(1)).squeeze(1).clamp_min(1e-30))
    gap = (torch.tensor(rollout.logprobs) - recomputed_logprobs).abs()
    if float(gap.max()) > tol.logprob:
        return f"logprob: claimed log-probabilities off by {float(gap.max()):.3f}"
    return None
