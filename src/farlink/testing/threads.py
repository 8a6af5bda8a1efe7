"""Members of a group as threads: one call per member at once, as a round needs every member
inside it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


def in_threads(fn: Callable[[Hashable, object], T], members: dict, timeout: float = 90) -> dict:
    """``fn(name, member)`` for every item of ``members`` at once, each in its own thread; their
    results by name. The first error is re-raised here (after every thread ended or
    ``timeout`` passed); a member still running after ``timeout`` is an error too."""
    results: dict = {}
    errors: list[BaseException] = []

    def run(name: Hashable, member: object) -> None:
        try:
            results[name] = fn(name, member)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=item, name=f"member-{item[0]}", daemon=True)
               for item in members.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert set(results) == set(members), f"members still running after {timeout} s"
    return results
