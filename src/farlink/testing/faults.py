"""Faults at named points of an outer round, for any collective (torchft's ``EventInjector``).

A test says what goes wrong where (:class:`Faults`) and wraps each replica's collective in a
:class:`FaultyCollective`; the wrapped collective is the real one (torchft over Gloo, hivemind,
in-process), so what the algorithm sees after a fault is what the backend really does:

* ``fail_at(replica, round)``: the replica crashes as it begins that round
  (:class:`InjectedFailure` out of ``begin_round``); a runner (:func:`run_replicas`) restarts
  it with a fresh collective and state, and the group heals it.
* ``fail_exchange_at(round, replica=None)``: that round's exchange fails (on one replica, or on
  every one): the backend is told through ``fail_round``, so the round commits nowhere.
* ``drop_payload(replica, round)`` / ``delay_payload(replica, round, seconds)``: what a replica
  puts into that round's all-gather arrives empty, or late.
* ``barrier_at(point, round, parties)``: the replicas (or test threads) that reach ``point`` of
  that round wait for each other there, to order events across threads.

Rounds are counted per replica from 0 (every ``begin_round`` call, retries included), so a
point names the same moment however rounds commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from farlink.comm.base import Collective, RoundInfo
from farlink.comm.errors import CommError

__all__ = ["FaultyCollective", "Faults", "InjectedFailure", "run_replicas"]


class InjectedFailure(RuntimeError):
    """A replica crashed where the test said it would."""


@dataclass
class Faults:
    """What goes wrong where; every fault fires once."""

    _crashes: set[tuple[int, int]] = field(default_factory=set)
    _failed_exchanges: dict[int, int | None] = field(default_factory=dict)
    _dropped: set[tuple[int, int]] = field(default_factory=set)
    _delays: dict[tuple[int, int], float] = field(default_factory=dict)
    _barriers: dict[tuple[str, int], threading.Barrier] = field(default_factory=dict)
    #: (replica, round, what) for every fault that fired, in order: a test checks its faults
    #: really happened
    fired: list[tuple[int, int, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fail_at(self, replica: int, round: int) -> Faults:  # noqa: A002 - the round's number
        self._crashes.add((replica, round))
        return self

    def fail_exchange_at(self, round: int, replica: int | None = None) -> Faults:  # noqa: A002
        self._failed_exchanges[round] = replica
        return self

    def drop_payload(self, replica: int, round: int) -> Faults:  # noqa: A002
        self._dropped.add((replica, round))
        return self

    def delay_payload(self, replica: int, round: int, seconds: float) -> Faults:  # noqa: A002
        self._delays[(replica, round)] = seconds
        return self

    def barrier_at(self, point: str, round: int, parties: int) -> Faults:  # noqa: A002
        """``point``: "begin_round", "all_reduce", "all_gather", "commit" (before it), or a name
        of the test's own that its threads pass to :meth:`wait`."""
        self._barriers[(point, round)] = threading.Barrier(parties)
        return self

    def wait(self, point: str, round: int, timeout: float = 60.0) -> None:  # noqa: A002
        """Wait at ``point`` of ``round`` if the test put a barrier there."""
        barrier = self._barriers.get((point, round))
        if barrier is not None:
            barrier.wait(timeout)

    def _take(self, pool: set, key: object, replica: int, round: int,  # noqa: A002
              what: str) -> bool:
        with self._lock:
            if key not in pool:
                return False
            pool.discard(key)
            self.fired.append((replica, round, what))
            return True

    def crashes(self, replica: int, round: int) -> bool:  # noqa: A002
        return self._take(self._crashes, (replica, round), replica, round, "crash")

    def exchange_fails(self, replica: int, round: int) -> bool:  # noqa: A002
        with self._lock:
            if round not in self._failed_exchanges:
                return False
            target = self._failed_exchanges[round]
            if target is not None and target != replica:
                return False
            self.fired.append((replica, round, "exchange"))
            return True

    def drops(self, replica: int, round: int) -> bool:  # noqa: A002
        return self._take(self._dropped, (replica, round), replica, round, "drop")

    def delay(self, replica: int, round: int) -> float:  # noqa: A002
        with self._lock:
            seconds = self._delays.pop((replica, round), 0.0)
            if seconds:
                self.fired.append((replica, round, "delay"))
            return seconds


