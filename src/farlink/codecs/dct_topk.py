"""DeMo's wire format: per DCT chunk, the top-k coefficients by magnitude.

``dct_topk:64:32`` cuts each tensor into 64-wide chunks (64x64 tiles for matrices, see
:mod:`farlink.codecs.dct`), keeps the 32 largest-magnitude DCT coefficients of every chunk and
sends them as ``values | indices``: values in fp32 (or fp16 with ``dct_topk:64:32:fp16``),
indices of the coefficient inside its chunk as uint8 when a chunk has at most 256 coefficients,
uint16 up to 65536, else uint32. No header; the payload is exactly
``n_chunks * k * (value_bytes + index_bytes)`` with ``k = min(topk, coefficients per chunk)``.
A 64x64 tile (16 KiB in fp32) costs ``32 * (4 + 2) = 192`` bytes: 85x smaller.

Besides the dense :class:`~farlink.codecs.base.Codec` interface (decode = inverse DCT of the
sparse coefficients), the DeMo algorithm uses the coefficient-level API: it needs what it sent,
in the DCT or the time domain, to subtract from its momentum, and it averages several peers'
sparse coefficients before a single inverse DCT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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
    to_wire,
    top_positions,
    wire_bytes,
    wire_floats,
)
from farlink.codecs.base import Codec, CodecError
from farlink.codecs.dct import ChunkLayout, dct_chunks, from_chunks, idct_chunks, to_chunks

Reduce = Literal["mean", "sum", "contributors"]


@dataclass
class SparseDct:
    """Top-k DCT coefficients of one tensor: ``indices``/``values`` are ``[n_chunks, k]``.

    ``indices`` (int64) address the flattened coefficients of each chunk and are sorted
    ascending within a chunk; ``values`` (float32) are already rounded to the wire dtype, so
    they are exactly what a receiver of the encoded bytes reconstructs.
    """

    layout: ChunkLayout
    indices: torch.Tensor
    values: torch.Tensor


def _index_dtype(coefficients_per_chunk: int) -> str:
    if coefficients_per_chunk <= 1 << 8:
        return "u1"
    return "<u2" if coefficients_per_chunk <= 1 << 16 else "<u4"


class DctTopKCodec(Codec):
    """Chunked DCT + per-chunk top-k, as in DeMo; lossless when ``topk`` >= chunk size."""

    def __init__(self, chunk: int = 64, topk: int = 32, value_dtype: torch.dtype = torch.float32):
        if chunk <= 0 or topk <= 0:
            raise ValueError(f"chunk and topk must be positive, got {chunk}, {topk}")
        if value_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"dct_topk values must be fp16 or fp32, got {value_dtype}")
        self.chunk, self.topk, self.value_dtype = chunk, topk, value_dtype
        self.name = f"dct_topk:{chunk}:{topk}:{float_name(value_dtype)}"

    @classmethod
    def from_arg(cls, arg: str | None) -> DctTopKCodec:
        """``dct_topk``, ``dct_topk:64``, ``dct_topk:64:32``, ``dct_topk:64:32:fp16``."""
        parts = split_args(arg, 3, "dct_topk")
        chunk = parse_positive_int(parts[0], "DCT chunk size") if parts else 64
        topk = parse_positive_int(parts[1], "top-k per chunk") if len(parts) > 1 else 32
        values = parse_wire_float(parts[2], "value dtype") if len(parts) > 2 else torch.float32
        return cls(chunk, topk, values)

    # -- geometry -----------------------------------------------------------------------------
    def layout(self, shape: tuple[int, ...] | torch.Size) -> ChunkLayout:
        return ChunkLayout.of(tuple(shape), self.chunk)

    def k_for(self, layout: ChunkLayout) -> int:
        return min(self.topk, layout.coefficients_per_chunk)

    def max_payload_nbytes(self, shape: tuple[int, ...]) -> int:
        layout = self.layout(shape)
        index_bytes = np.dtype(_index_dtype(layout.coefficients_per_chunk)).itemsize
        per = itemsize(self.value_dtype) + index_bytes
        return layout.n_chunks * self.k_for(layout) * per

    # -- coefficient-level API ------------------------------------------------------------------
    def encode_coefficients(self, tensor: torch.Tensor) -> SparseDct:
        """Chunked DCT of ``tensor`` and its top-k coefficients per chunk."""
        layout = self.layout(tensor.shape)
        flat = as_flat_float32(tensor)
        require_finite(flat, self.name)
        coeffs = dct_chunks(to_chunks(flat, layout), layout).reshape(
            layout.n_chunks, layout.coefficients_per_chunk
        )
        k = self.k_for(layout)
        indices = top_positions(coeffs.abs(), k)
        values = to_wire(torch.gather(coeffs, 1, indices), self.value_dtype).float()
        return SparseDct(layout, indices, values)

    def pack(self, sparse: SparseDct) -> bytes:
        """The wire bytes of ``sparse``: all values, then all indices, chunk-major."""
        index_dtype = _index_dtype(sparse.layout.coefficients_per_chunk)
        return wire_bytes(sparse.values.to(self.value_dtype)) + (
            sparse.indices.cpu().numpy().astype(index_dtype).tobytes()
        )

    def unpack(self, payload: bytes, shape: tuple[int, ...] | torch.Size,
               device: torch.device | str | None = None) -> SparseDct:
        """Parse and validate the payload of a tensor of ``shape`` (on the host), its
        coefficients then on ``device`` (None: the CPU)."""
        layout = self.layout(shape)
        numel_of(layout.shape)
        expected = self.max_payload_nbytes(layout.shape)
        if len(payload) != expected:
            raise CodecError(
                f"{self.name} payload for shape {layout.shape} must be {expected} bytes, "
                f"got {len(payload)}"
            )
        n, k, cpc = layout.n_chunks, self.k_for(layout), layout.coefficients_per_chunk
        split = n * k * itemsize(self.value_dtype)
        view = memoryview(payload)
        values = wire_floats(view[:split], self.value_dtype, n * k).view(n, k)
        raw = np.frombuffer(view[split:], dtype=_index_dtype(cpc)).astype(np.int64)
        indices = torch.from_numpy(raw).view(n, k)
        if indices.numel() and int(indices.max()) >= cpc:
            raise CodecError(f"{self.name} coefficient index >= {cpc} (chunk size)")
        if k > 1 and not bool((indices[:, 1:] > indices[:, :-1]).all()):
            raise CodecError(f"{self.name} indices within a chunk are not strictly increasing")
        if not all_finite(values):
            raise CodecError(f"{self.name} payload has NaN or Inf values")
        return SparseDct(layout, indices.to(device), values.to(device))

    def dense_coefficients(
        self, sparse: SparseDct | Sequence[SparseDct], reduce: Reduce = "mean"
    ) -> torch.Tensor:
        """Scatter one or several peers' coefficients into ``[n_chunks, *chunk_shape]``.

        ``mean`` divides the sum by the number of peers (the average of their reconstructions,
        since the transform is linear); ``sum`` does not divide; ``contributors`` divides each
        coefficient by how many peers sent it, as the DeMo reference's scatter-mean does.
        """
        parts = [sparse] if isinstance(sparse, SparseDct) else list(sparse)
        if not parts:
            raise ValueError("no coefficients to combine")
        layout = parts[0].layout
        if any(p.layout != layout for p in parts):
            raise ValueError("cannot combine coefficients of tensors with different layouts")
        if reduce not in ("mean", "sum", "contributors"):
            raise ValueError(f"unknown reduce {reduce!r}")
        indices = torch.cat([p.indices for p in parts], dim=1)
        values = torch.cat([p.values for p in parts], dim=1)
        out = torch.zeros(layout.n_chunks, layout.coefficients_per_chunk, device=values.device)
        out.scatter_add_(1, indices, values)
        if reduce == "mean":
            out /= len(parts)
        elif reduce == "contributors":
            count = torch.zeros_like(out).scatter_add_(1, indices, torch.ones_like(values))
            out /= count.clamp(min=1)
        return out.view(layout.n_chunks, *layout.chunk_shape)

    def decode_coefficients(
        self, sparse: SparseDct | Sequence[SparseDct], reduce: Reduce = "mean"
    ) -> torch.Tensor:
        """Time-domain float32 tensor: inverse DCT of the (combined) sparse coefficients."""
        dense = self.dense_coefficients(sparse, reduce)
        layout = (sparse if isinstance(sparse, SparseDct) else sparse[0]).layout
        return from_chunks(idct_chunks(dense, layout), layout)

    # -- Codec interface ------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor) -> bytes:
        return self.pack(self.encode_coefficients(tensor))

    def decode(self, payload: bytes, shape: torch.Size, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
        return self.decode_coefficients(self.unpack(payload, shape, device)).to(dtype)
