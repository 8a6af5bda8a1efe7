"""An exchange keeps what it is built with: the composition root asks the algorithm class for
its codec and combine, and builds the loss scorer, before the exchange exists; nobody assigns
them afterwards (DeMo and SparseLoCo used to replace the exchange's codec and combine, and
``farlink train``'s workers attached the scorer to a built exchange)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import farlink
from farlink.codecs import DctTopKCodec, make_compressor
from farlink.comm.inprocess import InProcessGroup
from farlink.config import RunConfig
from farlink.robust.score import LossScorer
from farlink.sync.demo import DeMo
from farlink.sync.exchange import Exchange
from farlink.sync.sparseloco import SparseLoCo, SparseTwoBitCodec
from farlink.sync.sparseloco_tiles import TiledTwoBitCodec


def _optimizer(model: nn.Module, **options) -> farlink.Optimizer:  # noqa: ANN003
    return farlink.Optimizer(model, None, collective=InProcessGroup(1).member(0),
                             backend="inprocess", steps=100, **options)


def _read_only(exchange: Exchange) -> None:
    for name in ("compressor", "combine", "scorer", "tamper"):
        with pytest.raises(AttributeError):
            setattr(exchange, name, getattr(exchange, name))


def test_demo_is_built_with_its_codec_and_combine_and_cannot_rewire_them() -> None:
    sync = _optimizer(nn.Linear(8, 8), algorithm="demo", demo_chunk=8, demo_topk=4)
    exchange = sync.exchange
    assert isinstance(exchange.compressor.codec, DctTopKCodec)
    assert exchange.compressor.codec.name == "dct_topk:8:4:fp32"
    assert sync.algorithm.codec is exchange.compressor.codec  # asked for, not replaced
    assert exchange.combine is not None
    _read_only(exchange)
    given = _optimizer(nn.Linear(8, 8), algorithm="demo", codec="dct_topk:16:2:fp16")
    assert given.exchange.compressor.codec.name == "dct_topk:16:2:fp16"


@pytest.mark.parametrize("variant,codec,combines", [("paper", SparseTwoBitCodec, False),
                                                    ("authors", TiledTwoBitCodec, True)])
def test_sparseloco_is_built_with_its_codec_and_combine(variant: str, codec: type,
                                                        combines: bool) -> None:
    sync = _optimizer(nn.Linear(8, 8), algorithm="sparseloco", sparseloco_variant=variant,
                      sparseloco_chunk=16, sparseloco_topk=4, sparseloco_tile=4)
    exchange = sync.exchange
    assert type(exchange.compressor.codec) is codec
    assert sync.algorithm.codec is exchange.compressor.codec
    assert (exchange.combine is not None) == combines
    _read_only(exchange)


@pytest.mark.parametrize("cls,options", [
    (DeMo, {"algorithm": "demo"}), (SparseLoCo, {"algorithm": "sparseloco"}),
    (SparseLoCo, {"algorithm": "sparseloco", "sparseloco_variant": "authors"})])
def test_an_exchange_built_without_the_algorithms_codec_is_refused(cls: type,
                                                                   options: dict) -> None:
    """The algorithm no longer swaps the codec of an exchange built with the run's plain one: it
    refuses it and says how to build it."""
    cfg = RunConfig(steps=100, **options)
    collective = InProcessGroup(1).member(0)
    plain = Exchange(collective, make_compressor("none"), sender="w0")
    with pytest.raises(ValueError, match="wire_compressor"):
        cls(nn.Linear(8, 8), cfg, collective, plain)
    wired = cls.wire_compressor(cfg, "none")
    uncombined = Exchange(collective, wired, sender="w0")  # no combine: not the authors' mean
    if cls.wire_combine(wired) is not None:
        with pytest.raises(ValueError, match="wire_combine"):
            cls(nn.Linear(8, 8), cfg, collective, uncombined)


def _scorer_reads_the_global_params(sync: farlink.Optimizer) -> None:
    base = sync.exchange.scorer.base()
    algo = sync.algorithm
    assert list(base) == algo.names
    assert all(base[n] is g for n, g in zip(algo.names, algo.global_params))


def test_the_root_builds_the_scorer_of_score_loss_into_the_exchange() -> None:
    """``farlink train``'s path: the worker hands its corpus, the root builds the scorer over
    the algorithm's global parameters, and the exchange is built with it."""
    tokens = np.arange(4000, dtype=np.int64) % 64
    data = SimpleNamespace(train=tokens, heldout=tokens[:500])
    sync = _optimizer(nn.Linear(8, 8), algorithm="diloco", score="loss", score_data=data,
                      seq_len=16, inner_steps=2)
    assert isinstance(sync.exchange.scorer, LossScorer)
    assert sync.exchange.scorer.model is sync.model
    _scorer_reads_the_global_params(sync)
    _read_only(sync.exchange)
    unscored = _optimizer(nn.Linear(8, 8), algorithm="diloco", score_data=data)
    assert unscored.exchange.scorer is None  # --score none: the corpus is not used