_FLAGS = frozenset(("exact_all_reduce", "quorum_timeout", "final_round", "partial_groups",
                    "stats", "emulated_link", "maddrs", "emulate_transfer"))


class FaultyCollective(Collective):
    """``inner`` with the faults of ``faults`` that concern ``replica``; everything else is the
    inner collective's own (its byte counts, its healing, its commit)."""

    def __init__(self, inner: Collective, faults: Faults, replica: int) -> None:
        self.inner, self.faults, self.replica = inner, faults, replica
        self.round = -1  # begin_round calls so far, minus one

    _OWN = ("inner", "faults", "replica", "round")

    def __getattribute__(self, name: str):  # noqa: ANN204
        # the backend's flags (final_round, exact_all_reduce, ...), stats and
        # addresses are the inner collective's, class attributes of Collective included
        if name in _FLAGS:
            return getattr(object.__getattribute__(self, "inner"), name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str):  # noqa: ANN204 - whatever else the backend offers
        return getattr(self.__dict__["inner"], name)

    def __setattr__(self, name: str, value: object) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # the training side sets backend flags (final_round, ...) on the inner one
            setattr(self.inner, name, value)

    def begin_round(self, final: bool = False, **round_options) -> RoundInfo:  # noqa: ANN003
        self.round += 1
        self.faults.wait("begin_round", self.round)
        if self.faults.crashes(self.replica, self.round):
            raise InjectedFailure(f"replica {self.replica} crashed at round {self.round}")
        return self.inner.begin_round(final, **round_options)

    def expect_round(self, in_seconds: float, final: bool = False) -> None:
        self.inner.expect_round(in_seconds, final)

    def _exchange_fault(self) -> None:
        if self.faults.exchange_fails(self.replica, self.round):
            self.inner.fail_round(CommError(f"exchange failed at round {self.round} (injected)"))

    def all_reduce_sum(self, tensors: list) -> None:
        self.faults.wait("all_reduce", self.round)
        self._exchange_fault()
        time.sleep(self.faults.delay(self.replica, self.round))
        self.inner.all_reduce_sum(tensors)

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        self.faults.wait("all_gather", self.round)
        self._exchange_fault()
        time.sleep(self.faults.delay(self.replica, self.round))
        if self.faults.drops(self.replica, self.round):
            payload = b""
        return self.inner.all_gather_bytes(payload)

    def fail_round(self, error: CommError, blame: Sequence[int] = ()) -> None:
        self.inner.fail_round(error, blame)

    def commit(self) -> bool:
        self.faults.wait("commit", self.round)
        return self.inner.commit()

    def close(self) -> None:
        self.inner.close()

    def load_committed_step(self, step: int) -> None:
        self.inner.load_committed_step(step)

    def register_state(self, get_state, set_state) -> None:  # noqa: ANN001 - callables
        self.inner.register_state(get_state, set_state)


def run_replicas(train: Callable[[int, int], object], replicas: int, attempts: int = 2,
                 timeout: float = 120.0) -> dict[int, object]:
    """``train(replica, attempt)`` for every replica at once, each in its own thread, as
    torchft's ``Runner`` does: a replica that raises :class:`InjectedFailure` is started again
    (``attempt`` + 1, a fresh collective and state are ``train``'s to build), at most
    ``attempts`` times in all; its last result by replica. Any other error is re-raised."""
    from farlink.testing.threads import in_threads

    def replica(index: int, _member: object) -> object:
        for attempt in range(attempts):
            try:
                return train(index, attempt)
            except InjectedFailure:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    return in_threads(replica, dict.fromkeys(range(replicas)), timeout=timeout)
