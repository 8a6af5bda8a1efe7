"""Model shapes, sized analytically.

The planner reasons about 1B and 10B models that never fit on this machine, so parameter
counts and FLOPs per token are computed from the shape alone and are tested against the real
module for the small presets: the formulas and ``GPT`` cannot drift apart unnoticed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


def swiglu_hidden(d_model: int, multiple_of: int = 64) -> int:
    """SwiGLU width that keeps MLP parameters equal to a 4x GELU MLP (8/3 * d), rounded up."""
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer; frozen so a config can be shared and hashed."""

    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "d_ff", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("rope_theta and norm_eps must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_parameters(self) -> int:
        """Unique parameters of ``GPT(self)``: the tied embedding counts once."""
        d = self.d_model
        attention = 4 * d * d  # fused q/k/v projection + output projection
        mlp = 3 * d * self.d_ff  # gate, up, down
        norms = 2 * d  # two pre-norm RMSNorm weights
        return self.vocab_size * d + self.n_layer * (attention + mlp + norms) + d

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6N plus the attention-score term.

        6N covers every weight matmul, including the tied output head (the input lookup is free,
        so counting the embedding once is exact). Attention scores and the weighted sum cost
        2 * 2 * T * d per layer forward, times 3 for forward + backward: 12 * L * d * T, the
        usual convention (Kaplan et al. 2020, PaLM appendix B) that ignores the causal mask.
        """
        t = self.seq_len if seq_len is None else seq_len
        return 6 * self.num_parameters() + 12 * self.n_layer * self.d_model * t


def _preset(vocab: int, n_layer: int, n_head: int, d_model: int, seq_len: int,
            d_ff: int | None = None) -> GPTConfig:
    return GPTConfig(
        vocab_size=vocab,
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        d_ff=swiglu_hidden(d_model) if d_ff is None else d_ff,
        seq_len=seq_len,
    )


PRESETS: dict[str, GPTConfig] = {
    # A few hundred thousand parameters (most in the embedding): affordable sweeps of many
    # algorithms x learning rates x 40+ outer rounds on two shared CPU cores.
    "nano": _preset(4096, 2, 2, 64, 64),
    # Runs in seconds on two CPU cores: for tests and local multi-process scenarios.
    "tiny": _preset(4096, 4, 4, 128, 128),
    # Still CPU-trainable; big enough for differences between sync algorithms to show.
    "small": _preset(4096, 6, 8, 256, 256),
    # GPT-2 small / OpenDiLoCo-scale shapes with the padded GPT-2 vocabulary.
    "125m": _preset(50304, 12, 12, 768, 1024),
    "350m": _preset(50304, 24, 16, 1024, 1024),
    "1b": _preset(50304, 24, 16, 2048, 2048),
    # INTELLECT-1's shape (42 x 4096, 14336 FFN, Llama-3 vocabulary, 8k context); planner only.
    "10b": _preset(128256, 42, 32, 4096, 8192, d_ff=14336),
}


def preset_config(name: str, vocab_size: int | None = None,
                  seq_len: int | None = None) -> GPTConfig:
    """A preset, with vocabulary and context overridden to match the tokenizer and data."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
    changes: dict[str, int] = {}
    if vocab_size is not None:
        changes["vocab_size"] = vocab_size
    if seq_len is not None:
        changes["seq_len"] = seq_len
    return replace(config, **changes) if changes else config
