"""Small helpers shared by the codecs: shapes, dtypes and argument parsing.

Kept in one place so every codec parses its ``NAME:ARG`` spec and validates its input the same
way, and a bad spec or payload always surfaces as a ``ValueError``/``CodecError`` with a message.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
import torch

from farlink.codecs.base import CodecError

if sys.byteorder != "little":  # payloads are numpy's native bytes, documented little-endian
    raise ImportError("farlink codecs require a little-endian host")

# Wire dtypes a codec may use for its floats (scales or values), keyed by their spec spelling.
WIRE_FLOATS: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}
_FLOAT_NAMES = {v: k for k, v in WIRE_FLOATS.items()}
_FP16_MAX = float(torch.finfo(torch.float16).max)


def numel_of(shape: Sequence[int]) -> int:
    """Element count of ``shape``; a 0-d shape holds one element."""
    if any(int(s) < 0 for s in shape):
        raise CodecError(f"negative dimension in shape {tuple(shape)}")
    return math.prod(int(s) for s in shape)


def as_flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous, 1-D float32 view/copy on the tensor's own device: the form every
    encoder works on (encoding runs where the tensor lives; only the bytes go to the host)."""
    if not tensor.is_floating_point():
        raise CodecError(f"codecs encode floating point tensors, got {tensor.dtype}")
    return tensor.detach().to(dtype=torch.float32).reshape(-1).contiguous()


def all_finite(values: torch.Tensor) -> bool:
    """True when no element is NaN or Inf (``amax`` propagates NaN and is far cheaper than
    ``isfinite(...).all()`` on large tensors)."""
    return values.numel() == 0 or bool(torch.isfinite(values.abs().amax()))


def require_finite(flat: torch.Tensor, codec: str) -> None:
    """Scale- and rank-based codecs are undefined on NaN/Inf; refuse rather than send garbage."""
    if not all_finite(flat):
        raise CodecError(f"{codec}: cannot encode a tensor with NaN or Inf values")


def float_name(dtype: torch.dtype) -> str:
    return _FLOAT_NAMES[dtype]


def parse_wire_float(text: str, what: str) -> torch.dtype:
    if text not in WIRE_FLOATS:
        raise ValueError(f"{what} must be one of {', '.join(WIRE_FLOATS)}, got {text!r}")
    return WIRE_FLOATS[text]


def split_args(arg: str | None, n_max: int, codec: str) -> list[str]:
    """``"64:fp16"`` -> ``["64", "fp16"]``; more than ``n_max`` parts is a spec error."""
    parts = [] if not arg else [p.strip() for p in arg.split(":")]
    if len(parts) > n_max:
        raise ValueError(f"{codec} takes at most {n_max} ':'-separated arguments, got {arg!r}")
    return parts


def parse_positive_int(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")
    return value


def to_wire(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast float32 ``values`` to a wire dtype, saturating finite values at the fp16 limit.

    fp16 would otherwise turn a large but finite value into Inf, which every decoder rejects;
    saturating keeps the message valid and error feedback carries the clipped excess.
    """
    if dtype == torch.float16:
        clamped = values.clamp(-_FP16_MAX, _FP16_MAX)
        if not all_finite(values):
            clamped = torch.where(torch.isinf(values), values, clamped)
        values = clamped
    return values.to(dtype)


def wire_bytes(values: torch.Tensor) -> bytes:
    """Little-endian bytes of a 16/32-bit float tensor on any device (bf16 goes through an int16
    view); the values are copied to host memory here, already in their wire dtype."""
    values = values.detach().contiguous().cpu()
    if values.dtype == torch.bfloat16:
        return values.view(torch.int16).numpy().tobytes()
    return values.numpy().tobytes()


def wire_floats(buffer: bytes | memoryview, dtype: torch.dtype, count: int) -> torch.Tensor:
    """Parse ``count`` floats of wire dtype ``dtype`` from ``buffer`` into float32 (host)."""
    if dtype == torch.bfloat16:
        raw = np.frombuffer(buffer, dtype=np.int16, count=count).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).float()
    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    raw = np.frombuffer(buffer, dtype=np_dtype, count=count).copy()
    return torch.from_numpy(raw).float()


def top_indices(magnitude: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` largest entries along the last axis, sorted ascending.

    ``np.argpartition`` (introselect) is about ten times faster than ``torch.topk`` on CPU for
    the sizes codecs see; ties are broken arbitrarily but deterministically.
    """
    n = magnitude.shape[-1]
    picked = np.argpartition(magnitude, n - k, axis=-1)[..., n - k :]
    return np.sort(picked, axis=-1)


def top_positions(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_indices` of a tensor, as int64 on the tensor's device: numpy's introselect
    on the CPU, ``torch.topk`` on an accelerator (ties may be broken differently there; every
    receiver decodes whichever positions the sender picked)."""
    if magnitude.device.type == "cpu":
        return torch.from_numpy(top_indices(magnitude.numpy(), k))
    return torch.topk(magnitude, k, dim=-1, sorted=False).indices.sort(dim=-1).values


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
