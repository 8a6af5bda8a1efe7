"""``farlink generate RUN_DIR --prompt TEXT``: sample text from a run's model.

The usual autoregressive loop (as in nanoGPT's ``sample.py``): the context is cropped to the
model's length, the last position's logits are divided by the temperature, all but the ``top_k``
most likely tokens are cut, and the next token is drawn. A seeded generator makes a sample
reproducible; temperature 0 picks the most likely token (greedy). Sampling stops at the
end-of-text token, which is where the run's training documents ended.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from farlink.data.tokenizer import eot_id, load_tokenizer
from farlink.model.build import load_run_model
from farlink.train.export import run_tokenizer_path


def context_length(model: nn.Module) -> int:
    """Positions the model was built for (farlink's GPT: config.seq_len; HF: seq_len)."""
    seq_len = getattr(model, "seq_len", None)
    return int(seq_len if seq_len is not None else model.config.seq_len)


@torch.no_grad()
def sample(model: nn.Module, ids: list[int], max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = 200, generator: torch.Generator | None = None,
           stop_id: int | None = None) -> list[int]:
    """``ids`` continued by up to ``max_new_tokens`` sampled tokens (fewer if ``stop_id`` comes)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if not ids:
        raise ValueError("sampling needs at least one token to start from")
    model.eval()
    window = context_length(model)
    out = list(ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([out[-window:]], dtype=torch.long)
        logits, _ = model(context)
        logits = logits[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        out.append(token)
        if token == stop_id:
            break
    return out


def generate(run_dir: Path, prompt: str = "", max_new_tokens: int = 200,
             temperature: float = 0.8, top_k: int | None = 200, seed: int = 1337) -> str:
    """The prompt and its continuation by the run's final model, as text."""
    tokenizer = load_tokenizer(run_tokenizer_path(run_dir))
    model = load_run_model(run_dir)
    eot = eot_id(tokenizer)
    # an empty prompt starts a new document, as every training document started after one
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids if prompt else [eot]
    generator = torch.Generator().manual_seed(seed)
    tokens = sample(model, ids, max_new_tokens, temperature, top_k, generator, stop_id=eot)
    return tokenizer.decode(tokens, skip_special_tokens=True)
