"""GRPO's objective (Shao et al. 2024, DeepSeekMath): no value network, a group baseline.

Each prompt is answered ``G`` times; a completion's advantage is its reward minus the group's
mean, divided by the group's standard deviation (a group whose completions all scored the same
teaches nothing and gets zero). The policy loss is PPO's clipped surrogate on the importance
ratio ``pi_theta / pi_behaviour`` per token, which is also what corrects for rollouts sampled by
an older policy version (asynchronous workers, ``--max-staleness``); an optional KL penalty to a
frozen reference uses the k3 estimator ``exp(ref - new) - (ref - new) - 1`` (unbiased, >= 0).
The loss is averaged over all completion tokens of the batch (DAPO's token-level mean), so long
and short completions weigh per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within one group (population std; zeros for a flat group)."""
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()
    return centred / (rewards.std(unbiased=False) + eps)


@dataclass
class LossParts:
    loss: torch.Tensor
    kl: float  # mean k3 KL to the reference per token (0 without a reference)
    clipped_fraction: float  # tokens whose ratio was clipped
    ratio_mean: float


def grpo_loss(new_logprobs: list[torch.Tensor], behaviour_logprobs: list[torch.Tensor],
              advantages: list[float], clip: float = 0.2, kl_coef: float = 0.0,
              ref_logprobs: list[torch.Tensor] | None = None) -> LossParts:
    """The clipped surrogate (plus ``kl_coef`` times KL) over the tokens of every completion;
    ``advantages[i]`` applies to every token of completion ``i``."""
    if not new_logprobs:
        raise ValueError("no completions to take a loss over")
    new = torch.cat(new_logprobs)
    old = torch.cat(behaviour_logprobs).to(new.dtype)
    adv = torch.cat([torch.full((len(lp),), float(a)) for lp, a in zip(new_logprobs, advantages)])
    ratio = torch.exp(new - old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    loss = -surrogate.mean()
    kl = torch.zeros(())
    if ref_logprobs is not None:
        gap = torch.cat(ref_logprobs).to(new.dtype) - new
        kl = (torch.exp(gap) - gap - 1).mean()
        loss = loss + kl_coef * kl
    clipped = ((ratio - 1).abs() > clip).float().mean()
    return LossParts(loss, float(kl.detach()), float(clipped), float(ratio.detach().mean()))
