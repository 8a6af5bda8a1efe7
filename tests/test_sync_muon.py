"""Muon inside (``inner="muon"``): which parameters Muon steps, that the composite optimizer steps
exactly as Muon and AdamW side by side, resumes bit for bit, and runs DiLoCo and SparseLoCo
through the library's API on two replicas (SparseLoCo in both variants)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import farlink
from farlink.comm.inprocess import InProcessGroup
from farlink.model import GPT, preset_config
from farlink.sync.muon import MuonAdamW, muon_parameters
from farlink.sync.sparseloco_tiles import TiledTwoBitCodec


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(preset_config("nano"))


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2


def test_muon_steps_hidden_matrices_and_adamw_the_rest() -> None:
    model = _gpt()
    muon, adamw = muon_parameters(model)
    # 2 blocks x (qkv, proj, gate, up, down)
    assert all(p.ndim == 2 for p in muon) and len(muon) == 2 * 5
    assert model.embed.weight in adamw and model.lm_head.weight is model.embed.weight
    assert all(p.ndim == 1 for p in adamw if p is not model.embed.weight)
    assert len(muon) + len(adamw) == len(list(model.parameters()))


def test_the_composite_steps_as_muon_and_adamw_side_by_side_and_resumes() -> None:
    model, reference = _gpt(), _gpt()
    opt = MuonAdamW.for_model(model, lr=0.01, weight_decay=0.1)
    muon, adamw = muon_parameters(reference)
    parts = [torch.optim.Muon(muon, lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
             torch.optim.AdamW(adamw, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)]
    for step in range(3):
        for group in opt.param_groups:  # the lr schedule sets every group, as farlink does
            group["lr"] = 0.01 * (step + 1) / 3
        for part in parts:
            for group in part.param_groups:
                group["lr"] = 0.01 * (step + 1) / 3
        _grads(model, step)
        _grads(reference, step)
        opt.step()
        for part in parts:
            part.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    # a checkpoint of the composite, loaded into a fresh one, continues bit for bit
    saved = copy.deepcopy(opt.state_dict())  # as written to disk, not the live tensors
    fresh = _gpt()
    fresh.load_state_dict(model.state_dict())
    resumed = MuonAdamW.for_model(fresh, lr=0.01, weight_decay=0.1)
    resumed.load_state_dict(saved)
    for o, m in ((opt, model), (resumed, fresh)):
        _grads(m, 7)
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


_INIT = threading.Lock()


@pytest.mark.parametrize("algorithm,variant", [
    ("diloco", {}), ("sparseloco", {"sparseloco_variant": "paper"}),
    ("sparseloco", {"sparseloco_variant": "authors", "sparseloco_tile": 8})],
    ids=["diloco", "sparseloco-paper", "sparseloco-authors"])
def test_diloco_and_sparseloco_train_with_muon_inside_through_the_api(
        algorithm: str, variant: dict) -> None:
    def member(rank: int, collective):  # noqa: ANN001, ANN202
        with _INIT:
            model = _gpt()
        sync = farlink.Optimizer(model, collective=collective, index=rank, backend="inprocess",
                                 algorithm=algorithm, inner="muon", inner_steps=3, steps=6,
                                 warmup_steps=0, lr=0.01, **variant)
        assert isinstance(sync.algorithm.inner_opt, MuonAdamW)
        if algorithm == "sparseloco":  # the variant's own wire format, beside Muon inside
            tiled = variant["sparseloco_variant"] == "authors"
            assert isinstance(sync.algorithm.codec, TiledTwoBitCodec) == tiled
        gen = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, model.config.vocab_size, (2, 17), generator=gen)
        losses = []
        for _ in range(6):
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses.append(float(loss.detach()))
            sync.step(tokens=tokens.numel())
        return sync.fingerprint(), sync.algorithm.outer_step, losses

    (f0, steps0, losses), (f1, steps1, _) = InProcessGroup(2).run(member, timeout=120)
    assert f0 == f1 and steps0 == steps1 == 2  # two committed rounds, replicas identical
    assert losses[-1] < losses[0]
