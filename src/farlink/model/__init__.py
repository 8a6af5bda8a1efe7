"""The model every island trains: a GPT-style decoder and its analytically sized presets."""

from farlink.model.config import PRESETS, GPTConfig, preset_config, swiglu_hidden
from farlink.model.gpt import GPT
from farlink.model.rotary import apply_rotary, rotary_tables

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "apply_rotary",
    "preset_config",
    "rotary_tables",
    "swiglu_hidden",
]
