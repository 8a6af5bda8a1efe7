"""Muon as the inner optimizer (``--inner muon``): MuLoCo (arXiv 2505.23725) runs DiLoCo with
Muon inside and reports a lower loss than AdamW inside, with pseudo-gradients that compress
better. Muon orthogonalizes each update of a hidden weight matrix (Newton-Schulz iterations), so
it applies to 2-D matrices only; embeddings (and a head tied to them), norms and biases stay on
AdamW, as in Muon's reference and the authors of SparseLoCo's trainer.

:class:`MuonAdamW` is one ``torch.optim.Optimizer`` over both parts, so everything that handles
the inner optimizer (the lr schedule, gradient clipping, checkpoints, healing) sees one: its
``param_groups`` are the Muon groups followed by the AdamW groups (the same dicts the two inner
optimizers step), and its ``state`` is shared with both. ``torch.optim.Muon`` runs with
``adjust_lr_fn="match_rms_adamw"``, which scales its step to AdamW's update size, so one lr (and
one schedule) serves both parts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

ADAMW_BETAS = (0.9, 0.95)


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices for Muon, the rest for AdamW) of ``model``'s trainable parameters: a
    2-D parameter goes to Muon unless it belongs to an ``nn.Embedding`` (or is the same tensor,
    a tied output head) or sits in a module named like an output head."""
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                for p in m.parameters()}
    muon, adamw, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        head = name.split(".")[-2:-1] in (["lm_head"], ["head"], ["output"])
        (muon if p.ndim == 2 and id(p) not in embedded and not head else adamw).append(p)
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """Muon for ``muon_params``, AdamW (betas 0.9/0.95) for ``adamw_params``, one optimizer."""

    def __init__(self, muon_params: Iterable[nn.Parameter], adamw_params: Iterable[nn.Parameter],
                 lr: float, weight_decay: float, momentum: float = 0.95) -> None:
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        self._parts: list[torch.optim.Optimizer] = []
        if muon_params:
            self._parts.append(torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay,
                                                momentum=momentum,
                                                adjust_lr_fn="match_rms_adamw"))
        if adamw_params:
            self._parts.append(torch.optim.AdamW(adamw_params, lr=lr, betas=ADAMW_BETAS,
                                                 weight_decay=weight_decay))
        if not self._parts:
            raise ValueError("MuonAdamW needs at least one parameter")
        self._sizes = [len(part.param_groups) for part in self._parts]
        super().__init__([g for part in self._parts for g in part.param_groups], {})
        self._share()

    @classmethod
    def for_model(cls, model: nn.Module, lr: float, weight_decay: float) -> MuonAdamW:
        return cls(*muon_parameters(model), lr=lr, weight_decay=weight_decay)

    def _share(self) -> None:
        """Point the two inner optimizers at this one's groups and state (again after a
        ``load_state_dict``, which replaces both)."""
        start = 0
        for part, size in zip(self._parts, self._sizes):
            part.param_groups = self.param_groups[start:start + size]
            part.state = self.state
            start += size

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts:
            part.step()
        return loss
