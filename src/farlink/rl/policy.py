"""Sampling a group of completions with seeds the trainer chose, and what a worker commits to.

Every completion token is drawn by inverse-CDF sampling from a uniform number derived from the
job's seed and the token's position (:func:`uniform`), not from a generator's hidden state: the
trainer, given the same logits, can replay the draw and tell whether a token is the one the
claimed policy would have sampled (:mod:`farlink.rl.verify`). A worker also commits, every
``every`` tokens, to the top-``k`` logits it computed (ids and fp16 values, TOPLOC's idea in its
simplest form): about ``6 * k`` bytes per ``every`` tokens, checkable with one forward pass.

Models are farlink's GPT or any module with ``forward(idx) -> (logits, _)``; there is no KV cache,
so each new token reruns the (short) sequence: affordable for the few-token answers of the
shipped tasks on a CPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) fixed by (seed, position): both sides derive the same one."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


@dataclass
class Fingerprint:
    """Top-``k`` logits at one completion position: ``ids`` and their values (fp16 on the wire)."""

    position: int  # index into the completion
    ids: list[int]
    values: list[float]

    def nbytes(self) -> int:
        return 2 + len(self.ids) * (4 + 2)


@dataclass
class Rollout:
    """One sampled completion and what its worker claims about it. The reward is not here:
    the trainer computes it."""

    worker: str
    job: int
    seed: int
    version: int  # the policy version the worker says it sampled with
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-probabilities of the completion tokens
    fingerprints: list[Fingerprint] = field(default_factory=list)
    #: what the worker's forward ran in (:data:`PRECISIONS`): the verifier recomputes in the
    #: same, so honest rounding differs only by reduction order
    precision: str = "fp32"

    def nbytes(self) -> int:
        """What it costs on the wire: ids as int32, logprobs as fp32, the fingerprints."""
        return (32 + 4 * (len(self.prompt_ids) + 2 * len(self.completion_ids))
                + sum(f.nbytes() for f in self.fingerprints))


#: a worker's forward precision -> the dtype its autocast runs in
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def precision_of(dtype: torch.dtype) -> str:
    for name, known in PRECISIONS.items():
        if known == dtype:
            return name
    raise ValueError(f"rollouts are sampled in one of {sorted(PRECISIONS)}, not {dtype}")


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits.float() / temperature


def fingerprint_at(logits: torch.Tensor, position: int, k: int) -> Fingerprint:
    values, ids = torch.topk(logits.float(), k)
    return Fingerprint(position, ids.tolist(), values.half().float().tolist())


@torch.no_grad()
def sample_group(model: nn.Module, prompt_ids: list[int], seeds: list[int], *, worker: str,
                 job: int, version: int, stop_id: int, max_new_tokens: int,
                 temperature: float = 1.0, every: int = 4, k: int = 4,
                 dtype: torch.dtype = torch.float32) -> list[Rollout]:
    """One completion per seed of ``prompt_ids``, sampled as a batch, each ending at
    ``stop_id`` (kept) or after ``max_new_tokens``. ``dtype``: what the forward runs in
    (bf16 autocast is honest nondeterminism the verifier must tolerate)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    precision = precision_of(dtype)
    model.eval()
    rows = len(seeds)
    tokens = torch.tensor([prompt_ids] * rows, dtype=torch.long)
    completions: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    prints: list[list[Fingerprint]] = [[] for _ in range(rows)]
    done = [False] * rows
    for t in range(max_new_tokens):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits, _ = model(tokens)
        last = logits[:, -1].float()
        probs = torch.softmax(scaled(last, temperature), dim=-1)
        cdf = torch.cumsum(probs, dim=-1)
        picked = []
        for r in range(rows):
            u = uniform(seeds[r], t)
            token = min(int(torch.searchsorted(cdf[r], torch.tensor(u), right=True)),
                        probs.shape[-1] - 1)
            picked.append(token)
            if done[r]:
                continue
            completions[r].append(token)
            logprobs[r].append(float(torch.log(probs[r, token])))
            if t % every == 0:
                prints[r].append(fingerprint_at(last[r], t, k))
            done[r] = token == stop_id
        if all(done):
            break
        tokens = torch.cat([tokens, torch.tensor(picked).unsqueeze(1)], dim=1)
    return [Rollout(worker, job, seeds[r], version, list(prompt_ids), completions[r],
                    logprobs[r], prints[r], precision) for r in range(rows)]


def completion_logits(model: nn.Module, rollouts: list[Rollout]) -> list[torch.Tensor]:
    """For each rollout, the logits that predicted each completion token ([len, vocab]), from
    one forward over the batch (right-padded: a causal model's earlier positions ignore the
    padding)."""
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    width = max(lengths)
    rows = []
    for r in rollouts:
        ids = r.prompt_ids + r.completion_ids
        rows.append(ids + [ids[-1]] * (width - len(ids)))
    logits, _ = model(torch.tensor(rows, dtype=torch.long))
    out = []
    for i, r in enumerate(rollouts):
        start = len(r.prompt_ids) - 1
        out.append(logits[i, start:start + len(r.completion_ids)])
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], temperature: float) -> torch.Tensor:
    """Log-probabilities (with grad, when ``logits`` has it) of ``tokens`` under ``logits``."""
    logp = F.log_softmax(scaled(logits, temperature), dim=-1)
    return logp.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1)).squeeze(1)
