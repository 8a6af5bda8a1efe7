"""Dense half-precision codecs: fp16 and bf16, 2 bytes per element, no header.

OpenDiLoCo found fp16 all-reduce of pseudo-gradients lossless in practice; bf16 trades mantissa
(8 bits) for fp32's range, so it never overflows. Payload length is exactly ``2 * numel``.
"""

from __future__ import annotations

import torch

from farlink.codecs._util import as_flat_float32, numel_of, to_wire, wire_bytes, wire_floats
from farlink.codecs.base import Codec, CodecError


class _HalfCodec(Codec):
    wire_dtype: torch.dtype = torch.float16

    def encode(self, tensor: torch.Tensor) -> bytes:
        return wire_bytes(to_wire(as_flat_float32(tensor), self.wire_dtype))

    def decode(self, payload: bytes, shape: torch.Size, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
        numel = numel_of(shape)
        if len(payload) != 2 * numel:
            raise CodecError(f"{self.name} payload has {len(payload)} bytes, expected {2 * numel}")
        values = wire_floats(payload, self.wire_dtype, numel).reshape(tuple(shape))
        return values.to(device=device, dtype=dtype)

    def max_payload_nbytes(self, shape: tuple[int, ...]) -> int:
        return 2 * numel_of(shape)


class Float16Codec(_HalfCodec):
    """IEEE half precision; finite values beyond +-65504 saturate instead of becoming Inf."""

    name = "fp16"
    wire_dtype = torch.float16


class BFloat16Codec(_HalfCodec):
    """bfloat16 (round to nearest even), sent as the raw 16-bit patterns."""

    name = "bf16"
    wire_dtype = torch.bfloat16
