"""Per-pair links on loopback: TCP relays that carry each pair's traffic over its emulated link.

Why: islands come from measuring the links between worker slots (:mod:`farlink.comm.linkprobe`),
and on one machine every pair must look like the network being emulated: workers in one group
(an island of racks) joined by ``datacenter`` links, groups joined by ``intercontinental`` ones.
Namespaces (:mod:`farlink.emulate.topology`) give every worker *one* link to a router, which
cannot express per-pair classes; this module can, without root.

This is *in-process emulation* of real TCP streams: bytes really cross loopback sockets, and a
relay between the two ends paces each direction at the link's rate (a token bucket that reads no
further ahead of the wire than ``AHEAD_S``, so the sender feels back-pressure as on a real link)
and holds every chunk for the one-way delay (+ jitter, order kept) before passing it on. Loss is
charged as the expected retransmitted volume, as in :mod:`farlink.emulate.shaper`; TCP's reaction
to loss is not modelled. Python moves a few Gbit/s at most, so very fast profiles measure slower
than they are: still far apart from WAN classes, which is what island formation needs.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from farlink.comm.linkprobe import Address, ProbeServer
from farlink.links import LinkError, LinkProfile, get_profile, profile_names

KIND = "in-process emulation (shaped TCP relays on loopback)"
CHUNK = 1 << 16
AHEAD_S = 0.01  # how far ahead of the wire the relay may read: the link's own queue


@dataclass(frozen=True)
class GroupLinks:
    """The emulated network of a topology: ``intra`` inside a group, ``inter`` between groups."""

    groups: tuple[tuple[int, ...], ...]
    intra: LinkProfile
    inter: LinkProfile

    @classmethod
    def of(cls, groups: Sequence[Sequence[int]], intra: str | LinkProfile,
           inter: str | LinkProfile) -> GroupLinks:
        return cls(tuple(tuple(g) for g in groups), get_profile(intra), get_profile(inter))

    @property
    def size(self) -> int:
        return sum(len(g) for g in self.groups)

    def group_of(self, i: int) -> int:
        for k, g in enumerate(self.groups):
            if i in g:
                return k
        raise ValueError(f"worker {i} is in no group of the topology")

    def profile(self, i: int, j: int) -> LinkProfile:
        return self.intra if self.group_of(i) == self.group_of(j) else self.inter

    def slowest(self, members: Sequence[int]) -> LinkProfile | None:
        """The link a collective among ``members`` is paced by (None for a single member)."""
        members = list(members)
        if len(members) < 2:
            return None
        groups = {self.group_of(i) for i in members}
        return self.inter if len(groups) > 1 else self.intra


def _sleep_until(deadline: float) -> None:
    """Plain sleeps (no spin, unlike the shaper): a relay thread must not burn a core; a wake-up
    late by a scheduler tick shifts one chunk, not the rate (the wire clock is kept separately)."""
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _Pipe:
    """One direction of a relayed connection: ``src`` -> ``dst`` over ``profile``."""

    def __init__(self, src: socket.socket, dst: socket.socket, profile: LinkProfile,
                 rng: random.Random) -> None:
        self.src, self.dst, self.profile, self.rng = src, dst, profile, rng
        rate = profile.up_mbit
        self.bytes_per_s = float("inf") if rate is None else rate * 1e6 / 8
        self.queue: deque[tuple[float, bytes]] = deque()
        self.ready = threading.Condition()
        self.free_at = 0.0
        self.last_delivery = 0.0

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._read, daemon=True),
                   threading.Thread(target=self._write, daemon=True)]
        for t in threads:
            t.start()
        return threads

    def _read(self) -> None:
        p = self.profile
        while True:
            try:
                data = self.src.recv(CHUNK)
            except OSError:
                data = b""
            now = time.perf_counter()
            self.free_at = max(now, self.free_at) + len(data) / (1.0 - p.loss) / self.bytes_per_s
            delay = p.latency_ms + (self.rng.uniform(-p.jitter_ms, p.jitter_ms) if p.jitter_ms else 0)
            deliver = max(self.free_at + max(delay, 0.0) / 1000, self.last_delivery)  # in order
            self.last_delivery = deliver
            with self.ready:
                self.queue.append((deliver, data))
                self.ready.notify()
            if not data:
                return
            if self.free_at - now > AHEAD_S:  # the wire is busy: stop reading (back-pressure)
                _sleep_until(self.free_at - AHEAD_S)

    def _write(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                deliver, data = self.queue.popleft()
            _sleep_until(deliver)
            try:
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
            except OSError:
                return


class ShapedRelay:
    """Listens on loopback; every connection is relayed to ``target``, ``forward`` shaping the
    client -> target direction and ``backward`` the way back."""

    def __init__(self, target: Address, forward: LinkProfile, backward: LinkProfile,
                 host: str = "127.0.0.1", seed: int = 0) -> None:
        self.target, self.forward, self.backward = target, forward, backward
        self._listener = socket.create_server((host, 0))
        self.address: Address = self._listener.getsockname()[:2]
        self._rng = random.Random(seed)
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="shaped-relay").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=30)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
            self._sockets += [client, upstream]
            _Pipe(client, upstream, self.forward, self._rng).start()
            _Pipe(upstream, client, self.backward, self._rng).start()

    def close(self) -> None:
        try:  # wakes the thread blocked in accept(); close() alone leaves the port listening
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass


class PairwiseNetwork:
    """``n`` probe servers on loopback and, per ordered pair, a relay shaped by ``links``.

    ``route(i, j)`` is the address at which peer i reaches peer j's probe server through the
    emulated i <-> j link; pass it to :func:`farlink.comm.linkprobe.measure_links`.
    """

    kind = KIND

    def __init__(self, links: Callable[[int, int], LinkProfile] | GroupLinks, n: int | None = None,
                 host: str = "127.0.0.1") -> None:
        if isinstance(links, GroupLinks):
            n = links.size if n is None else n
            links = links.profile
        if n is None or n < 1:
            raise ValueError("PairwiseNetwork needs the number of peers")
        self.n, self.links, self.host = n, links, host
        self.servers: list[ProbeServer] = []
        self.relays: dict[tuple[int, int], ShapedRelay] = {}

    def start(self) -> PairwiseNetwork:
        self.servers = [ProbeServer(self.host).start() for _ in range(self.n)]
        return self

    def route(self, i: int, j: int) -> Address:
        if (i, j) not in self.relays:
            self.relays[(i, j)] = ShapedRelay(self.servers[j].address, self.links(i, j),
                                              self.links(j, i), self.host, seed=i * self.n + j)
        return self.relays[(i, j)].address

    def close(self) -> None:
        for relay in self.relays.values():
            relay.close()
        for server in self.servers:
            server.close()

    def __enter__(self) -> PairwiseNetwork:  # noqa: PYI034 - not meant to be subclassed
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_LINK_NAMES = ", ".join(profile_names())  # farlink/links.toml


class EmulationOptions(BaseModel):
    """What a run emulates in process: the WAN between its workers (a topology of groups, or
    one link for every collective) and slower devices. ``RunConfig`` composes these fields
    (flat flags, ``[emulation]`` in TOML)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    slowdown: str = Field("", description="emulated device speeds, per-worker slowdown factors "
                          "such as '1,1,2,4' (worker i sleeps (f-1) x its step time)")
    pace_seconds: float | None = Field(
        None, gt=0, description="emulated device speed, paced: every inner step of worker i is "
        "padded to slowdown_i x this many seconds (speeds stay exact while processes share "
        "cores; it must exceed the real step time)")
    topology: str = Field(
        "", description="emulated network: worker groups such as '0,1|2,3'; links inside a "
        "group are --intra-link, between groups --inter-link (in-process emulation on loopback)")
    intra_link: str = Field("datacenter", description=f"link profile inside a topology group "
                            f"({_LINK_NAMES})")
    inter_link: str = Field("intercontinental", description=f"link profile between groups "
                            f"({_LINK_NAMES})")
    emulate_link: str | None = Field(
        None, description=f"in-process WAN emulation: a link profile ({_LINK_NAMES}) delays "
        "every collective by its hop latency + bytes/bandwidth")

    @model_validator(mode="after")
    def _check_emulation(self) -> EmulationOptions:
        """Profiles that exist and slowdown factors that parse (a topology's groups name the
        run's workers: ``RunConfig`` checks them, it knows how many)."""
        if self.emulate_link is not None:
            get_profile(self.emulate_link)  # a LinkError (a ValueError) names the choices
        if self.slowdown:
            try:
                factors = [float(f) for f in self.slowdown.split(",")]
            except ValueError:
                raise ValueError(f"slowdown {self.slowdown!r} is not a comma list of numbers")
            if any(f < 1 for f in factors):
                raise ValueError("slowdown factors must be >= 1 (1 = full speed)")
        for name in ("intra_link", "inter_link"):
            try:
                get_profile(getattr(self, name))
            except LinkError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return self