def test_a_built_scorer_is_given_at_construction() -> None:
    model = nn.Linear(8, 8)
    batch = (torch.zeros(1, 8), torch.zeros(1, 8))
    scorer = LossScorer(model, farlink.compose.global_params_of(lambda: sync.algorithm),
                        lambda peer, r: None, batch)
    sync = _optimizer(model, algorithm="diloco", scorer=scorer, inner_steps=2)
    assert sync.exchange.scorer is scorer
    _scorer_reads_the_global_params(sync)
    with pytest.raises(TypeError, match="not both"):
        _optimizer(nn.Linear(8, 8), algorithm="diloco", scorer=scorer,
                   score_data=SimpleNamespace())


# --- hierarchical DiLoCo's hand-off exchange: built by the root, handed in ---------------------
def _hierarchical(handoff: dict, island=None, exchange: Exchange | None = None):  # noqa: ANN202
    from farlink.sync.hierarchical import HierarchicalDiLoCo

    island = island or InProcessGroup(1).member(0)
    cfg = RunConfig(algorithm="hierarchical_diloco", steps=4, inner_steps=2, island_steps=1,
                    warmup_steps=0)
    exchange = exchange or Exchange(island, make_compressor("int8"), sender="w0")
    leaders = InProcessGroup(1).member(0)
    return HierarchicalDiLoCo(nn.Linear(4, 4), cfg, island, exchange,
                              global_exchange=Exchange(leaders, make_compressor("none"), "g0"),
                              **handoff)


def test_hierarchical_diloco_hands_off_through_the_exchange_it_is_given() -> None:
    """The leader's hand-off goes through the exchange handed in (the root's), not one the
    algorithm builds; that exchange is the declared codec (exact fp32) over the island's
    collective, and sends and authenticates as the island exchange does."""
    from farlink.compose import build_handoff
    from farlink.sync.hierarchical import HierarchicalDiLoCo

    island = InProcessGroup(1).member(0)
    exchange = Exchange(island, make_compressor("int8"), sender="w0")
    handoff = build_handoff(HierarchicalDiLoCo, exchange)
    given = handoff["handoff_exchange"]
    assert given.compressor.codec.name == "fp32" and given.dense
    assert given.sender == exchange.sender and given.authenticator is exchange.authenticator
    algo = _hierarchical(handoff, island, exchange)
    assert algo.handoff_exchange is given
    assert given.last_path == ""
    while not algo.finished():
        algo.step(8)
    assert given.last_path == "dense"  # the hand-off rounds ran through it
    _read_only(given)


def test_hierarchical_diloco_without_its_hand_off_exchange_is_refused() -> None:
    from farlink.compose import build_handoff
    from farlink.sync.hierarchical import HierarchicalDiLoCo

    with pytest.raises(ValueError, match="build_handoff"):
        _hierarchical({})
    elsewhere = Exchange(InProcessGroup(1).member(0), make_compressor("none"), sender="w0")
    with pytest.raises(ValueError, match="island's collective"):  # another collective's
        _hierarchical(build_handoff(HierarchicalDiLoCo, elsewhere))
    assert build_handoff(DeMo, elsewhere) == {}  # an algorithm without a hand-off


def test_the_root_builds_the_hand_off_exchange() -> None:
    from island_threads import run_islands

    def member(worker: int, island, leaders):  # noqa: ANN001, ANN202
        sync = farlink.Optimizer(nn.Linear(4, 4), None, index=worker, steps=4, inner_steps=2,
                                 island_steps=1, warmup_steps=0, algorithm="hierarchical_diloco",
                                 backend="inprocess", collective=island,
                                 global_collective=leaders, auth="secret", secret="s3cret")
        handoff = sync.algorithm.handoff_exchange
        facts = (handoff.collective is sync.exchange.collective, handoff.dense,
                 handoff.sender == sync.exchange.sender,
                 handoff.authenticator is sync.exchange.authenticator)
        sync.close()
        return facts

    # signed when the run is: not the dense all-reduce, but the codec is the exact one
    assert run_islands(member) == [(True, False, True, True)] * 4


def test_no_exchange_is_built_inside_the_algorithms() -> None:
    """Every exchange an algorithm uses is built by the composition root and handed in: no
    ``Exchange(...)`` call in farlink.sync outside the module that defines it."""
    import ast
    from pathlib import Path

    import farlink.sync

    calls = []
    for path in sorted(Path(farlink.sync.__file__).parent.glob("*.py")):
        if path.name == "exchange.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if name == "Exchange":
                    calls.append(f"{path.name}:{node.lineno}")
    assert calls == []


def test_an_attacker_s_tamper_is_given_at_construction_and_cannot_be_set() -> None:
    """A library caller makes a replica an emulated attacker through farlink.Optimizer's
    ``tamper=`` (the root builds the exchange with it); setting it on a built exchange raises,
    and a replica the config already makes an attacker is refused a second one."""
    def reversed_update(update: dict, round_id: int) -> dict:
        return {k: -v for k, v in update.items()}

    sync = _optimizer(nn.Linear(8, 8), algorithm="diloco", tamper=reversed_update)
    assert sync.exchange.tamper is reversed_update
    with pytest.raises(AttributeError):
        sync.exchange.tamper = None
    assert _optimizer(nn.Linear(8, 8), algorithm="diloco").exchange.tamper is None
    with pytest.raises(TypeError, match="not both"):
        _optimizer(nn.Linear(8, 8), algorithm="diloco", attack="sign_flip", attackers="0",
                   tamper=reversed_update)
