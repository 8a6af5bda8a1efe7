"""A rollout worker's view of the board and the publisher across an emulated link.

In-process emulation, as ``farlink train --emulate-link`` does for collectives: every call a
worker makes is held for what its bytes and one-way latencies would take on the worker's own
access link (:class:`~farlink.comm.base.LinkModel`: rate and latency, no queueing, jitter or
loss), then answered by the real board or publisher. The trainer side is taken to sit on a
fast link; what a home worker pays is its own last mile:

- a job request: a round trip (the request and the job are a few hundred bytes);
- a policy refresh: a round trip to learn the newest version, then the deltas or the full
  snapshot at the download rate (the bytes :class:`~farlink.rl.broadcast.PolicyReplica`
  counts);
- a hand-in: one way, its rollouts' wire bytes at the upload rate.

The worker code is unchanged: :class:`LinkedBoard` and :class:`LinkedPublisher` have the
methods :class:`~farlink.rl.workers.RolloutWorker` and the replica call, as the TCP proxies in
:mod:`farlink.rl.remote` do.
"""

from __future__ import annotations

import threading
import time

from farlink.comm.base import LinkModel
from farlink.rl.board import Job, RolloutBoard
from farlink.rl.broadcast import PolicyPublisher, Snapshot
from farlink.rl.policy import Rollout


class LinkClock:
    """One worker's link: the two directions, and the seconds and bytes spent crossing it."""

    def __init__(self, up: LinkModel, down: LinkModel) -> None:
        self.up, self.down = up, down
        self.seconds = 0.0
        self.bytes_up = 0
        self.bytes_down = 0
        self._lock = threading.Lock()

    def hold(self, link: LinkModel, nbytes: int, hops: int) -> None:
        wait = link.seconds(nbytes, hops)
        with self._lock:
            self.seconds += wait
            if link is self.up:
                self.bytes_up += nbytes
            else:
                self.bytes_down += nbytes
        time.sleep(wait)


class LinkedBoard:
    """``board`` as a worker behind ``clock``'s link sees it."""

    def __init__(self, board: RolloutBoard, clock: LinkClock) -> None:
        self.board, self.clock = board, clock
        self.codec = board.codec

    def request(self, worker: str) -> Job | None:
        self.clock.hold(self.clock.down, 0, 2)  # a round trip; the job is a few hundred bytes
        return self.board.request(worker)

    def submit(self, worker: str, job: int, rollouts: list[Rollout]) -> None:
        self.clock.hold(self.clock.up, sum(r.nbytes() for r in rollouts), 1)
        self.board.submit(worker, job, rollouts)


class LinkedPublisher:
    """``publisher`` as a worker behind ``clock``'s link sees it: reading the newest version
    costs a round trip, deltas and snapshots their bytes at the download rate."""

    def __init__(self, publisher: PolicyPublisher, clock: LinkClock) -> None:
        self.publisher, self.clock = publisher, clock

    @property
    def epoch(self) -> int:
        self.clock.hold(self.clock.down, 0, 2)  # the refresh's first question
        return self.publisher.epoch

    @property
    def version(self) -> int:  # answered with the epoch: no second round trip
        return self.publisher.version

    def deltas(self, since: int) -> tuple[int, list[dict[str, bytes]]] | None:
        update = self.publisher.deltas(since)
        if update is not None:
            nbytes = sum(len(p) for payloads in update[1] for p in payloads.values())
            self.clock.hold(self.clock.down, nbytes, 0)
        return update

    def snapshot(self) -> Snapshot:
        snapshot = self.publisher.snapshot()
        self.clock.hold(self.clock.down, len(snapshot.blob), 0)
        return snapshot
