"""Hostile bytes must never crash the receive path: only CodecError / AuthError may come out.

Covers ``envelope.unpack``, every codec registered in ``farlink.codecs.CODECS`` (whatever is
registered when the tests are collected) and the authenticators.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from farlink.codecs import CODECS, CodecError
from farlink.codecs.envelope import MAGIC, Envelope, pack, unpack
from farlink.robust.auth import AuthError, Ed25519Auth, SharedSecretAuth
from farlink.robust.keys import key_id

torch.set_num_threads(1)

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ALLOWED = (CodecError, AuthError)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _only_allowed(fn, *args):
    """Run ``fn``; return its result, or None if it raised an allowed error; fail otherwise."""
    try:
        return fn(*args)
    except ALLOWED:
        return None
    except Exception as exc:  # noqa: BLE001 - the point is to see any other type
        pytest.fail(f"{fn.__qualname__} raised {type(exc).__name__}: {exc!r:.200}")


def _mutate(data: bytes, draw) -> bytes:
    """Truncate, flip bits, splice junk or append bytes: the faults a link or a liar produces."""
    kind = draw(st.sampled_from(["truncate", "flip", "splice", "append"]))
    if kind == "truncate" or not data:
        return data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    if kind == "flip":
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(buf)
    if kind == "splice":
        i = draw(st.integers(0, len(data)))
        junk = draw(st.binary(min_size=1, max_size=16))
        return data[:i] + junk + data[i + len(junk):]
    return data + draw(st.binary(min_size=1, max_size=16))


tensors = st.builds(
    lambda shape, dtype, seed: (torch.randn(shape, generator=torch.Generator().manual_seed(seed))
                                * 3).to(dtype),
    # at least one element: encoding empty tensors is checked on its own below
    st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple),
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),
)


def _envelope(tensor_list) -> bytes:
    payloads = {f"t{i}": t.float().numpy().tobytes() for i, t in enumerate(tensor_list)}
    shapes = {f"t{i}": tuple(t.shape) for i, t in enumerate(tensor_list)}
    dtypes = {f"t{i}": t.dtype for i, t in enumerate(tensor_list)}
    return pack("peer-a", 7, 1234.0, payloads, shapes, dtypes, {"k": [1, 2]})


# --- envelope ---------------------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=512))
def test_unpack_random_bytes(data):
    _only_allowed(unpack, data)
    _only_allowed(unpack, MAGIC + data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20,
)
header_fields = st.fixed_dictionaries(
    {}, optional={"sender": json_values, "round": json_values, "weight": json_values,
                  "meta": json_values,
                  "tensors": st.lists(st.fixed_dictionaries({}, optional={
                      "name": json_values, "shape": json_values, "dtype": json_values |
                      st.sampled_from(["float32", "float16", "bfloat16"]),
                      "nbytes": json_values | st.integers(0, 64)}), max_size=3) | json_values})


@settings(FUZZ, max_examples=80)
@given(header_fields, st.binary(max_size=128))
def test_unpack_structured_junk_headers(header, tail):
    raw = json.dumps(header).encode()  # may hold NaN / Infinity: Python's json writes them
    env = _only_allowed(unpack, MAGIC + struct.pack("<I", len(raw)) + raw + tail)
    if env is not None:
        assert isinstance(env, Envelope) and env.weight >= 0
        assert sum(len(p) for p in env.payloads.values()) == len(tail)
        assert all(env.dtypes[n] in DTYPES for n in env.payloads)


@FUZZ
@given(st.lists(tensors, min_size=1, max_size=3), st.data())
def test_unpack_mutated_envelopes(tensor_list, data):
    good = _envelope(tensor_list)
    assert unpack(good).round_id == 7
    bad = _mutate(good, data.draw)
    env = _only_allowed(unpack, bad)
    if env is not None:  # a flip inside a payload still parses; the layout must add up
        (hlen,) = struct.unpack_from("<I", bad, 4)
        assert 8 + hlen + sum(len(p) for p in env.payloads.values()) == len(bad)


def test_unpack_known_hostile_headers():
    def msg(h: str) -> bytes:
        return MAGIC + struct.pack("<I", len(h)) + h.encode()
    def table(*shapes: str) -> str:
        entries = [f'{{"name":"x","shape":{sh},"dtype":"float32","nbytes":0}}' for sh in shapes]
        return '{"sender":"a","round":1,"weight":1,"tensors":[' + ",".join(entries) + "]}"

    hostile = [
        "[" * 100_000,  # deep nesting: RecursionError in json
        '{"sender":"a","round":Infinity,"weight":1,"tensors":[]}',
        '{"sender":"a","round":1,"weight":1' + "0" * 400 + ',"tensors":[]}',  # int -> float
        table("[Infinity]"),
        table("[1e12,1e12]"),
        table("[1099511627776,4]"),  # 2**42 elements: over the numel limit
        '{"sender":"a","round":1,"weight":1,"tensors":[],"meta":5}',
        '{"sender":"a","round":1.5,"weight":1,"tensors":[]}',
        '{"sender":["a"],"round":1,"weight":1,"tensors":[]}',
        table("[0]", "[0]"),  # the same name twice
    ]
    for h in hostile:
        with pytest.raises(CodecError):
            unpack(msg(h))


# --- codecs -----------------------------------------------------------------------------------

CODEC_NAMES = sorted(CODECS)


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@FUZZ
@given(tensor=tensors, data=st.data())
def test_codec_decode_survives_mutation(codec_name, tensor, data):
    codec = CODECS[codec_name](None)
    payload = codec.encode(tensor)
    out = codec.decode(payload, tensor.shape, tensor.dtype)
    assert out.shape == tensor.shape and out.dtype == tensor.dtype
    bad = _mutate(payload, data.draw)
    out = _only_allowed(codec.decode, bad, tensor.shape, tensor.dtype)
    if out is not None:
        assert isinstance(out, torch.Tensor)
        assert out.shape == tensor.shape and out.dtype == tensor.dtype


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
def test_codec_roundtrips_empty_tensors(codec_name, shape):
    codec = CODECS[codec_name](None)
    payload = codec.encode(torch.zeros(shape))
    out = codec.decode(payload, torch.Size(shape), torch.float32)
    assert out.shape == shape
    _only_allowed(codec.decode, payload + b"\x00", torch.Size(shape), torch.float32)


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@FUZZ
@given(payload=st.binary(max_size=300),
       shape=st.lists(st.integers(0, 12), max_size=3).map(tuple),
       dtype=st.sampled_from(DTYPES))
def test_codec_decode_random_bytes(codec_name, payload, shape, dtype):
    out = _only_allowed(CODECS[codec_name](None).decode, payload, torch.Size(shape), dtype)
    if out is not None:
        assert out.shape == shape and out.dtype == dtype


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@FUZZ
@given(tensor=tensors, shape=st.lists(st.integers(0, 12), max_size=3).map(tuple))
def test_codec_decode_with_the_wrong_shape(codec_name, tensor, shape):
    codec = CODECS[codec_name](None)
    out = _only_allowed(codec.decode, codec.encode(tensor), torch.Size(shape), tensor.dtype)
    if out is not None:
        assert out.shape == shape


# --- authenticators ---------------------------------------------------------------------------

_KEY = Ed25519PrivateKey.generate()
AUTHS = {
    "secret": SharedSecretAuth("run-secret"),
    "ed25519": Ed25519Auth({key_id(_KEY.public_key()): _KEY.public_key()}, _KEY),
}


@pytest.mark.parametrize("kind", sorted(AUTHS))
@FUZZ
@given(body=st.binary(max_size=200), data=st.data())
def test_any_change_to_a_signed_message_is_refused(kind, body, data):
    auth = AUTHS[kind]
    signed = auth.sign(body)
    assert auth.verify(signed) == body
    bad = _mutate(signed, data.draw)
    if bad != signed:
        with pytest.raises(AuthError):
            auth.verify(bad)
    _only_allowed(auth.verify, data.draw(st.binary(max_size=200)))


@pytest.mark.parametrize("kind", sorted(AUTHS))
@FUZZ
@given(proof=st.binary(max_size=120))
def test_random_membership_proofs_are_refused(kind, proof):
    auth = AUTHS[kind]
    with pytest.raises(AuthError):
        auth.check_proof(auth.make_challenge(), proof)
