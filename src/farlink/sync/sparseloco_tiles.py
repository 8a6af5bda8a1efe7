"""SparseLoCo as its authors run it (tplr-ai/templar, the code of Templar's and Covenant-72B's
runs): their message layout, quantizer and averaging, beside the paper's in
:mod:`farlink.sync.sparseloco` (``--sparseloco-variant authors``).

Where the two differ (the error-feedback accumulator ``e <- beta e + Δ`` and the plain outer SGD
are the same):

- **tiles**: a matrix (a tensor of ndim >= 2, viewed as ``prod(shape[:-1]) x shape[-1]``) is cut
  into 2-D tiles of ``h x w``, each side the largest divisor of its dimension up to ``tile``
  (64: 64x64 tiles for the usual sizes), and the ``topk`` (64) largest-magnitude entries of each
  tile are kept; the paper's variant cuts 4096 consecutive elements of the flattened tensor;
- **1-D tensors whole** (norms, biases): every entry is sent, quantized like the rest;
- **quantizer**: the kept values of one tensor are centred on their mean, binned into 4 bins of
  ``6 sigma / 4`` around it (``round(c / scale + 2)`` clamped to 0..3, sigma the sample standard
  deviation) and each bin decoded as the mean of its values; the paper's variant splits by sign
  and the median magnitude;
- **averaging**: each peer's update of a tensor is first scaled down to the median of the
  peers' norms (``min(1, median / norm)``; ``torch.median``, the lower middle value for an even
  count), then every position is averaged over the peers that sent it, not over all peers; a
  peer whose update of a tensor is all zero (a healed worker sends nothing) is not counted;
- **one lr**: their code multiplies Δ by the outer lr when adding it to ``e`` and applies the lr
  again in the outer SGD (lr**2 overall, the same at their lr of 1.0); here it is applied once,
  in the outer step.

Wire format of one tensor (little-endian): four fp32 bin values (the bin mean plus the tensor's
mean: what a receiver adds up), 2-bit codes of the kept values, then for a matrix their indices
inside their tile, ``ceil(log2(h * w))`` bits each, sorted within a tile (the authors pack 12-bit
indices the same way). Bytes: ``16 + ceil(2 m k / 8) + ceil(b m k / 8)`` for ``m`` tiles of
``k`` kept entries, ``16 + ceil(2 n / 8)`` for a 1-D tensor of ``n``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from farlink.codecs._util import all_finite, require_finite, top_positions
from farlink.codecs.base import Codec, CodecError

TILE = 64
TOPK = 64
BINS = 4
RANGE_SIGMAS = 6.0
_BIN_BYTES = 4 * BINS  # four fp32 bin values


def _pack_bits(values: np.ndarray, bits: int) -> bytes:
    planes = (values.astype(np.int64)[:, None] >> np.arange(bits)) & 1
    return np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def _unpack_bits(buffer: bytes | memoryview, count: int, bits: int) -> np.ndarray:
    raw = np.frombuffer(buffer, dtype=np.uint8)
    planes = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits)
    return (planes.astype(np.int64) << np.arange(bits)).sum(1)


def largest_divisor_up_to(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` (a tile side that cuts ``n``
    exactly, as the authors' chunking picks it)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in 0..3, the four fp32 values they decode to) for the kept values of a tensor:
    centred on their mean, bins of ``RANGE_SIGMAS * sigma / BINS``, each bin's mean."""
    values = values.float()
    shift = values.mean()
    centred = values - shift
    n = centred.numel()
    sigma = centred.norm() / math.sqrt(n - 1) if n > 1 else torch.tensor(float("nan"))
    scale = RANGE_SIGMAS * sigma / BINS
    if not bool(torch.isfinite(scale)) or float(scale) == 0.0:
        scale = torch.tensor(1.0)
    codes = (centred / scale + BINS // 2).round().clamp(0, BINS - 1).long()
    sums = torch.zeros(BINS).scatter_add_(0, codes, centred)
    counts = torch.zeros(BINS).scatter_add_(0, codes, torch.ones_like(centred))
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return codes, means + shift


class TiledTwoBitCodec(Codec):
    """Top-k of 2-D tiles (1-D tensors whole) with the authors' 2-bit quantizer (module doc)."""

    def __init__(self, tile: int = TILE, topk: int = TOPK) -> None:
        if tile < 1 or topk < 1:
            raise ValueError(f"need tile >= 1 and topk >= 1, got tile={tile}, topk={topk}")
        self.tile, self.topk = tile, topk
        self.name = f"sparseloco:tiles:{tile}:{topk}"

    def geometry(self, shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
        """(rows, cols, tile rows, tile cols, kept per tile) of a matrix; (n, 0, 0, 0, n) for a
        1-D (or 0-D) tensor, sent whole."""
        shape = tuple(shape)
        if len(shape) < 2:
            n = math.prod(shape)
            return n, 0, 0, 0, n
        rows, cols = math.prod(shape[:-1]), shape[-1]
        h, w = largest_divisor_up_to(rows, self.tile), largest_divisor_up_to(cols, self.tile)
        return rows, cols, h, w, min(self.topk, h * w)

    def _sizes(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(values sent, bits per index; 0 for a tensor sent whole)."""
        rows, cols, h, w, k = self.geometry(shape)
        if not cols:
            return rows, 0
        return (rows // h) * (cols // w) * k, max(1, (h * w - 1).bit_length())

    def max_payload_nbytes(self, shape: tuple[int, ...]) -> int:
        count, bits = self._sizes(tuple(shape))
        return _BIN_BYTES + math.ceil(2 * count / 8) + math.ceil(bits * count / 8)

    def _tiles(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[n_tiles, h * w]``: the matrix's tiles, row-major over the tile grid."""
        rows, cols, h, w, _ = self.geometry(tuple(tensor.shape))
        grid = tensor.reshape(rows // h, h, cols // w, w).permute(0, 2, 1, 3)
        return grid.reshape(-1, h * w)

    def _untile(self, tiles: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        rows, cols, h, w, _ = self.geometry(shape)
        grid = tiles.reshape(rows // h, cols // w, h, w).permute(0, 2, 1, 3)
        return grid.reshape(shape)

    def encode(self, tensor: torch.Tensor) -> bytes:
        x = tensor.detach().float()
        require_finite(x.reshape(-1), self.name)
        rows, cols, h, w, k = self.geometry(tuple(x.shape))
        if not cols:
            codes, levels = quantize(x.reshape(-1).cpu())
            return levels.numpy().astype("<f4").tobytes() + _pack_bits(codes.numpy(), 2)
        tiles = self._tiles(x)
        positions = top_positions(tiles.abs(), k)  # sorted within each tile
        values = torch.gather(tiles, 1, positions).reshape(-1).cpu()
        codes, levels = quantize(values)
        _, bits = self._sizes(tuple(x.shape))
        return (levels.numpy().astype("<f4").tobytes() + _pack_bits(codes.numpy(), 2)
                + _pack_bits(positions.cpu().numpy().reshape(-1), bits))

    def decode_sparse(self, payload: bytes, shape: tuple[int, ...],
                      device: torch.device | str | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(positions ``[n_tiles, k]`` inside each tile, or None for a tensor sent whole;
        decoded values, ``[n_tiles, k]`` or ``[n]``), validated."""
        shape = tuple(shape)
        expected = self.max_payload_nbytes(shape)
        if len(payload) != expected:
            raise CodecError(f"{self.name} payload for shape {shape} must be {expected} bytes, "
                             f"got {len(payload)}")
        view = memoryview(payload)
        levels = torch.from_numpy(np.frombuffer(view[:_BIN_BYTES], dtype="<f4").copy())
        if not all_finite(levels):
            raise CodecError(f"{self.name} payload has NaN or Inf values")
        count, bits = self._sizes(shape)
        code_end = _BIN_BYTES + math.ceil(2 * count / 8)
        values = levels[torch.from_numpy(_unpack_bits(view[_BIN_BYTES:code_end], count, 2))]
        rows, cols, h, w, k = self.geometry(shape)
        if not cols:
            return None, values.to(device)
        idx = _unpack_bits(view[code_end:], count, bits).reshape(-1, k)
        if idx.size and int(idx.max()) >= h * w:
            raise CodecError(f"{self.name} index >= {h * w} (tile size)")
        if k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            raise CodecError(f"{self.name} indices within a tile are not strictly increasing")
        return torch.from_numpy(idx).to(device), values.view(-1, k).to(device)

    def decode(self, payload: bytes, shape: torch.Size, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
        dense, _ = self.decode_with_mask(payload, tuple(shape), device)
        return dense.to(dtype)

    def decode_with_mask(self, payload: bytes, shape: tuple[int, ...],
                         device: torch.device | str | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the dense float32 update, 1.0 where the sender sent a value, else 0.0)."""
        positions, values = self.decode_sparse(payload, shape, device)
        if positions is None:
            return values.reshape(shape), torch.ones(shape, device=values.device)
        _, _, h, w, _ = self.geometry(shape)
        tiles = torch.zeros(values.shape[0], h * w, device=values.device)
        mask = torch.zeros_like(tiles)
        tiles.scatter_(1, positions, values)
        mask.scatter_(1, positions, 1.0)
        return self._untile(tiles, shape), self._untile(mask, shape)


def clipped_contributor_mean(updates: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The authors' combination of several peers' sparse updates of one tensor, each given as
    (dense update, mask of the positions it sent): every update scaled to at most the median
    of their norms, then each position averaged over the peers that sent it. Updates that are
    all zero (a peer that sent nothing) are left out."""
    sent = [(u, m) for u, m in updates if bool(u.any())]
    if not sent:
        return torch.zeros_like(updates[0][0])
    updates = sent
    norms = torch.stack([u.norm() for u, _ in updates])
    median = torch.median(norms)
    total = torch.zeros_like(updates[0][0])
    count = torch.zeros_like(total)
    for (u, m), norm in zip(updates, norms):
        total += u * torch.clamp(median / (norm + 1e-8), max=1.0)
        count += m
    return total / count.clamp(min=1)
