"""Lossless float32: the reference every lossy codec is measured against."""

from __future__ import annotations

import numpy as np
import torch

from farlink.codecs._util import numel_of
from farlink.codecs.base import Codec, CodecError


class Float32Codec(Codec):
    name = "fp32"

    def encode(self, tensor: torch.Tensor) -> bytes:
        return tensor.detach().to(dtype=torch.float32).contiguous().cpu().numpy().tobytes()

    def decode(self, payload: bytes, shape: torch.Size, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
        numel = numel_of(shape)
        if len(payload) != 4 * numel:
            raise CodecError(f"fp32 payload has {len(payload)} bytes, expected {4 * numel}")
        array = np.frombuffer(payload, dtype=np.float32).copy()
        return torch.from_numpy(array).reshape(tuple(shape)).to(device=device, dtype=dtype)

    def max_payload_nbytes(self, shape: tuple[int, ...]) -> int:
        return 4 * numel_of(shape)
