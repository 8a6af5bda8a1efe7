"""The model every island trains: a GPT-style decoder (a Llama), its analytically sized presets,
and ``build_model``, which also accepts a local Hugging Face model directory (``hf:DIR``).

The presets and shapes import without torch (the CLI lists them in ``--help`` and the planner
sizes them); the modules are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from farlink.model.config import PRESETS, GPTConfig, preset_config, swiglu_hidden

_LAZY = {
    "GPT": "farlink.model.gpt",
    "apply_rotary": "farlink.model.rotary",
    "rotary_tables": "farlink.model.rotary",
    "build_model": "farlink.model.build",
    "load_run_model": "farlink.model.build",
}

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "apply_rotary",
    "build_model",
    "load_run_model",
    "preset_config",
    "rotary_tables",
    "swiglu_hidden",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'farlink.model' has no attribute {name!r}")
