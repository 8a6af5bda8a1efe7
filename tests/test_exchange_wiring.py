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
    for name in ("compressor", "combine", "scorer"):
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
