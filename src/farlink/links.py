"""Named network links: the one table the planner prices, the emulators shape and runs check.

``farlink plan --profile home``, ``farlink train --emulate-link home`` (in-process: every
collective held for its bytes and latency), ``--topology ... --inter-link home`` (per-pair TCP
relays) and :class:`farlink.emulate.Topology` (network namespaces, tc and a packet delayer) all
read the same :class:`LinkProfile` object from ``links.toml``, so what is emulated is what is
priced. The figures and why they were chosen are in that file; ``--links-file`` (planner) reads
a user's own table through the same model.

Per path, not per worker: ``latency_ms`` is the one-way delay between two workers that *both*
sit on the profile, which is one hop of a ring all-reduce (the planner charges it per hop) and
half the round trip a ping between them measures. When workers on different profiles talk, each
side contributes half of its own (its access link): :func:`path_latency_ms` and
:func:`path_loss`, which the emulators use; on a homogeneous pair they give the profile's own
figures back. ``bandwidth_mbit`` is what one worker sends (its upload), ``download_mbit`` what
it receives. ``jitter_ms``: each packet's delay is drawn from latency +- jitter by the per-packet
emulators; a collective step waits for its latest packet, so the planner and the in-process
model charge :attr:`LinkProfile.hop_latency_ms` = latency + jitter per hop.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from farlink.tomlfile import load_table


class LinkError(ValueError):
    """A link profile or link table that cannot be used (the message says why and what to do)."""


class LinkProfile(BaseModel):
    """One worker's link to the others (see the module docstring for per-path semantics)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("custom", description="the table's key for this profile")
    description: str = ""
    bandwidth_mbit: float = Field(gt=0, allow_inf_nan=False,
                                  description="what one worker sends per second (its upload)")
    bandwidth_min_mbit: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="planner: each link's rate is drawn "
        "log-uniformly between this and bandwidth_mbit; a collective runs at its slowest link")
    download_mbit: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="what one worker receives (default: the "
        "upload rate)")
    latency_ms: float = Field(0.0, ge=0, allow_inf_nan=False, description="one-way delay "
                              "between two workers on this profile: one hop of a ring")
    jitter_ms: float = Field(0.0, ge=0, allow_inf_nan=False,
                             description="each packet's delay varies by up to +- this")
    loss: float = Field(0.0, ge=0, lt=1, description="packet-loss probability of the path")
    shared: bool = Field(False, description="every worker's traffic crosses this one link (a "
                         "shared bottleneck: one cell, hub or congested uplink): the workers "
                         "share its rate instead of each having it")
    shaped: bool = Field(True, description="false: the host's own link (loopback), priced at "
                         "the given figures and left alone by the emulators")

    @model_validator(mode="after")
    def _consistent(self) -> LinkProfile:
        if self.bandwidth_min_mbit is not None and self.bandwidth_min_mbit > self.bandwidth_mbit:
            raise ValueError(f"bandwidth_min_mbit ({self.bandwidth_min_mbit}) exceeds "
                             f"bandwidth_mbit ({self.bandwidth_mbit})")
        if self.jitter_ms > self.latency_ms:
            raise ValueError(f"jitter_ms ({self.jitter_ms}) exceeds latency_ms "
                             f"({self.latency_ms}): a packet cannot arrive before it is sent")
        return self

    # --- what the planner prices ---------------------------------------------------------------
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

    @property
    def hop_latency_ms(self) -> float:
        """What one hop of a collective waits: the delay of its latest packet."""
        return self.latency_ms + self.jitter_ms

    @property
    def rtt_ms(self) -> float:
        return 2.0 * self.latency_ms

    # --- what the emulators shape ----------------------------------------------------------------
    @property
    def up_mbit(self) -> float | None:
        """The rate an emulator holds the upload to; None: not shaped."""
        return self.bandwidth_mbit if self.shaped else None

    @property
    def down_mbit(self) -> float | None:
        """The rate an emulator holds the download to (the upload's unless given); None: not
        shaped."""
        if not self.shaped:
            return None
        return self.download_mbit if self.download_mbit is not None else self.bandwidth_mbit

    @property
    def delays_packets(self) -> bool:
        """Whether the namespace emulator needs a delayer (NFQUEUE) for this link."""
        return self.shaped and (self.latency_ms > 0 or self.jitter_ms > 0 or self.loss > 0)


