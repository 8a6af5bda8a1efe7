"""The codec interface: how a dense tensor becomes real bytes on the wire and back.

Codecs are pure functions of their input (plus, for error feedback, a residual the caller keeps),
so any algorithm that sends dense tensors can compose with any codec, and the byte count an
algorithm reports is simply ``len(payload)`` of what it handed to the collective.

A codec computes on the device of the tensor it is given (a GPU's pseudo-gradient is quantized,
sparsified or transformed on that GPU); only the wire bytes, and the small tensors they are made
of, move to host memory. ``decode`` parses the bytes on the host and rebuilds the tensor on the
``device`` it is asked for (the CPU by default).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class CodecError(ValueError):
    """A payload could not be decoded (truncated, corrupt, wrong shape or dtype)."""


class Codec(ABC):
    """Turns a float tensor into bytes and back; lossy codecs may return an approximation."""

    name: str = "abstract"

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> bytes:
        """Serialize ``tensor`` (any shape, floating point) to a self-describing payload."""

    @abstractmethod
    def decode(self, payload: bytes, shape: torch.Size, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Rebuild a tensor of ``shape``/``dtype`` on ``device`` (None: the CPU); raise
        :class:`CodecError` on a bad payload."""

    def roundtrip(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """What the receiver will see, and how many bytes it cost: used by error feedback."""
        payload = self.encode(tensor)
        return self.decode(payload, tensor.shape, tensor.dtype, tensor.device), len(payload)

    def max_payload_nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a tensor of ``shape`` costs on the wire, for planning without encoding.

        Exact for every codec whose size depends only on the shape; an upper bound for codecs
        that pick the smaller of several layouts per message (``topk``).
        """
        raise NotImplementedError(f"{type(self).__name__} does not predict its payload size")
