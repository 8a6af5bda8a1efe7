"""Where rollout workers get jobs and hand in groups: the trainer side's only door to them.

A job is a prompt, the seeds of its group (chosen here, so the verifier can replay each draw)
and the worker it was issued to. Workers come and go: a job nobody returns simply expires, and
the trainer never waits for it beyond its deadline (:meth:`RolloutBoard.take`). A banned worker
gets no more jobs. Everything a worker sends is counted in bytes.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass

from farlink.rl.base import TextCodec
from farlink.rl.policy import Rollout
from farlink.rl.tasks import Problem, Task


#: job numbers skipped at a restart: more than a trainer issues between two checkpoints
RESTART_GAP = 1 << 20


@dataclass(frozen=True)
class Job:
    job: int
    worker: str
    problem: Problem
    prompt_ids: list[int]
    seeds: list[int]
    issued_version: int


@dataclass
class Submission:
    worker: str
    job: int
    rollouts: list[Rollout]
    received: float  # time.monotonic() when it arrived


class RolloutBoard:
    """Issues jobs, queues submissions; thread-safe (workers are threads or a server's
    handlers)."""

    def __init__(self, task: Task, codec: TextCodec, group_size: int, seed: int = 0,
                 version: callable = lambda: 0, first_job: int = 0) -> None:
        """``first_job``: where job numbers start; a restarted trainer starts after the ones
        it issued before, so a late hand-in of an old job expires instead of looking forged."""
        if group_size < 2:
            raise ValueError(f"a GRPO group needs at least 2 completions, got {group_size}")
        self.task, self.codec, self.group_size = task, codec, group_size
        self._version = version
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.first_job = self._next_job = first_job
        self.jobs: dict[int, Job] = {}
        self.consumed: set[int] = set()
        self.banned: set[str] = set()
        self._inbox: queue.Queue[Submission] = queue.Queue()
        self.bytes_in = 0
        self.submissions = 0

    def request(self, worker: str) -> Job | None:
        """A new job for ``worker``, or None when it is banned."""
        with self._lock:
            if worker in self.banned:
                return None
            problem = self.task.draw(self._rng)
            seeds = [self._rng.getrandbits(62) for _ in range(self.group_size)]
            job = Job(self._next_job, worker, problem, self.codec.prompt_ids(problem.prompt),
                      seeds, self._version())
            self.jobs[job.job] = job
            self._next_job += 1
            return job

    @property
    def next_job(self) -> int:
        return self._next_job

    def restart_at(self, next_job: int) -> None:
        """A restarted trainer's board: ``next_job`` was the next number at its checkpoint, and
        jobs issued after it (before the crash) are unknown, so numbering resumes
        :data:`RESTART_GAP` later and every hand-in of an unknown lower number expires."""
        with self._lock:
            self.first_job = self._next_job = next_job + RESTART_GAP
            self.jobs.clear()

    def submit(self, worker: str, job: int, rollouts: list[Rollout]) -> None:
        with self._lock:
            self.bytes_in += sum(r.nbytes() for r in rollouts)
            self.submissions += 1
        self._inbox.put(Submission(worker, job, rollouts, time.monotonic()))

    def ban(self, worker: str) -> None:
        with self._lock:
            self.banned.add(worker)

    def take(self, groups: int, deadline_s: float) -> list[Submission]:
        """Up to ``groups`` submissions: waits at most ``deadline_s`` for them, then returns
        what came (possibly nothing)."""
        out: list[Submission] = []
        end = time.monotonic() + deadline_s
        while len(out) < groups:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                out.append(self._inbox.get(timeout=left))
            except queue.Empty:
                break
        return out
