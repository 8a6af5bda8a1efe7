"""A trainer replica group and its rollout workers as threads in one process.

Workers are the subject of the protocol (jobs, versions, deadlines), not of process isolation,
so threads are the cheapest real form; each worker runs until the trainer is done or the board
bans it, and a worker that stops (killed, gone) costs only its open job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from farlink.rl.trainer import GRPOTrainer, StepLog
from farlink.rl.workers import RolloutWorker


def run_group(trainer: GRPOTrainer, workers: list[RolloutWorker], steps: int,
              on_step: Callable[[StepLog], None] | None = None,
              max_wall_s: float = float("inf"), remote: bool = False) -> list[StepLog]:
    """``steps`` committed trainer steps (or until ``max_wall_s``) with ``workers`` running;
    ``remote``: worker processes also hand in (through a server), so the loop goes on when
    no thread worker is left."""
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop,), name=f"rollout-{w.name}",
                                daemon=True) for w in workers]
    for t in threads:
        t.start()
    logs: list[StepLog] = []
    end = time.monotonic() + max_wall_s
    try:
        while len(logs) < steps and time.monotonic() < end:
            if not remote and not any(t.is_alive() for t in threads):
                break  # every worker gone or banned: nothing more will come
            log = trainer.train_step()
            if log is None:
                continue
            logs.append(log)
            if on_step is not None:
                on_step(log)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    return logs
