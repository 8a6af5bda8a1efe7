"""Hardware and link tables: editable TOML data, validated before a single number is used.

The tables live in ``farlink/plan/data/`` so a user can read and change them without touching
code, and a user's own file (``--hardware-file`` / ``--links-file``) goes through the same
pydantic models, so a typo or a negative bandwidth is reported with the file, the entry and the
field instead of surfacing later as a nonsensical prediction.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


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


class LinkProfile(BaseModel):
    """What one worker's connection to the others looks like."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = ""
    bandwidth_mbit: float = Field(gt=0)
    bandwidth_min_mbit: float | None = Field(default=None, gt=0)
    download_mbit: float | None = Field(default=None, gt=0)
    latency_ms: float = Field(ge=0)
    jitter_ms: float = Field(default=0.0, ge=0)
    loss: float = Field(default=0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _min_below_max(self) -> LinkProfile:
        if self.bandwidth_min_mbit is not None and self.bandwidth_min_mbit > self.bandwidth_mbit:
            raise ValueError(
                f"bandwidth_min_mbit ({self.bandwidth_min_mbit}) exceeds bandwidth_mbit "
                f"({self.bandwidth_mbit})"
            )
        return self

    @property
    def bandwidth_bps(self) -> float:
        return self.bandwidth_mbit * 1e6

    @property
    def bandwidth_min_bps(self) -> float | None:
        return None if self.bandwidth_min_mbit is None else self.bandwidth_min_mbit * 1e6

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3

    @property
    def jitter_s(self) -> float:
        return self.jitter_ms / 1e3


class _HardwareFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu: dict[str, GPU] = Field(min_length=1)


class _LinksFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    link: dict[str, LinkProfile] = Field(min_length=1)


def _read_toml(path: Path | None, default_name: str) -> tuple[dict, str]:
    if path is None:
        text = resources.files("farlink.plan").joinpath("data", default_name).read_text()
        origin = f"built-in {default_name}"
    else:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise PlanInputError(f"cannot read {path}: {exc.strerror or exc}") from exc
        origin = str(path)
    try:
        return tomllib.loads(text), origin
    except tomllib.TOMLDecodeError as exc:
        raise PlanInputError(f"{origin} is not valid TOML: {exc}") from exc


def _explain(origin: str, exc: ValidationError) -> PlanInputError:
    lines = [f"{origin} has {exc.error_count()} invalid entr{'y' if exc.error_count() == 1 else 'ies'}:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {where}: {err['msg']}")
    return PlanInputError("\n".join(lines))


def load_hardware(path: str | Path | None = None) -> dict[str, GPU]:
    """GPU name -> :class:`GPU`, from ``path`` or the built-in table."""
    raw, origin = _read_toml(None if path is None else Path(path), "hardware.toml")
    try:
        return dict(_HardwareFile.model_validate(raw).gpu)
    except ValidationError as exc:
        raise _explain(origin, exc) from None


def load_links(path: str | Path | None = None) -> dict[str, LinkProfile]:
    """Profile name -> :class:`LinkProfile`, from ``path`` or the built-in table."""
    raw, origin = _read_toml(None if path is None else Path(path), "links.toml")
    try:
        return dict(_LinksFile.model_validate(raw).link)
    except ValidationError as exc:
        raise _explain(origin, exc) from None


def lookup(table: dict, name: str, kind: str):
    """``table[name]`` with an error that lists what exists instead of a bare KeyError."""
    key = name.strip().lower()
    if key not in table:
        raise PlanInputError(f"unknown {kind} {name!r}; choose from {', '.join(sorted(table))}")
    return table[key]
