"""Chunked DCT: orthonormal basis, exact inverse, Parseval, and DeMo's dct_topk codec."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from farlink.codecs import CodecError, DctTopKCodec, make_codec, make_compressor
from farlink.codecs.dct import ChunkLayout, chunked_dct, chunked_idct, dct_basis

torch.set_num_threads(1)


def reference_dct2(x: np.ndarray) -> np.ndarray:
    """Orthonormal DCT-II from its defining sum, along the last axis (float64)."""
    n = x.shape[-1]
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    mat = np.cos(np.pi * (2 * i + 1) * k / (2 * n))
    scale = np.full(n, math.sqrt(2.0 / n))
    scale[0] = math.sqrt(1.0 / n)
    return (x @ mat.T) * scale


@pytest.mark.parametrize("n", [1, 2, 7, 64, 100])
def test_basis_is_orthonormal_and_matches_definition(n: int) -> None:
    b = dct_basis(n, torch.float64)
    assert torch.allclose(b @ b.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    x = np.random.default_rng(n).standard_normal((3, n))
    ours = (torch.from_numpy(x) @ b.T).numpy()
    np.testing.assert_allclose(ours, reference_dct2(x), atol=1e-12)


def test_dct_of_constant_is_dc_only() -> None:
    coeffs = chunked_dct(torch.full((64,), 2.0), 64)
    assert coeffs.shape == (1, 64)
    assert coeffs[0, 0].item() == pytest.approx(2.0 * 8.0, rel=1e-6)  # 2 * sqrt(64)
    assert coeffs[0, 1:].abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "shape", [(1,), (64,), (1000,), (64, 64), (100, 130), (3, 5, 7), (2, 70, 65), (1, 1)]
)
def test_roundtrip_and_parseval(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    coeffs = chunked_dct(x, 64)
    layout = ChunkLayout.of(shape, 64)
    assert coeffs.shape == (layout.n_chunks, *layout.chunk_shape)
    back = chunked_idct(coeffs, shape, 64)
    assert back.shape == x.shape
    assert (back - x).abs().max().item() < 1e-5
    # zero padding adds no energy, so the orthonormal transform preserves it exactly
    assert coeffs.pow(2).sum().item() == pytest.approx(x.pow(2).sum().item(), rel=1e-5)


def test_2d_tiles_transform_both_axes() -> None:
    x = torch.randn(128, 64, dtype=torch.float64)
    coeffs = chunked_dct(x, 64)
    assert coeffs.shape == (2, 64, 64)
    top = x[:64].numpy()
    expected = reference_dct2(reference_dct2(top).T).T  # rows then columns
    np.testing.assert_allclose(coeffs[0].numpy(), expected, atol=1e-10)


def test_idct_rejects_wrong_coefficient_shape() -> None:
    with pytest.raises(ValueError):
        chunked_idct(torch.zeros(3, 64), (64,), 64)


def test_dct_topk_keeps_exactly_k_per_chunk_and_the_largest() -> None:
    codec = DctTopKCodec(chunk=64, topk=32)
    x = torch.randn(200, 150)
    sparse = codec.encode_coefficients(x)
    layout = ChunkLayout.of(x.shape, 64)
    assert sparse.indices.shape == (layout.n_chunks, 32)
    assert all(len(set(row.tolist())) == 32 for row in sparse.indices)
    full = chunked_dct(x, 64).reshape(layout.n_chunks, -1).abs()
    kept = torch.zeros_like(full, dtype=torch.bool).scatter_(1, sparse.indices, True)
    # every kept coefficient is at least as large as every dropped one, chunk by chunk
    smallest_kept = torch.where(kept, full, torch.inf).amin(1)
    largest_dropped = torch.where(kept, -torch.inf, full).amax(1)
    assert bool((smallest_kept >= largest_dropped).all())
    decoded = codec.decode(codec.encode(x), x.shape, torch.float32)
    assert torch.allclose(decoded, codec.decode_coefficients(sparse), atol=1e-6)


@pytest.mark.parametrize("shape", [(1000,), (37,), (64, 64), (70, 130), (2, 3, 65)])
def test_dct_topk_with_full_k_is_lossless(shape: tuple[int, ...]) -> None:
    codec = DctTopKCodec(chunk=16, topk=16 * 16)  # k >= coefficients per chunk keeps all
    x = torch.randn(shape)
    decoded = codec.decode(codec.encode(x), x.shape, torch.float32)
    assert (decoded - x).abs().max().item() < 1e-5


def test_dct_topk_payload_size_and_ratio() -> None:
    codec = make_codec("dct_topk:64:32")
    x = torch.randn(256, 512)
    payload = codec.encode(x)
    n_chunks = (256 // 64) * (512 // 64)
    assert len(payload) == n_chunks * 32 * (4 + 2) == codec.max_payload_nbytes(x.shape)
    assert 4 * x.numel() / len(payload) == pytest.approx(4096 * 4 / 192)  # 85.3x, DeMo's figure
    one_d = torch.randn(1000)  # 16 chunks of 64 -> uint8 indices
    assert len(codec.encode(one_d)) == 16 * 32 * (4 + 1)
    half = make_codec("dct_topk:64:32:fp16")
    assert len(half.encode(x)) == n_chunks * 32 * (2 + 2)


def test_average_of_peers_before_one_inverse() -> None:
    codec = DctTopKCodec(chunk=32, topk=8)
    peers = [torch.randn(64, 96, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    sparse = [codec.unpack(codec.encode(p), p.shape) for p in peers]
    one_inverse = codec.decode_coefficients(sparse, reduce="mean")
    separately = sum(codec.decode(codec.encode(p), p.shape, torch.float32) for p in peers) / 3
    assert torch.allclose(one_inverse, separately, atol=1e-5)
    summed = codec.decode_coefficients(sparse, reduce="sum")
    assert torch.allclose(summed, 3 * one_inverse, atol=1e-5)
    # contributors: a coefficient sent by one peer only keeps its full value
    n_chunks = len(sparse[0].indices)
    dense = codec.dense_coefficients(sparse, reduce="contributors").reshape(n_chunks, -1)
    only_first = torch.zeros_like(dense, dtype=torch.bool).scatter_(1, sparse[0].indices, True)
    for other in sparse[1:]:
        only_first.scatter_(1, other.indices, False)
    first = codec.dense_coefficients(sparse[0], reduce="sum").reshape_as(dense)
    assert torch.equal(dense[only_first], first[only_first])
    with pytest.raises(ValueError):
        codec.decode_coefficients([sparse[0], codec.encode_coefficients(torch.randn(10))])


def test_demo_error_feedback_in_dct_and_time_domain_agree() -> None:
    codec = DctTopKCodec(chunk=64, topk=4)
    momentum = torch.randn(128, 64)
    sparse = codec.encode_coefficients(momentum)
    sent_time = codec.decode_coefficients(sparse)
    sent_dct = codec.dense_coefficients(sparse)
    remaining_dct = chunked_dct(momentum, 64) - sent_dct
    assert torch.allclose(chunked_dct(momentum - sent_time, 64), remaining_dct, atol=1e-5)
    # what was subtracted is exactly what a receiver of the bytes reconstructs
    received = codec.decode(codec.pack(sparse), momentum.shape, torch.float32)
    assert torch.equal(received, sent_time)


def test_dct_topk_error_feedback_drains_the_residual() -> None:
    comp = make_compressor("dct_topk:16:8+ef")
    target = torch.randn(48, 48)
    total_sent = torch.zeros_like(target)
    for step in range(40):
        payload = comp.encode("w", target if step == 0 else torch.zeros_like(target))
        total_sent += comp.decode(payload, target.shape, torch.float32)
    assert torch.allclose(total_sent + comp.residuals["w"], target, atol=1e-4)
    assert comp.residuals["w"].norm() < 0.05 * target.norm()


def test_dct_topk_rejects_corrupt_payloads() -> None:
    codec = DctTopKCodec(chunk=64, topk=32)
    x = torch.randn(64, 128)
    payload = bytearray(codec.encode(x))
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(bytes(payload[:-1]), x.shape, torch.float32)
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(bytes(payload) + b"\0", x.shape, torch.float32)
    values_len = 2 * 32 * 4
    bad_index = bytearray(payload)
    bad_index[values_len : values_len + 2] = (4096).to_bytes(2, "little")
    with pytest.raises(CodecError, match="index"):
        codec.decode(bytes(bad_index), x.shape, torch.float32)
    duplicate = bytearray(payload)
    duplicate[values_len + 2 : values_len + 4] = duplicate[values_len : values_len + 2]
    with pytest.raises(CodecError, match="increasing"):
        codec.decode(bytes(duplicate), x.shape, torch.float32)
    nan_value = bytearray(payload)
    nan_value[0:4] = np.array([np.nan], dtype=np.float32).tobytes()
    with pytest.raises(CodecError, match="NaN"):
        codec.decode(bytes(nan_value), x.shape, torch.float32)
    with pytest.raises(CodecError, match="NaN"):
        codec.encode(torch.tensor([1.0, float("inf")]))


def test_spec_parsing() -> None:
    codec = make_codec("dct_topk:32:8:fp16")
    assert (codec.chunk, codec.topk, codec.value_dtype) == (32, 8, torch.float16)
    assert make_codec(codec.name).name == codec.name
    for bad in ["dct_topk:0", "dct_topk:64:x", "dct_topk:64:32:int8", "dct_topk:1:2:fp16:9"]:
        with pytest.raises(ValueError):
            make_codec(bad)
