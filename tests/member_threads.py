"""Replicas as threads: one call per member at once, as a round needs every member inside it."""

from __future__ import annotations

import threading


def in_threads(fn, members: dict, timeout: float = 90) -> dict:
    """fn(name, collective) for every member at once; their results by name."""
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def run(name: str, coll) -> None:  # noqa: ANN001 - any collective
        try:
            results[name] = fn(name, coll)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=item) for item in members.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert set(results) == set(members), f"members still running after {timeout} s"
    return results
