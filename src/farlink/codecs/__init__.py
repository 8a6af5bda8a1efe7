"""Codecs: real bytes on the wire, exact accounting, optional error feedback.

A spec is ``NAME`` or ``NAME+ef``: ``none`` (fp32), ``fp16``, ``bf16``, ``int8``, ``int4``,
``topk`` (optionally ``topk:0.01``), e.g. ``--codec int4+ef``.
"""

from __future__ import annotations

from collections.abc import Callable

from farlink.codecs.base import Codec, CodecError
from farlink.codecs.compressor import Compressor
from farlink.codecs.raw import Float32Codec

CODECS: dict[str, Callable[[str | None], Codec]] = {
    "none": lambda arg: Float32Codec(),
    "fp32": lambda arg: Float32Codec(),
}


def make_compressor(spec: str) -> Compressor:
    """Parse ``NAME[:ARG][+ef]`` into a :class:`Compressor`; unknown names raise ValueError."""
    spec = spec.strip().lower()
    error_feedback = spec.endswith("+ef")
    base = spec.removesuffix("+ef")
    name, _, arg = base.partition(":")
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose from {', '.join(sorted(CODECS))}")
    return Compressor(CODECS[name](arg or None), error_feedback=error_feedback)


__all__ = ["Codec", "CodecError", "Compressor", "CODECS", "make_compressor"]
