"""Rotary position embeddings (Su et al. 2021, "RoFormer").

Rotating q and k by position-dependent angles makes their dot product depend only on the
offset between positions, so the model has no learned position table to synchronise and the
attention pattern generalises across positions. Uses the "rotate half" pairing of GPT-NeoX/Llama.
"""

from __future__ import annotations

import torch


def rotary_tables(head_dim: int, seq_len: int, theta: float = 10000.0,
                  device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [seq_len, head_dim], computed in float32 for accuracy."""
    if head_dim % 2 != 0:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                             dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [T, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)  # [T, head_dim]
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., T, head_dim] by the tables' first T positions."""
    t = x.shape[-2]
    cos_t = cos[:t].to(x.dtype)
    sin_t = sin[:t].to(x.dtype)
    return x * cos_t + _rotate_half(x) * sin_t
