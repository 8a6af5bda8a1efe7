"""SWARM's stochastic wiring: which peer of a stage gets the next micro-batch.

Each peer's seconds per micro-batch (compute plus its link, as the trainer sees it end to end)
is tracked as an exponential moving average. A micro-batch goes to the live peer that would
finish it first, ``(in_flight + 1) x seconds``: a peer twice as fast receives about twice the
work, and a peer that queues up gets less until it drains. A peer never measured counts as
instantly fast, so every peer is tried once and its speed learnt. A failed peer is out until it
is added again. The stage with the least total throughput is the bottleneck a new peer should
join (SWARM's rebalancing).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


class StageUnavailable(RuntimeError):
    """Every peer of a stage has failed: the pipeline cannot continue until one joins."""


@dataclass
class PeerLoad:
    seconds: float | None = None  # EMA of seconds per micro-batch, None until measured
    in_flight: int = 0
    served: int = 0
    alive: bool = True
    why: str | None = None  # why it was taken out, when it was


class ThroughputRouter:
    def __init__(self, stages: list[list[str]], smoothing: float = 0.3) -> None:
        if not stages or any(not peers for peers in stages):
            raise ValueError("every stage needs at least one peer")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.stages: list[list[str]] = [list(peers) for peers in stages]
        self.load: dict[str, PeerLoad] = {p: PeerLoad() for peers in stages for p in peers}
        self._lock = threading.Lock()

    def add(self, stage: int, peer: str) -> None:
        with self._lock:
            if peer not in self.stages[stage]:
                self.stages[stage].append(peer)
            self.load[peer] = PeerLoad()

    def live(self, stage: int) -> list[str]:
        with self._lock:
            return [p for p in self.stages[stage] if self.load[p].alive]

    def choose(self, stage: int) -> str:
        """The live peer of ``stage`` expected to finish one more micro-batch first; counts it
        as in flight until :meth:`finished` or :meth:`failed`."""
        with self._lock:
            live = [p for p in self.stages[stage] if self.load[p].alive]
            if not live:
                why = "; ".join(f"{p}: {self.load[p].why or 'failed'}" for p in self.stages[stage])
                raise StageUnavailable(f"stage {stage} has no live peer left; start a peer for "
                                       f"it (its peers were taken out: {why})")
            peer = min(live, key=lambda p: ((self.load[p].in_flight + 1)
                                            * (self.load[p].seconds or 0.0),
                                            self.load[p].in_flight))  # ties: the less busy
            self.load[peer].in_flight += 1
            return peer

    def begin(self, peer: str) -> None:
        """``peer`` takes work it was not chosen for (a backward pass goes to the peer that
        holds the micro-batch's graph)."""
        with self._lock:
            self.load[peer].in_flight += 1

    def finished(self, peer: str, seconds: float) -> None:
        with self._lock:
            load = self.load[peer]
            load.in_flight -= 1
            load.served += 1
            a = self.smoothing
            load.seconds = seconds if load.seconds is None else (1 - a) * load.seconds + a * seconds

    def failed(self, peer: str, why: str | None = None) -> None:
        """``peer`` is out (``why``: what it did, named when its stage runs out of peers)."""
        with self._lock:
            load = self.load[peer]
            load.in_flight = max(0, load.in_flight - 1)
            load.alive = False
            load.why = why

    def throughput(self, stage: int) -> float:
        """Micro-batches per second the live peers of ``stage`` serve together (inf when a
        live peer is not measured yet)."""
        with self._lock:
            total = 0.0
            for p in self.stages[stage]:
                load = self.load[p]
                if load.alive:
                    total += float("inf") if not load.seconds else 1.0 / load.seconds
            return total

    def bottleneck(self) -> int:
        """The stage a joining peer should serve: the one with the least throughput."""
        return min(range(len(self.stages)), key=self.throughput)
