"""Work that runs beside training instead of in its way: checkpoint writes and evaluations.

At a boundary the training thread only takes a snapshot (a copy of tensors in memory, a few
milliseconds); serializing, hashing, syncing to disk and the held-out forward passes run in a
background thread while the next inner steps compute. Peers never wait for a worker that is
evaluating or writing, since the worker is back in its loop at once.

An evaluation runs in a thread at the lowest CPU priority (Linux lets a thread have its own
nice value), so on busy cores training gets the CPU first and the evaluation what is left. A
thread rather than a process: measured on 2 shared cores with the tiny model (median training
step while a 16-batch evaluation ran beside it, two repetitions), nothing beside it 1.02 / 0.70
s, a thread 1.92 / 1.47 s, a lowest-priority thread 0.85 / 0.91 s, a process 1.71 / 0.64 s, a
lowest-priority process 1.12 / 0.74 s: the low priority is what counts, and thread and process
are alike within the noise of a loaded machine. The thread needs no second interpreter, no
second model build and no shared-memory transfer, so it is the one used.

One job of each kind is in flight at a time. A new job first waits for the previous one (the
time waited is on the critical path and is counted as such by the caller); a failed job (a full
disk) is raised in the training thread at the next :meth:`Background.wait` or submit.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any


class Background:
    """At most one job at a time in a daemon thread; its error surfaces in the caller's thread.

    ``threads``: torch's intra-op threads for the job's thread (its own budget: training keeps
    the threads it was given). ``nice``: the job thread's nice value (19: only spare CPU)."""

    def __init__(self, name: str, threads: int = 1, nice: int | None = None) -> None:
        self.name, self.threads, self.nice = name, threads, nice
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # a round in another thread (streaming) may wait too
        self._owner = threading.get_ident()
        self.waited_s = 0.0  # cumulative: time the owning (training) thread spent blocked
        self.busy_s = 0.0  # cumulative: time the jobs ran (in the background)
        self.jobs = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        """Block until the job in flight (if any) ends; raise its error. Returns seconds waited."""
        start = time.perf_counter()
        with self._lock:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            error, self._error = self._error, None
        waited = time.perf_counter() - start
        if threading.get_ident() == self._owner:
            self.waited_s += waited
        if error is not None:
            raise error
        return waited

    def submit(self, job: Callable[[], Any]) -> float:
        """Run ``job()`` in the background once the previous one ended; seconds waited for it."""
        waited = self.wait()

        def run() -> None:
            import torch

            torch.set_num_threads(self.threads)
            if self.nice is not None and hasattr(os, "setpriority"):
                try:  # this thread only: on Linux a thread is its own scheduling entity
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
                except OSError:
                    pass  # a priority it may not take: run at the process's own
            start = time.perf_counter()
            try:
                job()
            except BaseException as exc:  # handed to the training thread at its next wait
                self._error = exc
            finally:
                self.busy_s += time.perf_counter() - start

        thread = threading.Thread(target=run, name=f"farlink-{self.name}", daemon=True)
        with self._lock:  # a wait in another thread (a round's) never sees it unstarted
            self.jobs += 1
            thread.start()
            self._thread = thread
        return waited
