"""The base model RL starts from: a short next-token run on a task family's demonstrations.

RL only sharpens what a policy already does sometimes: with zero accuracy every group scores
the same and every advantage is zero. :func:`pretrain` gives a small model the format and a
partial skill from noisy worked examples (:func:`farlink.rl.tasks.demonstrations`) in a minute
of CPU; ``farlink train --corpus FILE.txt`` on the same documents is the multi-island way.
:class:`TextCodec` turns prompts into token ids the way those documents were tokenized: an
end-of-text token, then the prompt, so a completion is what followed a prompt in training.
"""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer
from torch import nn

from farlink.data.tokenizer import eot_id


class TextCodec:
    """Prompt text to ids and completion ids back to text, for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eot = eot_id(tokenizer)

    def prompt_ids(self, prompt: str) -> list[int]:
        return [self.eot] + self.tokenizer.encode(prompt, add_special_tokens=False).ids

    def completion_text(self, ids: list[int]) -> str:
        if self.eot in ids:
            ids = ids[:ids.index(self.eot)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def document_ids(self, document: str) -> list[int]:
        return self.prompt_ids(document) + [self.eot]


def pretrain(model: nn.Module, codec: TextCodec, documents: list[str], steps: int,
             batch: int = 32, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Next-token training on windows of the concatenated documents; the loss per step."""
    stream: list[int] = []
    for document in documents:
        stream += codec.document_ids(document)
    window = min(int(model.config.seq_len), 32) if hasattr(model, "config") else 32
    if len(stream) <= window + 1:
        raise ValueError(f"{len(documents)} documents are too few to pre-train on")
    data = torch.tensor(stream, dtype=torch.long)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:  # linear decay: the last steps settle
            group["lr"] = lr * (1 - step / steps)
        starts = [rng.randrange(len(stream) - window - 1) for _ in range(batch)]
        x = torch.stack([data[s:s + window] for s in starts])
        y = torch.stack([data[s + 1:s + window + 1] for s in starts])
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return losses
