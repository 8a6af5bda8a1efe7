"""Codecs: real bytes on the wire, exact accounting, optional error feedback.

A spec is ``NAME[:ARGS][+ef]``:

- ``none`` / ``fp32`` (4 B/element), ``fp16``, ``bf16`` (2 B/element);
- ``int8[:BLOCK[:SCALE]]``, ``int4[:BLOCK[:SCALE]]``: blockwise absmax, block 64, scale dtype
  ``bf16`` (or ``fp16``/``fp32``) by default;
- ``topk[:FRACTION[:VALUES]]``: largest 1% by default, values ``fp32`` or ``fp16``;
- ``dct_topk[:CHUNK[:K[:VALUES]]]``: DeMo's per-chunk DCT top-k, ``64:32`` by default;

e.g. ``--codec int4+ef`` or ``--codec topk:0.05+ef``. A codec's ``name`` is its canonical spec,
so ``make_compressor(c.spec)`` rebuilds the same configuration.
"""

from __future__ import annotations

from collections.abc import Callable

from farlink.codecs.base import Codec, CodecError
from farlink.codecs.compressor import Compressor
from farlink.codecs.dct_topk import DctTopKCodec, SparseDct
from farlink.codecs.floats import BFloat16Codec, Float16Codec
from farlink.codecs.quant import BlockQuantCodec
from farlink.codecs.raw import Float32Codec
from farlink.codecs.topk import TopKCodec


def _no_arg(name: str, factory: Callable[[], Codec]) -> Callable[[str | None], Codec]:
    def build(arg: str | None) -> Codec:
        if arg:
            raise ValueError(f"codec {name} takes no arguments, got {arg!r}")
        return factory()

    return build


CODECS: dict[str, Callable[[str | None], Codec]] = {
    "none": _no_arg("none", Float32Codec),
    "fp32": _no_arg("fp32", Float32Codec),
    "fp16": _no_arg("fp16", Float16Codec),
    "bf16": _no_arg("bf16", BFloat16Codec),
    "int8": lambda arg: BlockQuantCodec.from_arg(8, arg),
    "int4": lambda arg: BlockQuantCodec.from_arg(4, arg),
    "topk": TopKCodec.from_arg,
    "dct_topk": DctTopKCodec.from_arg,
}


def make_codec(spec: str) -> Codec:
    """Parse ``NAME[:ARGS]`` (no ``+ef``) into a codec; bad specs raise ValueError."""
    name, _, arg = spec.strip().lower().partition(":")
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose from {', '.join(sorted(CODECS))}")
    return CODECS[name](arg or None)


def make_compressor(spec: str) -> Compressor:
    """Parse ``NAME[:ARG][+ef]`` into a :class:`Compressor`; unknown names raise ValueError."""
    spec = spec.strip().lower()
    error_feedback = spec.endswith("+ef")
    return Compressor(make_codec(spec.removesuffix("+ef")), error_feedback=error_feedback)


__all__ = [
    "CODECS",
    "BFloat16Codec",
    "BlockQuantCodec",
    "Codec",
    "CodecError",
    "Compressor",
    "DctTopKCodec",
    "Float16Codec",
    "Float32Codec",
    "SparseDct",
    "TopKCodec",
    "make_codec",
    "make_compressor",
]
