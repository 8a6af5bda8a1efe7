"""Bytes on the wire per parameter for each codec, as farlink's codecs lay them out.

The planner never runs a codec; it needs only how many bytes one dense tensor of N values turns
into. The per-codec constants below mirror the wire formats (values plus their side information:
block scales, indices), so a prediction can be checked against a real run's ``len(payload)``.
Spec syntax is the codecs' own: ``NAME[:ARG][+ef]``; error feedback changes no byte count.
"""

from __future__ import annotations

from dataclasses import dataclass

from farlink.plan.tables import PlanInputError

QUANT_BLOCK = 64  # values per scale block of the int8/int4 codecs
SCALE_BYTES = 4  # one fp32 scale per block
TOPK_VALUE_BYTES = 4  # fp32 value of a kept entry
TOPK_INDEX_BYTES = 4  # int32 flat index of a kept entry
DCT_VALUE_BYTES = 2  # bf16 DCT coefficient (DeMo)
DCT_INDEX_BYTES = 2  # int16 position inside its chunk
SPARSELOCO_CHUNK, SPARSELOCO_TOPK = 4096, 64  # SparseLoCo's defaults (the paper's density)
DEFAULT_TOPK_FRACTION = 0.01
DEFAULT_DCT_CHUNK = 64 * 64  # values per DCT chunk: DeMo cuts matrices into 64x64 blocks
DEFAULT_DCT_TOPK = 32  # coefficients kept per chunk (DeMo reference: compression_topk=32)


@dataclass(frozen=True)
class CodecCost:
    """A parsed codec spec and what it costs per parameter."""

    spec: str
    name: str
    bytes_per_param: float

    def payload_bytes(self, n_params: float) -> float:
        return self.bytes_per_param * n_params


def _quantized(bits: int) -> float:
    return bits / 8 + SCALE_BYTES / QUANT_BLOCK


def _topk(arg: str | None) -> float:
    fraction = DEFAULT_TOPK_FRACTION if arg is None else _number(arg, "topk fraction")
    if not 0 < fraction <= 1:
        raise PlanInputError(f"topk fraction must be in (0, 1], got {fraction}")
    return fraction * (TOPK_VALUE_BYTES + TOPK_INDEX_BYTES)


def _dct_topk(arg: str | None) -> float:
    """``dct_topk[:CHUNK:K]`` (the spec DeMo builds): K coefficients kept out of CHUNK values.

    The DeMo reference implementation (bloc97/DeMo, ``compression_chunk=64``) applies a 2-D DCT
    to 64x64 blocks of each weight matrix and keeps the top 32 of those 4096 coefficients, so the
    default is CHUNK=4096, K=32; 1-D tensors (norms) are a negligible share of a large model.
    A codec that chunks flat vectors of 64 values is ``dct_topk:64:32``.
    """
    k, chunk = DEFAULT_DCT_TOPK, DEFAULT_DCT_CHUNK
    if arg is not None:
        left, sep, right = arg.partition(":")
        if not sep:
            raise PlanInputError(f"dct_topk argument must look like CHUNK:K (e.g. 4096:32), got {arg!r}")
        chunk, k = int(_number(left, "dct chunk")), int(_number(right, "dct k"))
    if not 0 < k <= chunk:
        raise PlanInputError(f"dct_topk needs 0 < k <= chunk, got chunk={chunk}, k={k}")
    return k / chunk * (DCT_VALUE_BYTES + DCT_INDEX_BYTES)


def _sparseloco(arg: str | None) -> float:
    """``sparseloco[:CHUNK:TOPK]``: TOPK entries kept per CHUNK, each a 2-bit value and a
    ``ceil(log2 CHUNK)``-bit index (:mod:`farlink.sync.sparseloco`; its 16 bytes of bin means
    per tensor are a negligible share of a large model). 4096:64 by default, the paper's."""
    chunk, k = SPARSELOCO_CHUNK, SPARSELOCO_TOPK
    if arg is not None:
        left, sep, right = arg.partition(":")
        if not sep:
            raise PlanInputError(f"sparseloco argument must look like CHUNK:TOPK, got {arg!r}")
        chunk, k = int(_number(left, "sparseloco chunk")), int(_number(right, "sparseloco topk"))
    if not 0 < k <= chunk:
        raise PlanInputError(f"sparseloco needs 0 < topk <= chunk, got {chunk}:{k}")
    return k / chunk * (2 + max(1, (chunk - 1).bit_length())) / 8


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise PlanInputError(f"{what} must be a number, got {text!r}") from None


_CODECS = {
    "none": lambda arg: 4.0,
    "fp32": lambda arg: 4.0,
    "fp16": lambda arg: 2.0,
    "bf16": lambda arg: 2.0,
    "int8": lambda arg: _quantized(8),
    "int4": lambda arg: _quantized(4),
    "topk": _topk,
    "dct_topk": _dct_topk,
    "sparseloco": _sparseloco,
}
CODEC_NAMES = tuple(_CODECS)


def codec_cost(spec: str) -> CodecCost:
    """Parse ``NAME[:ARG][+ef]``; unknown names raise :class:`PlanInputError`."""
    clean = spec.strip().lower()
    base = clean.removesuffix("+ef")
    name, _, arg = base.partition(":")
    if name not in _CODECS:
        raise PlanInputError(f"unknown codec {spec!r}; choose from {', '.join(CODEC_NAMES)}")
    return CodecCost(spec=clean, name=name, bytes_per_param=_CODECS[name](arg or None))
