"""Named wide-area link profiles, shared by the namespace emulator and the in-process shaper.

A profile describes the *path between two workers that both sit on it*: ``delay_ms`` is the
one-way delay of that path (RTT = 2 x delay), ``bandwidth_mbit`` is what one worker can send
(its upload), ``down_mbit`` what it can receive (defaults to the upload rate). When two workers on
different profiles talk, each contributes half of its path delay (and half of its loss, in the
sense that the survival probabilities multiply to the profile's on a homogeneous pair), so a
``home`` worker and a ``datacenter`` worker see (60 + 0.5) / 2 ms one way.

The figures match ``plan/data/links.toml`` except ``home``'s downlink (200 Mbit/s here rather
than 500): the user-space delayer that adds latency tops out near 300 Mbit/s per receiver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class EmulationError(RuntimeError):
    """Something the emulator was asked to do cannot be done (bad input or a failed command)."""


@dataclass(frozen=True)
class LinkProfile:
    """One worker's link: rates in Mbit/s, one-way path delay and jitter in ms, loss in [0, 1)."""

    bandwidth_mbit: float | None  # upload; None = unshaped
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    down_mbit: float | None = None  # download; None = same as bandwidth_mbit
    name: str = "custom"

    def __post_init__(self) -> None:
        for label, rate in (("bandwidth_mbit", self.bandwidth_mbit), ("down_mbit", self.down_mbit)):
            if rate is not None and not (math.isfinite(rate) and rate > 0):
                raise EmulationError(f"{label} must be a positive finite number, got {rate!r}")
        if not (math.isfinite(self.delay_ms) and self.delay_ms >= 0):
            raise EmulationError(f"delay_ms must be >= 0, got {self.delay_ms!r}")
        if not (math.isfinite(self.jitter_ms) and 0 <= self.jitter_ms <= self.delay_ms + 1e-12):
            raise EmulationError(
                f"jitter_ms must be between 0 and delay_ms ({self.delay_ms}), got {self.jitter_ms!r}"
            )
        if not (0.0 <= self.loss < 1.0):
            raise EmulationError(f"loss must be in [0, 1), got {self.loss!r}")

    @property
    def up_mbit(self) -> float | None:
        return self.bandwidth_mbit

    @property
    def download_mbit(self) -> float | None:
        return self.down_mbit if self.down_mbit is not None else self.bandwidth_mbit

    @property
    def rtt_ms(self) -> float:
        return 2.0 * self.delay_ms

    @property
    def delays_packets(self) -> bool:
        """Whether the namespace emulator needs a delayer (NFQUEUE) for this link."""
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss > 0


PROFILES: dict[str, LinkProfile] = {
    "datacenter": LinkProfile(10_000, 0.5, name="datacenter"),
    "cross-region": LinkProfile(1_000, 40.0, name="cross-region"),
    "intercontinental": LinkProfile(200, 120.0, name="intercontinental"),
    "home": LinkProfile(50, 60.0, down_mbit=200, name="home"),
    "loopback": LinkProfile(None, 0.0, name="loopback"),
}


def get_profile(profile: str | LinkProfile) -> LinkProfile:
    """A profile by name (case-insensitive), or the given one unchanged."""
    if isinstance(profile, LinkProfile):
        return profile
    key = str(profile).strip().lower()
    if key not in PROFILES:
        raise EmulationError(
            f"unknown link profile {profile!r}; choose from {', '.join(sorted(PROFILES))}"
        )
    return PROFILES[key]


def scaled(profile: str | LinkProfile, bandwidth_mbit: float) -> LinkProfile:
    """The profile's delay/jitter/loss at a different rate (keeps the up/down ratio), so tests
    can check a WAN's latency shape without pushing gigabits through one small machine."""
    base = get_profile(profile)
    if base.bandwidth_mbit is None:
        raise EmulationError(f"profile {base.name!r} is unshaped; nothing to scale")
    ratio = bandwidth_mbit / base.bandwidth_mbit
    down = None if base.down_mbit is None else base.down_mbit * ratio
    return LinkProfile(bandwidth_mbit, base.delay_ms, base.jitter_ms, base.loss, down,
                       name=f"{base.name}@{bandwidth_mbit:g}mbit")


def path_delay_ms(a: LinkProfile, b: LinkProfile) -> float:
    """One-way delay between a worker on ``a`` and one on ``b``."""
    return (a.delay_ms + b.delay_ms) / 2.0


def path_loss(a: LinkProfile | None, b: LinkProfile) -> float:
    """Loss of the path; ``a`` None = the router's own address (only ``b``'s half counts)."""
    survive = (1.0 - b.loss) if a is None else (1.0 - a.loss) * (1.0 - b.loss)
    return 1.0 - math.sqrt(survive)
