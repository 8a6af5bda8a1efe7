"""``--model``: a farlink preset name or a parameter count such as ``10B``, ``1.3b``, ``125M``.

Preset names win (case-insensitively), because a preset's count is exact where ``10B`` is a round
number: ``10b`` is INTELLECT-1's shape with farlink's tied embedding (about 10.7e9 parameters).
A count that is not a preset is parsed numerically. The preset table lives in
``farlink.model.config``; importing it pulls in torch through ``farlink.model``, so it is imported
only when a name that could be a preset is asked for.
"""

from __future__ import annotations

import re

from farlink.plan.tables import PlanInputError

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


def _presets() -> dict[str, int]:
    try:
        from farlink.model.config import PRESETS
    except ImportError:  # model package absent in a stripped build: numbers still work
        return {}
    return {name.lower(): cfg.num_parameters() for name, cfg in PRESETS.items()}


def parse_model_size(text: str | float) -> tuple[float, str]:
    """(parameter count, how it was read) for a preset name or a count; bad input raises."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise PlanInputError(f"model size must be positive, got {text}")
        return float(text), f"{float(text):.4g} parameters"
    key = str(text).strip().lower()
    presets = _presets()
    if key in presets:
        return float(presets[key]), f"preset {key} ({presets[key] / 1e9:.3g}B parameters)"
    match = _NUMBER.match(key)
    if not match:
        names = ", ".join(sorted(presets)) or "(farlink.model not available)"
        raise PlanInputError(
            f"cannot read model size {text!r}: give a count like 10B, 1.3b, 125M, 7e9 "
            f"or a preset ({names})"
        )
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if value < 1:
        raise PlanInputError(f"model size must be at least one parameter, got {text!r}")
    return value, f"{value / 1e9:.4g}B parameters"
