"""Bytes on the wire per parameter for each codec, as farlink's codecs lay them out.

The planner never runs a codec; it needs only how many bytes one dense tensor of N values turns
into. The per-codec constants below mirror the wire formats (values plus their side information:
block scales, indices), so a prediction can be checked against a real run's ``len(payload)``.
Spec syntax is the codecs' own, arguments included (``dct_topk:64:32`` is DeMo's 64x64 tiles
with 32 coefficients kept per tile, as the codec reads it): ``NAME[:ARGS][+ef]``; error
feedback changes no byte count. Where the real size depends on a tensor's shape (DCT and
SparseLoCo tiles, 1-D tensors), the weight matrices that make up nearly all of a large model
are priced; ``tests/test_plan.py`` checks every codec against the bytes it encodes on a real
model.
"""

from __future__ import annotations

from dataclasses import dataclass

from farlink.plan.tables import PlanInputError

QUANT_BLOCK = 64  # values per scale block of the int8/int4 codecs (``int8:BLOCK``)
WIRE_FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # a float on farlink's wire
QUANT_SCALE = "bf16"  # one scale per block, bf16 unless the spec names another
TOPK_VALUE = "fp32"  # a kept entry's value, fp32 unless ``topk:FRACTION:fp16``
TOPK_INDEX_BYTES = 4  # the largest fixed index format (uint32) the top-k codec falls back to
DCT_VALUE_BYTES = {"fp32": 4, "fp16": 2}  # a kept DCT coefficient on farlink's wire
SPARSELOCO_CHUNK, SPARSELOCO_TOPK = 4096, 64  # SparseLoCo's defaults (the paper's density)
SPARSELOCO_TILE = 64  # the authors' variant: 64x64 tiles
DEFAULT_TOPK_FRACTION = 0.01
DEFAULT_DCT_CHUNK = 64  # side of a DCT tile: DeMo cuts matrices into 64x64 blocks
DEFAULT_DCT_TOPK = 32  # coefficients kept per tile (DeMo reference: compression_topk=32)


@dataclass(frozen=True)
class CodecCost:
    """A parsed codec spec and what it costs per parameter."""

    spec: str
    name: str
    bytes_per_param: float

    def payload_bytes(self, n_params: float) -> float:
        return self.bytes_per_param * n_params


def _wire_float(text: str, what: str, allowed: dict[str, int]) -> int:
    if text not in allowed:
        raise PlanInputError(f"{what} must be one of {', '.join(allowed)}, got {text!r}")
    return allowed[text]


def _quantized(bits: int, arg: str | None) -> float:
    """``intB[:BLOCK[:SCALE]]``: B-bit codes and one scale (bf16 by default) per BLOCK values,
    as :class:`farlink.codecs.BlockQuantCodec` lays them out."""
    parts = [] if arg is None else arg.split(":")
    if len(parts) > 2:
        raise PlanInputError(f"int{bits} argument must look like BLOCK[:SCALE], got {arg!r}")
    block = int(_number(parts[0], "block size")) if parts else QUANT_BLOCK
    if block < 1:
        raise PlanInputError(f"block size must be >= 1, got {block}")
    scale = _wire_float(parts[1] if len(parts) > 1 else QUANT_SCALE, "scale dtype",
                        WIRE_FLOAT_BYTES)
    return bits / 8 + scale / block


def _topk(arg: str | None) -> float:
    """``topk[:FRACTION[:fp16]]``: each kept entry is a value and its index, the indices sent as
    varint gaps (:mod:`farlink.codecs.topk`). Kept entries spread as if at random leave
    geometric gaps, so an index costs ``1 + P(gap >= 128) + P(gap >= 128**2) + ...`` bytes,
    ``P(gap >= m) = (1 - fraction)**m`` (1.28 bytes at 1%), never more than a uint32."""
    parts = [] if arg is None else arg.split(":")
    if len(parts) > 2:
        raise PlanInputError(f"topk argument must look like FRACTION[:fp16], got {arg!r}")
    fraction = _number(parts[0], "topk fraction") if parts else DEFAULT_TOPK_FRACTION
    if not 0 < fraction <= 1:
        raise PlanInputError(f"topk fraction must be in (0, 1], got {fraction}")
    value = _wire_float(parts[1] if len(parts) > 1 else TOPK_VALUE, "topk value dtype",
                        {"fp32": 4, "fp16": 2})
    index = 1 + sum((1 - fraction) ** (128**j) for j in range(1, 5))
    return fraction * (value + min(index, TOPK_INDEX_BYTES))


