"""In-process link emulation: a shared token bucket plus latency, for fast tests and as the
fallback where network namespaces are not allowed (not root, no CAP_NET_ADMIN).

This is *in-process emulation*: no packet crosses a shaped link; the caller is held for as long
as its bytes would take. ``send(nbytes)`` reserves the link for ``nbytes / bandwidth`` after
whatever is already queued on it (so concurrent senders share the rate, as on one wire), then
waits until the last byte would arrive: ``hops x (delay +- jitter)`` later. Loss is charged as
the expected retransmitted volume (``nbytes / (1 - loss)``); TCP's reaction to loss is not
modelled. Sleeping is accurate to well under a millisecond (coarse sleep, then a short spin).

:class:`ShapedCollective` wraps any :class:`~farlink.comm.base.Collective` and charges each
collective's bytes (from the backend's own exact accounting) to a :class:`ShapedLink`.
"""

from __future__ import annotations

import random
import threading
import time

import torch

from farlink.comm.base import Collective, RoundInfo
from farlink.links import LinkProfile, get_profile

KIND = "in-process emulation"
SPIN_S = 0.002


def sleep_until(deadline: float, clock=time.perf_counter) -> None:
    """Block until ``clock() >= deadline``: ``time.sleep`` overshoots by up to a scheduler tick,
    so sleep short and spin for the last couple of milliseconds."""
    while True:
        left = deadline - clock()
        if left <= 0:
            return
        if left > SPIN_S:
            time.sleep(left - SPIN_S)
        else:
            time.sleep(0)


class ShapedLink:
    """One worker's emulated uplink (``direction="down"`` for its downlink)."""

    kind = KIND

    def __init__(self, profile: str | LinkProfile, *, direction: str = "up",
                 seed: int | None = None) -> None:
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        self.profile = get_profile(profile)
        rate = self.profile.up_mbit if direction == "up" else self.profile.down_mbit
        self.bytes_per_s = float("inf") if rate is None else rate * 1e6 / 8
        self._free_at = 0.0  # when the wire finishes what is already reserved on it
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    def transfer_time(self, nbytes: int, hops: int = 1) -> float:
        """Seconds ``nbytes`` take on an idle link over ``hops`` one-way delays (no jitter)."""
        _check(nbytes, hops)
        p = self.profile
        return hops * p.latency_ms / 1000 + nbytes / (1.0 - p.loss) / self.bytes_per_s

    def send(self, nbytes: int, hops: int = 1) -> float:
        """Hold the caller until ``nbytes`` would have arrived; returns the seconds held."""
        _check(nbytes, hops)
        p = self.profile
        start = time.perf_counter()
        with self._lock:
            wire_start = max(start, self._free_at)
            self._free_at = wire_start + nbytes / (1.0 - p.loss) / self.bytes_per_s
            latency = sum(
                max(0.0, p.latency_ms + self._rng.uniform(-p.jitter_ms, p.jitter_ms))
                for _ in range(hops)
            ) / 1000 if p.jitter_ms else hops * p.latency_ms / 1000
            arrival = self._free_at + latency
        sleep_until(arrival)
        return time.perf_counter() - start


def _check(nbytes: int, hops: int) -> None:
    if nbytes < 0 or hops < 0:
        raise ValueError(f"nbytes and hops must be >= 0, got {nbytes}, {hops}")


class ShapedCollective(Collective):
    """A collective whose every transfer is also held on an emulated link.

    Hops follow the ring algorithms the backends account for: ``2 (n-1)`` latencies per
    all-reduce call (its tensors are treated as one bucket), ``n-1`` per all-gather.
    """

    kind = KIND

    def __init__(self, inner: Collective, link: ShapedLink) -> None:
        super().__init__()
        self.inner, self.link = inner, link
        self.stats = inner.stats  # one set of totals: the backend's exact bytes
        self._world = 1

    @property
    def quorum_timeout(self) -> float:
        return self.inner.quorum_timeout


    def load_committed_step(self, step: int) -> None:
        self.inner.load_committed_step(step)

    def begin_round(self, final: bool = False, *, joining: bool = False,
                    timeout: float | None = None, tag: str | None = None) -> RoundInfo:
        info = self.inner.begin_round(final, joining=joining, timeout=timeout, tag=tag)
        self._world = info.world_size
        return info

    def expect_round(self, in_seconds: float, final: bool = False) -> None:
        self.inner.expect_round(in_seconds, final)

    def _charge(self, before: int, hops: int) -> None:
        sent = self.inner.stats.bytes_sent - before
        if self._world > 1 and (sent or hops):
            self.stats.comm_seconds += self.link.send(sent, hops)

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        before = self.inner.stats.bytes_sent
        self.inner.all_reduce_sum(tensors)
        self._charge(before, 2 * (self._world - 1))

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        before = self.inner.stats.bytes_sent
        out = self.inner.all_gather_bytes(payload)
        self._charge(before, self._world - 1)
        return out

    def commit(self) -> bool:
        return self.inner.commit()

    def fail_round(self, error, blame=()) -> None:  # noqa: ANN001 - a CommError, ranks
        self.inner.fail_round(error, blame)

    def close(self) -> None:
        self.inner.close()

    def register_state(self, get_state, set_state) -> None:
        super().register_state(get_state, set_state)
        self.inner.register_state(get_state, set_state)
