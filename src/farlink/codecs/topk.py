"""Top-k sparsification: send the ``k = ceil(fraction * numel)`` largest-magnitude entries.

Without error feedback this discards most of the signal; with ``+ef`` the dropped mass is carried
to the next round, which is what makes top-k usable (the residual keeps the invariant
``sum(sent) + residual == sum(inputs)``).

Payload layout, little-endian::

    u8 index format | k values (fp32 or fp16) | indices

Indices are sorted ascending and sent in whichever format is smallest for this message:
``0`` = uint16 (only when numel <= 65536), ``1`` = uint32, ``2`` = LEB128 varints of the gaps
(``i0, i1 - i0 - 1, ...``). Length: ``1 + k * value_bytes + k * {2, 4}`` for the fixed formats,
``1 + k * value_bytes + sum(varint lengths)`` for varints, never more than the uint32 layout.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from farlink.codecs._util import (
    all_finite,
    as_flat_float32,
    float_name,
    itemsize,
    numel_of,
    parse_wire_float,
    require_finite,
    split_args,
    to_wire,
    top_positions,
    wire_bytes,
    wire_floats,
)
from farlink.codecs.base import Codec, CodecError
from farlink.codecs.varint import decode_varints, encode_varints, varint_nbytes

FMT_U16, FMT_U32, FMT_VARINT = 0, 1, 2
_UINT16_LIMIT = 1 << 16


class TopKCodec(Codec):
    """Largest-magnitude sparsification with self-selecting index encoding."""

    def __init__(self, fraction: float = 0.01, value_dtype: torch.dtype = torch.float32):
        if not (0.0 < fraction <= 1.0):
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
        if value_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"top-k values must be fp16 or fp32, got {value_dtype}")
        self.fraction, self.value_dtype = fraction, value_dtype
        self.name = f"topk:{fraction:g}:{float_name(value_dtype)}"

    @classmethod
    def from_arg(cls, arg: str | None) -> TopKCodec:
        """``topk``, ``topk:0.05``, ``topk:0.05:fp16``."""
        parts = split_args(arg, 2, "topk")
        try:
            fraction = float(parts[0]) if parts else 0.01
        except ValueError:
            raise ValueError(f"top-k fraction must be a number, got {parts[0]!r}") from None
        value_dtype = parse_wire_float(parts[1], "value dtype") if len(parts) > 1 else torch.float32
        return cls(fraction, value_dtype)

    def k_for(self, numel: int) -> int:
        """Entries kept for a tensor of ``numel`` elements: at least one, at most all."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.fraction * numel - 1e-9)))

    def max_payload_nbytes(self, shape: tuple[int, ...]) -> int:
        numel = numel_of(shape)
        k = self.k_for(numel)
        index_bytes = 2 if numel <= _UINT16_LIMIT else 4
        return 1 + k * (itemsize(self.value_dtype) + index_bytes)

    def select(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted int64 indices, float32 values as the receiver will see them)."""
        flat = as_flat_float32(tensor)
        require_finite(flat, self.name)
        k = self.k_for(flat.numel())
        if k == 0:
            return (torch.zeros(0, dtype=torch.int64, device=flat.device),
                    torch.zeros(0, device=flat.device))
        indices = top_positions(flat.abs(), k)
        values = to_wire(flat[indices], self.value_dtype).float()
        return indices, values

    def encode(self, tensor: torch.Tensor) -> bytes:
        indices, values = self.select(tensor)
        numel = tensor.numel()
        idx = indices.cpu().numpy()
        gaps = np.diff(idx, prepend=-1) - 1
        options: list[tuple[int, int]] = [(int(varint_nbytes(gaps).sum()), FMT_VARINT)]
        options.append((4 * idx.size, FMT_U32))
        if numel <= _UINT16_LIMIT:
            options.append((2 * idx.size, FMT_U16))
        _, fmt = min(options)
        if fmt == FMT_VARINT:
            index_bytes = encode_varints(gaps)
        elif fmt == FMT_U32:
            index_bytes = idx.astype("<u4").tobytes()
        else:
            index_bytes = idx.astype("<u2").tobytes()
        return bytes([fmt]) + wire_bytes(values.to(self.value_dtype)) + index_bytes

    def decode(self, payload: bytes, shape: torch.Size, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
        indices, values = self.parse(payload, numel_of(shape))
        out = torch.zeros(numel_of(shape), dtype=torch.float32, device=device)
        out[indices.to(out.device)] = values.to(out.device)
        return out.reshape(tuple(shape)).to(dtype)

    def parse(self, payload: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated (indices, values) of a payload for a tensor of ``numel`` elements."""
        k = self.k_for(numel)
        vb = itemsize(self.value_dtype)
        if len(payload) < 1 + k * vb:
            raise CodecError(f"{self.name} payload too short: {len(payload)} bytes for k={k}")
        fmt, view = payload[0], memoryview(payload)
        values = wire_floats(view[1 : 1 + k * vb], self.value_dtype, k)
        rest = view[1 + k * vb :]
        if fmt == FMT_VARINT:
            gaps = decode_varints(rest, k)
            idx = np.cumsum(gaps + 1) - 1
        elif fmt in (FMT_U16, FMT_U32):
            width = 2 if fmt == FMT_U16 else 4
            if len(rest) != k * width:
                raise CodecError(
                    f"{self.name} index section has {len(rest)} bytes, expected {k * width}"
                )
            idx = np.frombuffer(rest, dtype="<u2" if width == 2 else "<u4").astype(np.int64)
            if idx.size > 1 and not bool((np.diff(idx) > 0).all()):
                raise CodecError(f"{self.name} indices are not strictly increasing")
        else:
            raise CodecError(f"{self.name} payload has unknown index format {fmt}")
        if idx.size and (int(idx[-1]) >= numel or int(idx[0]) < 0):
            raise CodecError(f"{self.name} index out of range for {numel} elements")
        if not all_finite(values):
            raise CodecError(f"{self.name} payload has NaN or Inf values")
        return torch.from_numpy(idx), values