class _LinksFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    link: dict[str, LinkProfile] = Field(min_length=1)


def load_links(path: str | Path | None = None) -> dict[str, LinkProfile]:
    """Profile name (lower case) -> :class:`LinkProfile`, from ``path`` or the built-in table
    (read once, so every user of a built-in name holds the same object)."""
    if path is None:
        return dict(_builtin())
    return _read(Path(path))


@cache
def _builtin() -> dict[str, LinkProfile]:
    return _read(None)


def _read(path: Path | None) -> dict[str, LinkProfile]:
    table = load_table(_LinksFile, path, "farlink", "links.toml", LinkError)
    return {key.lower(): p.model_copy(update={"name": key.lower()})
            for key, p in table.link.items()}


def get_profile(profile: str | LinkProfile) -> LinkProfile:
    """A built-in profile by name (case-insensitive), or the given one unchanged."""
    if isinstance(profile, LinkProfile):
        return profile
    table = _builtin()
    key = str(profile).strip().lower()
    if key not in table:
        raise LinkError(f"unknown link profile {profile!r}; choose from {', '.join(table)}")
    return table[key]


def profile_names() -> list[str]:
    """The built-in profiles' names, for help texts and error messages."""
    return list(_builtin())


def scaled(profile: str | LinkProfile, bandwidth_mbit: float) -> LinkProfile:
    """The profile's delay/jitter/loss at a different rate (keeps the up/down ratio), so tests
    can check a WAN's latency shape without pushing gigabits through one small machine."""
    base = get_profile(profile)
    if not base.shaped:
        raise LinkError(f"profile {base.name!r} is not shaped; nothing to scale")
    ratio = bandwidth_mbit / base.bandwidth_mbit
    update = {"bandwidth_mbit": bandwidth_mbit, "name": f"{base.name}@{bandwidth_mbit:g}mbit"}
    for key in ("download_mbit", "bandwidth_min_mbit"):
        if getattr(base, key) is not None:
            update[key] = getattr(base, key) * ratio
    return LinkProfile.model_validate({**base.model_dump(), **update})


def path_latency_ms(a: LinkProfile, b: LinkProfile) -> float:
    """One-way delay between a worker on ``a`` and one on ``b`` (each adds half of its own)."""
    return (a.latency_ms + b.latency_ms) / 2.0


def path_loss(a: LinkProfile | None, b: LinkProfile) -> float:
    """Loss of the path; ``a`` None = the router's own address (only ``b``'s half counts). The
    halves' survival probabilities multiply to the profile's own on a homogeneous pair."""
    survive = (1.0 - b.loss) if a is None else (1.0 - a.loss) * (1.0 - b.loss)
    return 1.0 - math.sqrt(survive)


def with_latency(profile: str | LinkProfile, latency_ms: float) -> LinkProfile:
    """The profile's rates at another one-way delay (jitter capped at the delay), so peers on
    one kind of link can each sit at their own distance, as volunteers' homes do."""
    base = get_profile(profile)
    return base.model_copy(update={"latency_ms": latency_ms,
                                   "jitter_ms": min(base.jitter_ms, latency_ms),
                                   "name": f"{base.name}@{latency_ms:.0f}ms"})


def latency_spread(profile: str | LinkProfile, n: int, low_ms: float, high_ms: float
                   ) -> list[LinkProfile]:
    """``n`` copies of the profile whose delays are spaced evenly from ``low_ms`` to
    ``high_ms``; since a path's delay is the mean of its ends' (:func:`path_latency_ms`), every
    path between them lies in that range too."""
    if n < 1 or not 0 <= low_ms <= high_ms:
        raise LinkError(f"latency_spread needs n >= 1 and 0 <= low_ms <= high_ms, got n={n}, "
                        f"{low_ms}..{high_ms} ms")
    step = (high_ms - low_ms) / (n - 1) if n > 1 else 0.0
    return [with_latency(profile, low_ms + k * step) for k in range(n)]
