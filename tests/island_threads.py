"""Two islands of two replicas as threads of one process (in-process collectives): the
harness of the hierarchical tests and of the API's island test."""

from __future__ import annotations

import threading

from farlink.comm.inprocess import InProcessCollective, InProcessGroup


class FlakyCommit(InProcessCollective):
    """An island member whose ``commit`` reports failure on chosen calls (as torchft's
    should_commit does on every participant when any collective of the step failed)."""

    def __init__(self, group: InProcessGroup, rank: int, fail_on: set[int]) -> None:
        super().__init__(group, rank)
        self.fail_on, self.calls = fail_on, 0

    def commit(self) -> bool:
        self.calls += 1
        self.group.barrier.wait()
        if self.calls in self.fail_on:
            return False
        self.committed_rounds += 1
        return True


def run_islands(fn, fail_island_commit: set[int] | None = None):
    """fn(worker, island_collective, global_collective_or_None) in 4 threads."""
    islands = [InProcessGroup(2), InProcessGroup(2)]
    top = InProcessGroup(2)
    groups = [*islands, top]
    if fail_island_commit:
        for g in islands:
            g._members = [FlakyCommit(g, r, fail_island_commit) for r in range(2)]
    results, errors = [None] * 4, []

    def target(worker: int) -> None:
        k, rank = worker // 2, worker % 2
        try:
            results[worker] = fn(worker, islands[k].member(rank),
                                 top.member(k) if rank == 0 else None)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            for g in groups:
                g.barrier.abort()

    threads = [threading.Thread(target=target, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results
