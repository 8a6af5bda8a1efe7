"""Held-out accuracy: greedy answers to problems training never draws, scored by the task."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from farlink.rl.base import TextCodec
from farlink.rl.tasks import Problem, Task


@torch.no_grad()
def greedy_completions(model: nn.Module, codec: TextCodec, prompts: list[str],
                       max_new_tokens: int) -> list[str]:
    """Each prompt's greedy completion (prompts of one token length run as one batch)."""
    model.eval()
    by_length: dict[int, list[int]] = defaultdict(list)
    encoded = [codec.prompt_ids(p) for p in prompts]
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    out: list[str] = [""] * len(prompts)
    for indices in by_length.values():
        tokens = torch.tensor([encoded[i] for i in indices], dtype=torch.long)
        generated = [[] for _ in indices]
        for _ in range(max_new_tokens):
            logits, _ = model(tokens)
            nxt = logits[:, -1].argmax(-1)
            for row, token in enumerate(nxt.tolist()):
                generated[row].append(token)
            if all(codec.eot in g for g in generated):
                break
            tokens = torch.cat([tokens, nxt.unsqueeze(1)], dim=1)
        for row, i in enumerate(indices):
            out[i] = codec.completion_text(generated[row])
    return out


def accuracy(model: nn.Module, codec: TextCodec, task: Task, problems: list[Problem],
             max_new_tokens: int) -> float:
    """Mean reward of greedy completions over ``problems``."""
    completions = greedy_completions(model, codec, [p.prompt for p in problems], max_new_tokens)
    return sum(task.reward(p, c) for p, c in zip(problems, completions)) / len(problems)


@torch.no_grad()
def sampled_accuracy(model: nn.Module, codec: TextCodec, task: Task, problems: list[Problem],
                     max_new_tokens: int, samples: int = 4, temperature: float = 1.0) -> float:
    """Mean reward of ``samples`` seeded completions per problem at ``temperature`` (pass@1 of
    the policy as it samples): smoother than greedy on a few hundred problems, and what RL
    raises first."""
    from farlink.rl.policy import sample_group

    total = 0.0
    for i, problem in enumerate(problems):
        group = sample_group(model, codec.prompt_ids(problem.prompt),
                             [1_000_003 * i + s for s in range(samples)], worker="eval", job=i,
                             version=0, stop_id=codec.eot, max_new_tokens=max_new_tokens,
                             temperature=temperature)
        total += sum(task.reward(problem, codec.completion_text(r.completion_ids)) for r in group)
    return total / (len(problems) * samples)
