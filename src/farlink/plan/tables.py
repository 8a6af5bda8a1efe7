"""The hardware table (``data/hardware.toml``): editable TOML, validated before a single number
is used; a user's own file (``--hardware-file``) goes through the same model. Links come from
the project's one link table, :mod:`farlink.links`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from farlink.tomlfile import load_table


class PlanInputError(ValueError):
    """A table, a scenario or a command-line value the planner cannot use (message says why)."""


class GPU(BaseModel):
    """One accelerator type; prices are per device and hour."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = ""
    bf16_tflops: float = Field(gt=0)
    memory_gib: float = Field(gt=0)
    on_demand_usd_per_hour: float = Field(ge=0)
    spot_usd_per_hour: float = Field(ge=0)
    default_per_worker: int = Field(default=1, ge=1)

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12


class _HardwareFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu: dict[str, GPU] = Field(min_length=1)


def load_hardware(path: str | Path | None = None) -> dict[str, GPU]:
    """GPU name -> :class:`GPU`, from ``path`` or the built-in table."""
    table = load_table(_HardwareFile, path, "farlink.plan", "data/hardware.toml", PlanInputError)
    return dict(table.gpu)


def lookup(table: dict, name: str, kind: str):
    """``table[name]`` with an error that lists what exists instead of a bare KeyError."""
    key = name.strip().lower()
    if key not in table:
        raise PlanInputError(f"unknown {kind} {name!r}; choose from {', '.join(sorted(table))}")
    return table[key]
