"""Codecs against formula references: error bounds, exact payload sizes, error feedback, and
strict rejection of corrupt payloads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from farlink.codecs import (
    CODECS,
    BlockQuantCodec,
    CodecError,
    TopKCodec,
    make_codec,
    make_compressor,
)
from farlink.codecs.quant import round_up_to
from farlink.codecs.varint import decode_varints, encode_varints

torch.set_num_threads(1)

ALL_SPECS = [
    "none", "fp32", "fp16", "bf16", "int8", "int4", "int8:128", "int4:32:fp32", "int8:64:fp16",
    "topk", "topk:0.05", "topk:0.2:fp16", "dct_topk", "dct_topk:16:8", "dct_topk:8:4:fp16",
]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def roundtrip(spec: str, x: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    codec = make_codec(spec)
    payload = codec.encode(x)
    assert isinstance(payload, bytes)
    return codec.decode(payload, x.shape, torch.float32), payload


# -- registry and specs ----------------------------------------------------------------------
def test_every_registered_codec_builds_and_its_name_is_a_spec() -> None:
    assert {"none", "fp32", "fp16", "bf16", "int8", "int4", "topk", "dct_topk"} <= set(CODECS)
    for spec in ALL_SPECS:
        comp = make_compressor(spec + "+ef")
        assert comp.error_feedback
        rebuilt = make_compressor(comp.spec)
        assert rebuilt.spec == comp.spec and rebuilt.error_feedback


@pytest.mark.parametrize(
    "bad", ["int3", "int8:0", "int8:abc", "int8:64:int4", "int8:64:fp16:1", "topk:0", "topk:1.5",
            "topk:x", "topk:0.1:bf16", "fp16:3"],
)
def test_bad_specs_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        make_compressor(bad)


# -- dense half precision ----------------------------------------------------------------------
def test_fp16_and_bf16_relative_error_bounds() -> None:
    x = randn(10_000) * 10
    for spec, unit_roundoff in [("fp16", 2.0**-11), ("bf16", 2.0**-8)]:
        y, payload = roundtrip(spec, x)
        assert len(payload) == 2 * x.numel()
        assert bool(((y - x).abs() <= x.abs() * unit_roundoff + 1e-7).all())
        assert torch.equal(y, x.to(torch.float16 if spec == "fp16" else torch.bfloat16).float())


def test_fp16_saturates_instead_of_overflowing_and_bf16_keeps_range() -> None:
    x = torch.tensor([1e6, -1e6, 3.0])
    y, _ = roundtrip("fp16", x)
    assert y.tolist() == [65504.0, -65504.0, 3.0]
    y, _ = roundtrip("bf16", x)
    assert abs(y[0].item() - 1e6) <= 1e6 * 2**-8


def test_half_decode_restores_requested_dtype() -> None:
    codec = make_codec("bf16")
    out = codec.decode(codec.encode(randn(4, 4)), torch.Size([4, 4]), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 4)


# -- blockwise quantization ----------------------------------------------------------------------
@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7)])
@pytest.mark.parametrize("block", [64, 128, 7])
@pytest.mark.parametrize("scale", ["bf16", "fp16", "fp32"])
def test_quant_error_is_at_most_half_a_step_per_block(bits: int, qmax: int, block: int,
                                                      scale: str) -> None:
    x = randn(1000, seed=bits + block) * torch.logspace(-3, 2, 1000)  # blocks of varied scale
    codec = make_codec(f"int{bits}:{block}:{scale}")
    y = codec.decode(codec.encode(x), x.shape, torch.float32)
    n_blocks = math.ceil(1000 / block)
    padded = torch.nn.functional.pad(x, (0, n_blocks * block - 1000)).view(n_blocks, block)
    err = torch.nn.functional.pad((y - x).abs(), (0, n_blocks * block - 1000)).view(n_blocks, block)
    ideal_step = padded.abs().amax(1) / qmax
    scales, codes = codec.quantize(x)  # the scales the receiver sees
    assert bool((err.amax(1) <= scales / 2 * (1 + 1e-6)).all())
    # the wire scale is the ideal one rounded up by at most one ulp, so no code ever clips
    ulp = {"bf16": 2.0**-7, "fp16": 2.0**-10, "fp32": 0.0}[scale]
    assert bool((scales >= ideal_step).all()) and int(codes.abs().max()) <= qmax
    subnormal_ulp = 2.0**-24 if scale == "fp16" else 0.0  # fp16 steps below 6e-5 are coarse
    assert bool((scales <= ideal_step * (1 + ulp) * (1 + 1e-6) + subnormal_ulp).all())


@pytest.mark.parametrize("spec", ["int8", "int4", "int4:64:fp16"])
def test_quant_zero_and_constant_tensors(spec: str) -> None:
    zero = torch.zeros(130)
    y, _ = roundtrip(spec, zero)
    assert torch.equal(y, zero)
    const = torch.full((3, 50), -0.37)
    y, _ = roundtrip(spec, const)
    # the constant is the block's absmax, coded as -qmax * scale with scale >= absmax / qmax
    assert (y - const).abs().max().item() <= 0.37 * 2**-8


@pytest.mark.parametrize(
    "spec,numel,scale_bytes,code_bytes",
    [("int4", 1000, 2, 500), ("int4", 1001, 2, 501), ("int8", 1000, 2, 1000),
     ("int8:128", 1000, 2, 1000), ("int4:64:fp32", 1000, 4, 500), ("int8:64:fp16", 1, 2, 1)],
)
def test_quant_payload_length_formula(spec: str, numel: int, scale_bytes: int,
                                      code_bytes: int) -> None:
    codec = make_codec(spec)
    assert isinstance(codec, BlockQuantCodec)
    expected = math.ceil(numel / codec.block) * scale_bytes + code_bytes
    payload = codec.encode(randn(numel))
    assert len(payload) == expected == codec.max_payload_nbytes((numel,))
    if spec == "int4" and numel == 1000:
        assert expected == 16 * 2 + 500


def test_compression_ratios_against_fp32() -> None:
    x = randn(64 * 1024)
    fp32 = 4 * x.numel()
    specs = ["fp16", "int8", "int4", "int8:64:fp32"]
    ratio = {s: fp32 / len(make_codec(s).encode(x)) for s in specs}
    assert ratio["fp16"] == 2.0
    assert ratio["int8"] == pytest.approx(256 / 66)  # 3.88x
    assert ratio["int4"] == pytest.approx(256 / 34)  # 7.53x
    assert ratio["int8:64:fp32"] == pytest.approx(256 / 68)


def test_round_up_to_never_rounds_down() -> None:
    values = torch.rand(10_000) * torch.logspace(-12, 6, 10_000)
    for dtype in (torch.float16, torch.bfloat16):
        up = round_up_to(values, dtype).float()
        if dtype == torch.float16:
            assert bool((up >= values.clamp(max=65504)).all())
        else:
            assert bool((up >= values).all())
            assert bool(((up - values) <= values * 2**-7).all())  # at most one bf16 ulp


def test_int4_packs_two_codes_per_byte() -> None:
    codec = BlockQuantCodec(4, block=4, scale_dtype=torch.float32)
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, 3.0])  # block 1 absmax 7 -> scale 1
    payload = codec.encode(x)
    scales = np.frombuffer(payload[:8], dtype=np.float32)
    assert scales.tolist() == [1.0, float(np.float32(3.0) / np.float32(7.0))]
    codes = payload[8:]
    assert codes[0] == (7 + 8) | ((-7 + 8) << 4)
    assert codes[1] == (1 + 8) | (8 << 4)
    assert codes[2] == (7 + 8) | (8 << 4)  # odd tail padded with the zero code


# -- top-k ----------------------------------------------------------------------------------------
def test_topk_keeps_the_largest_entries_exactly() -> None:
    x = randn(5000)
    codec = TopKCodec(0.01)
    y = codec.decode(codec.encode(x), x.shape, torch.float32)
    assert int((y != 0).sum()) == 50
    kept = y != 0
    assert torch.equal(y[kept], x[kept])
    assert x.abs()[kept].min() >= x.abs()[~kept].max()


@pytest.mark.parametrize("numel", [1, 10, 1000, 65536, 65537, 300_000])
@pytest.mark.parametrize("fraction", [0.01, 0.3, 1.0])
def test_topk_payload_length_is_the_smallest_layout(numel: int, fraction: float) -> None:
    codec = TopKCodec(fraction)
    x = randn(numel, seed=numel)
    payload = codec.encode(x)
    k = min(numel, max(1, math.ceil(fraction * numel)))
    idx = np.flatnonzero(codec.decode(payload, x.shape, torch.float32).numpy() != 0)
    gaps = np.diff(idx, prepend=-1) - 1
    varint = int(sum(1 + (g >= 128) + (g >= 1 << 14) + (g >= 1 << 21) + (g >= 1 << 28)
                     for g in gaps.tolist()))
    fixed = 2 * k if numel <= 65536 else 4 * k
    assert len(payload) == 1 + 4 * k + min(varint, fixed, 4 * k)
    assert len(payload) <= codec.max_payload_nbytes((numel,))


def test_varints_roundtrip_at_byte_boundaries() -> None:
    values = np.array([0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28, 2**32 - 1])
    encoded = encode_varints(values)
    assert len(encoded) == 1 + 1 + 1 + 2 + 2 + 3 + 3 + 4 + 5 + 5
    assert decode_varints(encoded, len(values)).tolist() == values.tolist()
    with pytest.raises(CodecError):
        decode_varints(encoded[:-1], len(values))
    with pytest.raises(CodecError):
        decode_varints(encoded, len(values) + 1)
    with pytest.raises(CodecError):
        decode_varints(b"\x80\x80\x80\x80\x80\x01", 1)


# -- error feedback with every codec -------------------------------------------------------------
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_error_feedback_conserves_mass(spec: str) -> None:
    comp = make_compressor(spec + "+ef")
    shape = (40, 24)
    total_in = torch.zeros(shape, dtype=torch.float64)
    total_out = torch.zeros(shape, dtype=torch.float64)
    for step in range(12):
        g = randn(*shape, seed=step)
        total_in += g.double()
        payload = comp.encode("layer.w", g)
        total_out += comp.decode(payload, torch.Size(shape), torch.float32).double()
    residual = comp.residuals["layer.w"].double()
    assert torch.allclose(total_out + residual, total_in, atol=1e-4)


def test_topk_error_feedback_eventually_sends_everything() -> None:
    comp = make_compressor("topk:0.1+ef")
    target = randn(500)
    sent = torch.zeros(500)
    for step in range(60):
        g = target if step == 0 else torch.zeros(500)
        sent += comp.decode(comp.encode("b", g), torch.Size([500]), torch.float32)
    assert torch.allclose(sent, target, atol=1e-6)
    assert comp.residuals["b"].abs().max().item() < 1e-6


def test_error_feedback_state_dict_roundtrip() -> None:
    comp = make_compressor("int4+ef")
    comp.encode("a", randn(100))
    clone = make_compressor("int4+ef")
    clone.load_state_dict(comp.state_dict())
    x = randn(100, seed=5)
    assert comp.encode("a", x) == clone.encode("a", x)


# -- corrupt payloads --------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_truncated_and_padded_payloads_raise_codec_error(spec: str) -> None:
    codec = make_codec(spec)
    x = randn(33, 70)
    payload = codec.encode(x)
    for bad in (payload[:-1], payload + b"\x00", b"", payload[: len(payload) // 2]):
        with pytest.raises(CodecError):
            codec.decode(bad, x.shape, torch.float32)
    with pytest.raises(CodecError):  # right bytes, wrong announced shape
        codec.decode(payload, torch.Size([66, 140]), torch.float32)


@pytest.mark.parametrize("spec", ["int8", "int4", "int8:64:fp16", "int4:64:fp32"])
def test_nan_inf_negative_scales_rejected(spec: str) -> None:
    codec = make_codec(spec)
    assert isinstance(codec, BlockQuantCodec)
    payload = bytearray(codec.encode(randn(200)))
    width = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}[codec.scale_dtype]
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(codec.scale_dtype)
    for bad_value in (float("nan"), float("inf"), -1.0):
        corrupt = bytearray(payload)
        if np_dtype is None:  # bf16: the upper half of the fp32 pattern
            raw = np.array([bad_value], dtype=np.float32).view(np.uint32) >> 16
            corrupt[width : 2 * width] = raw.astype(np.uint16).tobytes()
        else:
            corrupt[width : 2 * width] = np.array([bad_value], dtype=np_dtype).tobytes()
        with pytest.raises(CodecError, match="scale"):
            codec.decode(bytes(corrupt), torch.Size([200]), torch.float32)


def test_out_of_range_codes_rejected() -> None:
    int8 = make_codec("int8")
    payload = bytearray(int8.encode(randn(64)))
    payload[-1] = 0x80  # -128
    with pytest.raises(CodecError, match="-128"):
        int8.decode(bytes(payload), torch.Size([64]), torch.float32)
    int4 = make_codec("int4")
    payload = bytearray(int4.encode(randn(63)))
    payload[-2] = 0x08  # low nibble 8 (code 0), high nibble 0 (code -8)
    with pytest.raises(CodecError, match="-8"):
        int4.decode(bytes(payload), torch.Size([63]), torch.float32)
    payload = bytearray(int4.encode(randn(63)))
    payload[-1] = (payload[-1] & 0x0F) | 0x90  # padding nibble must be the zero code
    with pytest.raises(CodecError, match="padding"):
        int4.decode(bytes(payload), torch.Size([63]), torch.float32)


def test_topk_corrupt_indices_rejected() -> None:
    codec = TopKCodec(0.1)
    x = randn(1000)
    k = 100
    payload = codec.encode(x)
    as_u16 = bytes([0]) + payload[1 : 1 + 4 * k] + np.arange(k, dtype="<u2").tobytes()
    codec.decode(as_u16, x.shape, torch.float32)  # a valid hand-built uint16 layout
    out_of_range = bytearray(as_u16)
    out_of_range[-2:] = (1000).to_bytes(2, "little")
    with pytest.raises(CodecError, match="out of range"):
        codec.decode(bytes(out_of_range), x.shape, torch.float32)
    unsorted = bytes([0]) + payload[1 : 1 + 4 * k] + np.arange(k, dtype="<u2")[::-1].tobytes()
    with pytest.raises(CodecError, match="increasing"):
        codec.decode(unsorted, x.shape, torch.float32)
    with pytest.raises(CodecError, match="format"):
        codec.decode(bytes([7]) + payload[1:], x.shape, torch.float32)
    varint = bytes([2]) + payload[1 : 1 + 4 * k] + encode_varints(np.array([0] * (k - 1) + [5000]))
    with pytest.raises(CodecError, match="out of range"):
        codec.decode(varint, x.shape, torch.float32)
    nan_values = bytearray(payload)
    nan_values[1:5] = np.array([np.nan], dtype=np.float32).tobytes()
    with pytest.raises(CodecError, match="NaN"):
        codec.decode(bytes(nan_values), x.shape, torch.float32)


@pytest.mark.parametrize("spec", ["int8", "int4", "topk", "dct_topk"])
def test_non_finite_input_refused_by_scale_and_rank_codecs(spec: str) -> None:
    with pytest.raises(CodecError, match="NaN or Inf"):
        make_codec(spec).encode(torch.tensor([1.0, float("nan"), 2.0]))


# -- properties over random shapes ----------------------------------------------------------------
shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(1, 150), min_size=1, max_size=1).map(tuple),
    st.lists(st.integers(1, 40), min_size=2, max_size=3).map(tuple),
)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, spec=st.sampled_from(ALL_SPECS), seed=st.integers(0, 2**16),
       scale=st.floats(1e-6, 1e4))
def test_property_roundtrip_shape_size_and_bound(shape: tuple[int, ...], spec: str, seed: int,
                                                  scale: float) -> None:
    codec = make_codec(spec)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    payload = codec.encode(x)
    y = codec.decode(payload, x.shape, torch.float32)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert bool(torch.isfinite(y).all())
    if spec.startswith("topk"):
        assert len(payload) <= codec.max_payload_nbytes(tuple(shape))
    else:
        assert len(payload) == codec.max_payload_nbytes(tuple(shape))
    absmax = x.abs().max().item()
    if spec in ("none", "fp32"):
        assert torch.equal(y, x)
    elif spec.startswith("int"):
        # every element is off by at most half its block's wire scale, which is absmax / qmax
        # rounded *up* to the scale dtype (coarse for fp16 subnormals, hence not absmax / qmax)
        qmax = 127 if spec.startswith("int8") else 7
        wire_scale = round_up_to(torch.tensor([absmax / qmax]), codec.scale_dtype).float().item()
        assert (y - x).abs().max().item() <= wire_scale * 0.5 + absmax * 2**-22  # + float32 rounding
    elif spec in ("fp16", "bf16"):
        assert (y - x).abs().max().item() <= absmax * 2**-8 + 1e-7
    elif spec.startswith("topk"):
        kept = y != 0
        wire = x[kept].to(torch.float16).float() if "fp16" in spec else x[kept]
        assert torch.equal(y[kept], wire)
    else:  # dct_topk: a projection onto fewer coefficients never adds energy
        assert y.pow(2).sum().item() <= x.pow(2).sum().item() * (1 + 1e-3) + 1e-9
    with pytest.raises(CodecError):
        codec.decode(payload + b"\x01", x.shape, torch.float32)
