"""Vectorized LEB128 varints for sorted sparse indices.

Top-k indices, sorted and sent as gaps, are mostly small numbers: with 1% density the mean gap
is about 100, which fits one byte instead of four. Both directions loop only over the (at most
five) byte positions, never over elements.
"""

from __future__ import annotations

import numpy as np

from farlink.codecs.base import CodecError

_MAX_BYTES = 5  # enough for any value below 2**35; indices stay below 2**32


def varint_nbytes(values: np.ndarray) -> np.ndarray:
    """Encoded length of each non-negative value (1..5 bytes)."""
    v = values.astype(np.uint64, copy=False)
    n = np.ones(v.shape, dtype=np.int64)
    for j in range(1, _MAX_BYTES):
        n += v >= np.uint64(1 << (7 * j))
    return n


def encode_varints(values: np.ndarray) -> bytes:
    """LEB128 of each value in order (low 7 bits first, high bit = more bytes follow)."""
    v = values.astype(np.uint64, copy=False)
    if v.size and int(v.max()) >= 1 << (7 * _MAX_BYTES):
        raise ValueError("varint value out of range")
    lengths = varint_nbytes(v)
    starts = np.cumsum(lengths) - lengths
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    for j in range(_MAX_BYTES):
        sel = lengths > j
        if not sel.any():
            break
        chunk = (v[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lengths[sel] - 1 > j).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + j] = (chunk | more).astype(np.uint8)
    return out.tobytes()


def decode_varints(buffer: bytes | memoryview, count: int) -> np.ndarray:
    """Exactly ``count`` values from ``buffer`` (which must hold nothing else), as int64."""
    b = np.frombuffer(buffer, dtype=np.uint8)
    if count == 0:
        if b.size:
            raise CodecError(f"{b.size} stray bytes where no varints were expected")
        return np.zeros(0, dtype=np.int64)
    last = (b & 0x80) == 0
    if b.size == 0 or not last[-1]:
        raise CodecError("truncated varint section")
    n_values = int(last.sum())
    if n_values != count:
        raise CodecError(f"varint section holds {n_values} values, expected {count}")
    group = np.cumsum(last) - last  # value index of each byte
    ends = np.flatnonzero(last)
    begins = np.concatenate([[0], ends[:-1] + 1])
    position = np.arange(b.size) - begins[group]
    if int(position.max()) >= _MAX_BYTES:
        raise CodecError("varint longer than 5 bytes")
    pieces = (b & 0x7F).astype(np.float64) * np.exp2(7.0 * position)
    return np.bincount(group, weights=pieces, minlength=count).astype(np.int64)
