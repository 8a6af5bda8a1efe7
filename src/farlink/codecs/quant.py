"""Blockwise symmetric absmax quantization to int8 or int4 (INTELLECT-1, Streaming DiLoCo).

The flattened tensor is cut into blocks of ``block`` elements (the last one may be short). Each
block sends one scale ``s >= absmax / qmax`` (``qmax`` = 127 for int8, 7 for int4) and its codes
``q = round(x / s)`` in ``[-qmax, qmax]``; the receiver sees ``q * s``, so every element is off by
at most ``s / 2``. The scale is rounded *up* to its wire dtype and the codes are computed with the
rounded value, so the bound holds for what is actually sent and codes never clip (fp16 scales
above 65504 excepted: they saturate). The default scale dtype is bf16: as small as fp16 but with
fp32's range, so the tiny scales of small pseudo-gradients do not underflow.

Payload layout, little-endian, no header::

    scales: n_blocks x scale_bytes | codes: numel bytes (int8) or ceil(numel / 2) bytes (int4)

with ``n_blocks = ceil(numel / block)``. int4 packs element ``2i`` in the low nibble and ``2i+1``
in the high nibble of byte ``i``, each as ``q + 8`` (so nibble 0 never occurs; an odd tail is
padded with the zero code 8). Example: int4, 1000 floats, block 64, bf16 scales ->
``16 * 2 + 500 = 532`` bytes, 7.5x smaller than fp32.
"""

from __future__ import annotations

import numpy as np
import torch

from farlink.codecs._util import (
    all_finite,
    as_flat_float32,
    float_name,
    itemsize,
    numel_of,
    parse_positive_int,
    parse_wire_float,
    require_finite,
    split_args,
    wire_bytes,
    wire_floats,
)
from farlink.codecs.base import Codec, CodecError

_QMAX = {8: 127, 4: 7}
_FP16_MAX = float(torch.finfo(torch.float16).max)


def round_up_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative float32 ``values`` cast to ``dtype`` rounding towards +inf, not to nearest.

    For positive floats the next representable value up is the bit pattern plus one, which
    makes this a vectorized ``nextafter`` for the 16-bit formats.
    """
    if dtype == torch.float32:
        return values.clone()
    if dtype == torch.float16:
        values = values.clamp(max=_FP16_MAX)
    wire = values.to(dtype)
    low = wire.float() < values
    bits = wire.view(torch.int16)
    bits = torch.where(low, bits + 1, bits)
    return bits.view(dtype)


class BlockQuantCodec(Codec):
    """int8/int4 blockwise absmax quantization; see the module docstring for the byte layout."""

    def __init__(self, bits: int, block: int = 64, scale_dtype: torch.dtype = torch.bfloat16):
        if bits not in _QMAX:
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        if block <= 0:
            raise ValueError(f"block size must be positive, got {block}")
        if scale_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"unsupported scale dtype {scale_dtype}")
        self.bits, self.block, self.scale_dtype = bits, block, scale_dtype
        self.qmax = _QMAX[bits]
        self.name = f"int{bits}:{block}:{float_name(scale_dtype)}"

    @classmethod
    def from_arg(cls, bits: int, arg: str | None) -> BlockQuantCodec:
        """``int8``, ``int8:128``, ``int4:64:fp32`` -> block size and scale dtype."""
        parts = split_args(arg, 2, f"int{bits}")
        block = parse_positive_int(parts[0], "block size") if parts else 64
        scale = parse_wire_float(parts[1], "scale dtype") if len(parts) > 1 else torch.bfloat16
        return cls(bits, block, scale)

    # -- sizes ------------------------------------------------------------------------------
    def n_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def code_nbytes(self, numel: int) -> int:
        return numel if self.bits == 8 else -(-numel // 2)

    def max_payload_nbytes(self, shape: tuple[int, ...]) -> int:
        numel = numel_of(shape)
        return self.n_blocks(numel) * itemsize(self.scale_dtype) + self.code_nbytes(numel)

    # -- encode -----------------------------------------------------------------------------
    def quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales as float32 after wire rounding, int codes per element) for ``tensor``."""
        flat = as_flat_float32(tensor)
        require_finite(flat, self.name)
        numel, nb = flat.numel(), self.n_blocks(flat.numel())
        blocks = torch.nn.functional.pad(flat, (0, nb * self.block - numel)).view(nb, self.block)
        scales = round_up_to(blocks.abs().amax(dim=1) / self.qmax, self.scale_dtype).float()
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe[:, None]).clamp_(-self.qmax, self.qmax)
        return scales, codes.reshape(-1)[:numel].to(torch.int8)

    def encode(self, tensor: torch.Tensor) -> bytes:
        scales, codes = self.quantize(tensor)
        scale_bytes = wire_bytes(scales.to(self.scale_dtype))
        if self.bits == 8:
            return scale_bytes + codes.cpu().numpy().tobytes()
        nibbles = (codes.to(torch.int16) + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            pad = torch.tensor([8], dtype=torch.uint8, device=nibbles.device)
            nibbles = torch.cat([nibbles, pad])
        pairs = nibbles.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        return scale_bytes + packed.cpu().numpy().tobytes()

    # -- decode -----------------------------------------------------------------------------
    def decode(self, payload: bytes, shape: torch.Size, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
        numel = numel_of(shape)
        expected = self.max_payload_nbytes(tuple(shape))
        if len(payload) != expected:
            raise CodecError(
                f"{self.name} payload for {numel} elements must be {expected} bytes, "
                f"got {len(payload)}"
            )
        nb = self.n_blocks(numel)
        scale_len = nb * itemsize(self.scale_dtype)
        view = memoryview(payload)
        scales = wire_floats(view[:scale_len], self.scale_dtype, nb)
        if not all_finite(scales) or (nb and float(scales.min()) < 0):
            raise CodecError(f"{self.name} payload has a NaN, Inf or negative block scale")
        codes = self._parse_codes(view[scale_len:], numel).to(device)
        scales = scales.to(device)
        padded = torch.nn.functional.pad(codes, (0, nb * self.block - numel))
        values = (padded.view(nb, self.block) * scales[:, None]).reshape(-1)[:numel]
        return values.reshape(tuple(shape)).to(dtype)

    def _parse_codes(self, buffer: memoryview, numel: int) -> torch.Tensor:
        if self.bits == 8:
            codes = torch.from_numpy(np.frombuffer(buffer, dtype=np.int8).copy())
            if codes.numel() and int(codes.min()) == -128:
                raise CodecError(f"{self.name} payload has code -128, outside [-127, 127]")
            return codes.float()
        packed = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8).copy())
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)
        if nibbles.numel() and int(nibbles.min()) == 0:
            raise CodecError(f"{self.name} payload has code -8, outside [-7, 7]")
        if nibbles.numel() > numel and int(nibbles[-1]) != 8:
            raise CodecError(f"{self.name} payload has a non-zero padding nibble")
        return nibbles[:numel].float() - 8.0
