"""A GPT cut into pipeline stages: contiguous blocks, embedding with the first, head with the last.

Every stage builds the whole model from the run's seed and keeps only its slice, so the stages
start from exactly the weights an unsplit ``GPT`` with the same seed has (the initialisation
draws from one global generator in module order; building only a slice would draw different
numbers). The tied embedding lives twice, as the first stage's ``embed`` and the last stage's
``lm_head``: both copies start equal and the trainer sums their gradients before every step
(Megatron-LM's embedding group), so they stay equal and the update equals the unsplit model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from farlink.model import GPT, GPTConfig


def stage_bounds(n_layer: int, stages: int) -> list[tuple[int, int]]:
    """Half-open block ranges per stage, as even as possible (earlier stages take the extra
    block: the last stage already carries the head and the loss)."""
    if not isinstance(stages, int) or stages < 2:
        raise ValueError(f"a pipeline needs at least 2 stages, got {stages!r}; "
                         "run one stage as plain data parallel instead")
    if stages > n_layer:
        raise ValueError(f"{stages} stages for a model of {n_layer} blocks: every stage needs a "
                         f"block; use at most {n_layer} stages or a deeper preset")
    base, extra = divmod(n_layer, stages)
    bounds, start = [], 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class PipelineStage(nn.Module):
    """Blocks ``[start, end)`` of a GPT; the first stage maps tokens to activations, the last
    maps activations to the mean cross-entropy (``loss``) or logits (``forward``)."""

    def __init__(self, model: GPT, stage: int, stages: int) -> None:
        super().__init__()
        config = model.config
        self.config, self.stage, self.stages = config, stage, stages
        self.start, self.end = stage_bounds(config.n_layer, stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.blocks = nn.ModuleList(model.blocks[self.start:self.end])
        if self.is_first:
            self.embed = model.embed
            self.drop = model.drop
        if self.is_last:
            self.norm = model.norm
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            with torch.no_grad():  # an untied copy of the shared weight (see module docstring)
                self.lm_head.weight.copy_(model.embed.weight)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of the embedding shared by the first and last stage, if any."""
        if self.is_first:
            return self.embed.weight
        if self.is_last:
            return self.lm_head.weight
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            if x.dtype != torch.long or x.dim() != 2:
                raise ValueError(f"the first stage takes [batch, time] token ids, got "
                                 f"{x.dtype} {tuple(x.shape)}")
            if x.shape[1] > self.config.seq_len:
                raise ValueError(f"sequence length {x.shape[1]} exceeds seq_len "
                                 f"{self.config.seq_len}")
            x = self.drop(self.embed(x))
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the last stage's logits, as ``GPT.forward`` computes it."""
        if not self.is_last:
            raise ValueError(f"stage {self.stage} of {self.stages} has no head; "
                             "only the last stage computes the loss")
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def model_parameter_name(stage_name: str, start: int) -> str:
    """The unsplit ``GPT``'s name for a stage parameter: block indices shift by ``start``."""
    if not stage_name.startswith("blocks."):
        return stage_name
    _, index, rest = stage_name.split(".", 2)
    return f"blocks.{int(index) + start}.{rest}"


def build_stage(config: GPTConfig, seed: int, stage: int, stages: int) -> PipelineStage:
    """Stage ``stage`` of ``stages`` with the weights ``GPT(config)`` gets under ``seed``."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")
    torch.manual_seed(seed)
    return PipelineStage(GPT(config), stage, stages)