def _dct_topk(arg: str | None) -> float:
    """``dct_topk[:CHUNK[:K[:fp16]]]``, read as :class:`farlink.codecs.DctTopKCodec` reads it.

    CHUNK is the side of the DCT tile: a weight matrix is cut into CHUNK x CHUNK tiles (64x64 by
    default, as the DeMo reference's ``compression_chunk=64``) and the K largest of each tile's
    CHUNK**2 coefficients are sent (32 by default), each a value (fp32, or fp16 with ``:fp16``)
    and its index inside the tile (1, 2 or 4 bytes by the tile's coefficient count). Matrices
    are priced: 1-D tensors (norms, biases) are a negligible share of a large model.
    """
    parts = [] if arg is None else arg.split(":")
    if len(parts) > 3:
        raise PlanInputError(f"dct_topk argument must look like CHUNK[:K[:fp16]], got {arg!r}")
    chunk = int(_number(parts[0], "dct chunk")) if parts else DEFAULT_DCT_CHUNK
    k = int(_number(parts[1], "dct k")) if len(parts) > 1 else DEFAULT_DCT_TOPK
    value = parts[2] if len(parts) > 2 else "fp32"
    if value not in DCT_VALUE_BYTES:
        raise PlanInputError(f"dct_topk values are fp32 or fp16, got {value!r}")
    if chunk < 1 or k < 1:
        raise PlanInputError(f"dct_topk needs a chunk and k >= 1, got chunk={chunk}, k={k}")
    coefficients = chunk * chunk
    k = min(k, coefficients)  # as the codec: a tile never sends more than it holds
    index = 1 if coefficients <= 1 << 8 else 2 if coefficients <= 1 << 16 else 4
    return k / coefficients * (DCT_VALUE_BYTES[value] + index)


def _sparseloco(arg: str | None) -> float:
    """``sparseloco[:CHUNK:TOPK]``: TOPK entries kept per CHUNK, each a 2-bit value and a
    ``ceil(log2 CHUNK)``-bit index (:mod:`farlink.sync.sparseloco`; its 16 bytes of bin means
    per tensor are a negligible share of a large model). 4096:64 by default, the paper's.
    ``sparseloco:tiles[:TILE:TOPK]`` is the authors' variant (:func:`_sparseloco_tiles`)."""
    if arg is not None and arg.partition(":")[0] == "tiles":
        return _sparseloco_tiles(arg.partition(":")[2] or None)
    chunk, k = SPARSELOCO_CHUNK, SPARSELOCO_TOPK
    if arg is not None:
        left, sep, right = arg.partition(":")
        if not sep:
            raise PlanInputError(f"sparseloco argument must look like CHUNK:TOPK, got {arg!r}")
        chunk, k = int(_number(left, "sparseloco chunk")), int(_number(right, "sparseloco topk"))
    if not 0 < k <= chunk:
        raise PlanInputError(f"sparseloco needs 0 < topk <= chunk, got {chunk}:{k}")
    return k / chunk * (2 + max(1, (chunk - 1).bit_length())) / 8


def _sparseloco_tiles(arg: str | None) -> float:
    """``sparseloco:tiles[:TILE:TOPK]``, SparseLoCo as its authors run it
    (:mod:`farlink.sync.sparseloco_tiles`): TOPK entries kept per TILE x TILE tile of a matrix,
    each a 2-bit value and a ``ceil(log2 TILE**2)``-bit index; 64:64 by default (12-bit indices,
    the same density as the paper's 64 of 4096). 1-D tensors, sent whole at 2 bits an entry,
    are a negligible share of a large model."""
    tile, k = SPARSELOCO_TILE, SPARSELOCO_TOPK
    if arg is not None:
        left, sep, right = arg.partition(":")
        if not sep:
            raise PlanInputError(f"sparseloco:tiles argument must look like TILE:TOPK, got {arg!r}")
        tile, k = int(_number(left, "sparseloco tile")), int(_number(right, "sparseloco topk"))
    if tile < 1 or k < 1:
        raise PlanInputError(f"sparseloco:tiles needs TILE and TOPK >= 1, got {tile}:{k}")
    cells = tile * tile
    k = min(k, cells)
    return k / cells * (2 + max(1, (cells - 1).bit_length())) / 8


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
    "int8": lambda arg: _quantized(8, arg),
    "int4": lambda arg: _quantized(4, arg),
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
