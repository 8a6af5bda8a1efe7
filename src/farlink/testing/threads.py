"""Members of a group as threads: one call per member at once, as a round needs every member
inside it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Hashable
from typing import TypeVar

T = TypeVar("T")


def in_threads(fn: Callable[[Hashable, object], T], members: dict, timeout: float = 90,
               needed: Collection[Hashable] | None = None) -> dict:
    """``fn(name, member)`` for every item of ``members`` at once, each in its own thread; their
    results by name. The first error is re-raised here (after every thread ended or
    ``timeout`` passed); a member still running after ``timeout`` is an error too.

    ``needed``: the members whose outcome the caller reads. Once they have ended, every other
    member is closed (``member.close()``) and given a few seconds to end; its result or error is
    dropped. A hostile member that the others left out otherwise waits out its own round
    timeout, which no test is about."""
    results: dict = {}
    errors: dict = {}
    wanted = set(members) if needed is None else set(needed)

    def run(name: Hashable, member: object) -> None:
        try:
            results[name] = fn(name, member)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            if name in wanted:
                errors[name] = exc

    threads = {name: threading.Thread(target=run, args=(name, member), name=f"member-{name}",
                                      daemon=True)
               for name, member in members.items()}
    for t in threads.values():
        t.start()
    for name in wanted:
        threads[name].join(timeout)
    if not any(threads[name].is_alive() for name in wanted):
        closers = [threading.Thread(target=members[name].close, daemon=True)
                   for name in set(members) - wanted if threads[name].is_alive()]
        for t in closers:  # at once: a member closed mid-round can take seconds to close
            t.start()
        for t in closers:
            t.join(30)
    if errors:
        raise next(iter(errors.values()))
    assert wanted <= set(results), f"members still running after {timeout} s"
    return {name: results[name] for name in wanted}
