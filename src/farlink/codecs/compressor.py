"""A codec plus optional error feedback, keyed by tensor name.

Error feedback keeps, per tensor, what the lossy codec dropped and adds it to the next message, so
compression error is delayed rather than lost (the sum of what was sent plus the residual always
equals the sum of what was meant to be sent).
"""

from __future__ import annotations

import torch

from farlink.codecs.base import Codec


class Compressor:
    def __init__(self, codec: Codec, error_feedback: bool = False) -> None:
        self.codec = codec
        self.error_feedback = error_feedback
        self.residuals: dict[str, torch.Tensor] = {}

    @property
    def spec(self) -> str:
        return self.codec.name + ("+ef" if self.error_feedback else "")

    def encode(self, name: str, tensor: torch.Tensor) -> bytes:
        if not self.error_feedback:
            return self.codec.encode(tensor)
        target = tensor.detach().float()
        if name in self.residuals:  # a resumed residual comes from the checkpoint on the host
            target = target + self.residuals[name].to(target.device)
        payload = self.codec.encode(target)
        sent = self.codec.decode(payload, target.shape, torch.float32, target.device)
        self.residuals[name] = target - sent  # kept where the tensor lives
        return payload

    def decode(self, payload: bytes, shape: torch.Size, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
        return self.codec.decode(payload, shape, dtype, device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"residual.{k}": v for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {
            k.removeprefix("residual."): v.clone() for k, v in state.items()
            if k.startswith("residual.")
        }
