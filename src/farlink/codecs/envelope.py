"""One peer's update as a single self-describing byte string.

Layout: ``MAGIC | u32 header length | JSON header | tensor payloads``. The header names each
tensor with its shape, dtype and payload length, plus who sent it, for which round, and how many
tokens it was computed on. Parsing is strict: anything that does not add up raises
:class:`~farlink.codecs.base.CodecError`, so a truncated or corrupt message is rejected before a
single number reaches the parameters.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import torch

from farlink.codecs.base import CodecError

MAGIC = b"FLK1"
_MAX_HEADER = 1 << 24
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        {"sender": sender, "round": round_id, "weight": weight, "tensors": entries,
         "meta": meta or {}},
        separators=(",", ":"),
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + b"".join(payloads.values())


def unpack(message: bytes) -> Envelope:
    if len(message) < 8 or message[:4] != MAGIC:
        raise CodecError("not a farlink update (bad magic)")
    (hlen,) = struct.unpack_from("<I", message, 4)
    if hlen > _MAX_HEADER or 8 + hlen > len(message):
        raise CodecError(f"truncated header ({hlen} bytes announced, {len(message) - 8} present)")
    try:
        header = json.loads(message[8 : 8 + hlen])
        entries = header["tensors"]
        sender, round_id = str(header["sender"]), int(header["round"])
        weight = float(header["weight"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CodecError(f"corrupt header: {exc}") from exc
    if not (weight >= 0.0) or weight == float("inf"):
        raise CodecError(f"invalid weight {weight}")
    offset = 8 + hlen
    payloads, shapes, dtypes = {}, {}, {}
    try:
        for e in entries:
            name, n = str(e["name"]), int(e["nbytes"])
            shape = tuple(int(s) for s in e["shape"])
            if n < 0 or any(s < 0 for s in shape) or e["dtype"] not in _DTYPES:
                raise CodecError(f"bad entry for {name!r}")
            payloads[name] = message[offset : offset + n]
            if len(payloads[name]) != n:
                raise CodecError(f"truncated payload for {name!r}")
            shapes[name], dtypes[name] = shape, _DTYPES[e["dtype"]]
            offset += n
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"corrupt tensor table: {exc}") from exc
    if offset != len(message):
        raise CodecError(f"{len(message) - offset} trailing bytes after payloads")
    return Envelope(sender, round_id, weight, payloads, shapes, dtypes, header.get("meta", {}))
