"""One peer's update as a single self-describing byte string.

Layout: ``MAGIC | u32 header length | JSON header | tensor payloads``. The header names each
tensor with its shape, dtype and payload length, plus who sent it, for which round, and how many
tokens it was computed on. Parsing is strict: anything that does not add up raises
:class:`~farlink.codecs.base.CodecError`, so a truncated or corrupt message is rejected before a
single number reaches the parameters.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import torch

from farlink.codecs.base import CodecError

MAGIC = b"FLK1"
_MAX_HEADER = 1 << 24
_MAX_INT = (1 << 63) - 1
_MAX_DIMS = 16
_MAX_NUMEL = 1 << 40  # a trillion elements: far above any real tensor, far below int64 overflow
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: the largest token count a header may claim: weights are combined in float32, where anything
#: above this is ``inf`` (and an aggregate weighted by ``inf`` is NaN)
MAX_WEIGHT = float(torch.finfo(torch.float32).max)


class InvalidWeight(CodecError):
    """A header's token count (the update's weight) is negative, not finite or beyond float32's
    range: no honest peer sends one, and weighting by it would poison the aggregate."""


@dataclass
class Envelope:
    """The decoded form of one peer's message."""

    sender: str
    round_id: int
    weight: float
    payloads: dict[str, bytes]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    meta: dict = field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise CodecError(f"unsupported dtype {dtype}")


def pack(
    sender: str,
    round_id: int,
    weight: float,
    payloads: dict[str, bytes],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    meta: dict | None = None,
) -> bytes:
    entries = [
        {"name": n, "shape": list(shapes[n]), "dtype": dtype_name(dtypes[n]), "nbytes": len(p)}
        for n, p in payloads.items()
    ]
    header = json.dumps(
        {"sender": str(sender), "round": int(round_id), "weight": float(weight),
         "tensors": entries,
         "meta": meta or {}},
        separators=(",", ":"),
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + b"".join(payloads.values())


def _reject_constant(name: str) -> float:
    raise CodecError(f"non-finite number {name} in header")


def _int(value: object, what: str, low: int = 0, high: int = _MAX_INT) -> int:
    """A JSON integer in ``[low, high]``: floats, bools and huge numbers are corrupt headers."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise CodecError(f"{what} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def _entry(e: object, seen: dict[str, bytes]) -> tuple[str, int, tuple[int, ...], torch.dtype]:
    if not isinstance(e, dict):
        raise CodecError("tensor table entry is not an object")
    name, shape, dtype = e.get("name"), e.get("shape"), e.get("dtype")
    if not isinstance(name, str) or name in seen:
        raise CodecError(f"tensor name {name!r:.40} is missing, not a string or repeated")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise CodecError(f"bad shape for {name!r}")
    dims = tuple(_int(d, f"dimension of {name!r}") for d in shape)
    if math.prod(dims) > _MAX_NUMEL:
        raise CodecError(f"{name!r} announces {math.prod(dims)} elements (limit {_MAX_NUMEL})")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise CodecError(f"unsupported dtype {dtype!r:.40} for {name!r}")
    return name, _int(e.get("nbytes"), f"nbytes of {name!r}"), dims, _DTYPES[dtype]


def _weight(value: object) -> float:
    """The claimed token count: a JSON number in ``[0, MAX_WEIGHT]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidWeight(f"weight {value!r:.40} is not a number")
    try:
        weight = float(value)
    except OverflowError as exc:
        raise InvalidWeight("weight is too large for a float") from exc
    if not (0.0 <= weight <= MAX_WEIGHT):  # also refuses NaN and inf
        raise InvalidWeight(f"weight {weight} is not a token count in [0, {MAX_WEIGHT:.3g}] "
                            "(negative, not finite, or beyond float32's range)")
    return weight


def sender_of(message: bytes) -> str | None:
    """Who a message says it is from, read as leniently as possible: only to name the sender
    of a message refused for something else (an invalid weight), never to trust it."""
    try:
        (hlen,) = struct.unpack_from("<I", message, 4)
        sender = json.loads(message[8 : 8 + min(hlen, _MAX_HEADER)]).get("sender")
    except Exception:  # noqa: BLE001 - a message too broken to name anyone
        return None
    return sender if isinstance(sender, str) and message[:4] == MAGIC else None


def unpack(message: bytes) -> Envelope:
    if len(message) < 8 or message[:4] != MAGIC:
        raise CodecError("not a farlink update (bad magic)")
    (hlen,) = struct.unpack_from("<I", message, 4)
    if hlen > _MAX_HEADER or 8 + hlen > len(message):
        raise CodecError(f"truncated header ({hlen} bytes announced, {len(message) - 8} present)")
    try:
        header = json.loads(message[8 : 8 + hlen], parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CodecError(f"corrupt header: {str(exc)[:80]}") from exc
    if not isinstance(header, dict):
        raise CodecError("corrupt header: not a JSON object")
    sender, entries, meta = header.get("sender"), header.get("tensors"), header.get("meta", {})
    if not isinstance(sender, str):
        raise CodecError("corrupt header: sender is not a string")
    round_id = _int(header.get("round"), "round")
    weight = _weight(header.get("weight"))
    if not isinstance(entries, list):
        raise CodecError("corrupt header: tensors is not a list")
    if not isinstance(meta, dict):
        raise CodecError("corrupt header: meta is not an object")
    offset = 8 + hlen
    payloads: dict[str, bytes] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for e in entries:
        name, n, shape, dtype = _entry(e, payloads)
        payloads[name] = message[offset : offset + n]
        if len(payloads[name]) != n:
            raise CodecError(f"truncated payload for {name!r}")
        shapes[name], dtypes[name] = shape, dtype
        offset += n
    if offset != len(message):
        raise CodecError(f"{len(message) - offset} trailing bytes after payloads")
    return Envelope(sender, round_id, weight, payloads, shapes, dtypes, meta)
