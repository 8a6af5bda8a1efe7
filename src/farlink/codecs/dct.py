"""Chunked orthonormal DCT for DeMo (arXiv 2411.19870).

DeMo observes that momentum is concentrated in a few frequencies of small chunks of each tensor,
so it transforms chunks with a DCT-II and sends only the largest coefficients. Here:

- a 0-d/1-d tensor of ``n`` elements is cut into 1-d chunks of ``c = min(chunk, n)`` elements;
- a tensor with ``ndim >= 2`` is viewed as a matrix ``(prod(shape[:-1]), shape[-1])`` and cut
  into 2-d tiles of ``min(chunk, rows) x min(chunk, cols)``, transformed along both axes as DeMo
  does for weight matrices;
- a dimension that is not a multiple of its chunk is zero-padded (the DeMo reference instead
  picks a divisor of the dimension, which degrades to tiny chunks for prime sizes).

The transform is a matmul with a cached orthonormal DCT-II basis ``B`` (``B @ B.T = I``), so it
preserves energy (Parseval) and the inverse (DCT-III) is the transpose. ``chunked_dct`` returns
``[n_chunks, c]`` or ``[n_chunks, c_rows, c_cols]``, chunks in row-major order of the tile grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch


@lru_cache(maxsize=64)
def _basis_cached(n: int, dtype: torch.dtype) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    basis[0] /= math.sqrt(2.0)
    return basis.to(dtype)


def dct_basis(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``B[k, i] = a_k cos(pi (2i + 1) k / 2n)``: ``y = B @ x``."""
    if n <= 0:
        raise ValueError(f"DCT size must be positive, got {n}")
    return _basis_cached(int(n), dtype)


@dataclass(frozen=True)
class ChunkLayout:
    """How a tensor of ``shape`` maps onto a grid of DCT chunks (``cols == 0`` means 1-d)."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    chunk_rows: int
    chunk_cols: int

    @classmethod
    def of(cls, shape: tuple[int, ...] | torch.Size, chunk: int) -> ChunkLayout:
        if chunk <= 0:
            raise ValueError(f"chunk size must be positive, got {chunk}")
        shape = tuple(int(s) for s in shape)
        if len(shape) >= 2:
            rows, cols = math.prod(shape[:-1]), shape[-1]
            return cls(shape, rows, cols, max(1, min(chunk, rows)), max(1, min(chunk, cols)))
        numel = math.prod(shape)
        return cls(shape, numel, 0, max(1, min(chunk, numel)), 0)

    @property
    def two_d(self) -> bool:
        return len(self.shape) >= 2

    @property
    def grid(self) -> tuple[int, int]:
        """Chunks along rows and along columns (columns = 1 for 1-d layouts)."""
        n_r = -(-self.rows // self.chunk_rows)
        n_c = -(-self.cols // self.chunk_cols) if self.two_d else 1
        return n_r, n_c

    @property
    def n_chunks(self) -> int:
        n_r, n_c = self.grid
        return n_r * n_c

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.chunk_rows, self.chunk_cols) if self.two_d else (self.chunk_rows,)

    @property
    def coefficients_per_chunk(self) -> int:
        return math.prod(self.chunk_shape)


def to_chunks(tensor: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Zero-padded time-domain chunks ``[n_chunks, *chunk_shape]``."""
    n_r, n_c = layout.grid
    if not layout.two_d:
        flat = tensor.reshape(-1)
        flat = torch.nn.functional.pad(flat, (0, n_r * layout.chunk_rows - flat.numel()))
        return flat.view(n_r, layout.chunk_rows)
    mat = tensor.reshape(layout.rows, layout.cols)
    mat = torch.nn.functional.pad(
        mat, (0, n_c * layout.chunk_cols - layout.cols, 0, n_r * layout.chunk_rows - layout.rows)
    )
    tiles = mat.view(n_r, layout.chunk_rows, n_c, layout.chunk_cols).permute(0, 2, 1, 3)
    return tiles.reshape(n_r * n_c, layout.chunk_rows, layout.chunk_cols)


def from_chunks(chunks: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Inverse of :func:`to_chunks`: reassemble the grid and crop the padding."""
    n_r, n_c = layout.grid
    if not layout.two_d:
        return chunks.reshape(-1)[: layout.rows].reshape(layout.shape)
    tiles = chunks.reshape(n_r, n_c, layout.chunk_rows, layout.chunk_cols).permute(0, 2, 1, 3)
    mat = tiles.reshape(n_r * layout.chunk_rows, n_c * layout.chunk_cols)
    return mat[: layout.rows, : layout.cols].reshape(layout.shape)


def _check_float(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise TypeError(f"DCT needs a floating point tensor, got {tensor.dtype}")
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def dct_chunks(chunks: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """DCT-II of already chunked data (``B x`` per 1-d chunk, ``B_r X B_c^T`` per tile)."""
    b_r = dct_basis(layout.chunk_rows, chunks.dtype).to(chunks.device)
    if not layout.two_d:
        return chunks @ b_r.T
    b_c = dct_basis(layout.chunk_cols, chunks.dtype).to(chunks.device)
    return b_r @ chunks @ b_c.T


def idct_chunks(coeffs: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """DCT-III (the inverse) of per-chunk coefficients, still chunked."""
    b_r = dct_basis(layout.chunk_rows, coeffs.dtype).to(coeffs.device)
    if not layout.two_d:
        return coeffs @ b_r
    b_c = dct_basis(layout.chunk_cols, coeffs.dtype).to(coeffs.device)
    return b_r.T @ coeffs @ b_c


def chunked_dct(tensor: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Per-chunk orthonormal DCT-II coefficients, ``[n_chunks, c]`` or ``[n_chunks, cr, cc]``."""
    tensor = _check_float(tensor)
    layout = ChunkLayout.of(tensor.shape, chunk)
    return dct_chunks(to_chunks(tensor, layout), layout)


def chunked_idct(
    coeffs: torch.Tensor, shape: tuple[int, ...] | torch.Size, chunk: int = 64
) -> torch.Tensor:
    """Rebuild a tensor of ``shape`` from :func:`chunked_dct` coefficients (padding cropped)."""
    coeffs = _check_float(coeffs)
    layout = ChunkLayout.of(shape, chunk)
    expected = (layout.n_chunks, *layout.chunk_shape)
    if tuple(coeffs.shape) != expected:
        raise ValueError(f"coefficients of shape {tuple(coeffs.shape)}, expected {expected}")
    return from_chunks(idct_chunks(coeffs, layout), layout)
