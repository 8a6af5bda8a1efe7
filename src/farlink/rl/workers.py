"""Rollout workers: inference only, untrusted, free to come and go.

A worker loops: ask the board for a job, bring its policy copy to the newest version (deltas or
hashed chunks, :class:`~farlink.rl.broadcast.PolicyReplica`), sample the job's group with the
job's seeds, hand it in. ``pace_seconds`` makes each job take at least that long (sleeping the
rest), so throughput comparisons between 1 and 4 workers hold on two shared cores.

The dishonest kinds the verifier must catch, each what a real cheat would do:

- ``fabricate``: hands in the reference answer instead of sampling (with honestly computed
  log-probabilities and commitments for those tokens, the strongest form);
- ``wrong_model``: samples with another model (its own, never updated) and claims the policy;
- ``stale``: never updates after its first fetch and claims the newest version;
- ``replay``: hands in an earlier group of its own again under a new job.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import replace

import torch
from torch import nn

from farlink.rl.board import Job, RolloutBoard
from farlink.rl.broadcast import PolicyPublisher, PolicyReplica
from farlink.rl.policy import Rollout, fingerprint_at, sample_group
from farlink.rl.trainer import RLConfig
from farlink.rl.verify import recomputed_logits

BEHAVIOURS = ("honest", "fabricate", "wrong_model", "stale", "replay")


class RolloutWorker:
    def __init__(self, name: str, board: RolloutBoard,
                 publisher: PolicyPublisher, replica: PolicyReplica, config: RLConfig,
                 behaviour: str = "honest", pace_seconds: float = 0.0,
                 dtype: torch.dtype = torch.float32, other_model: nn.Module | None = None) -> None:
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"unknown worker behaviour {behaviour!r}; one of {BEHAVIOURS}")
        if behaviour == "wrong_model" and other_model is None:
            raise ValueError("a wrong_model worker needs the other model it samples with")
        self.name, self.board, self.publisher = name, board, publisher
        self.replica, self.config, self.behaviour = replica, config, behaviour
        self.pace_seconds, self.dtype, self.other_model = pace_seconds, dtype, other_model
        self.model = replica.model  # what it samples with: the copy its fetches keep current
        self.jobs_done = 0
        self.rollouts_done = 0
        self._first: list[Rollout] | None = None  # what a replayer hands in again
        #: jobs whose hand-in is not what an honest worker would have sent (a fabricated
        #: answer equal to the seeded draw is the honest completion, so it is not counted):
        #: what a bench compares with the trainer's accepted jobs
        self.forged_jobs: set[int] = set()

    def do_job(self) -> bool:
        """One job from request to hand-in; False when the board gives none (banned)."""
        started = time.monotonic()
        job = self.board.request(self.name)
        if job is None:
            return False
        if self.behaviour != "stale" or self.replica.version is None:
            self.replica.refresh(self.publisher)
        rollouts = self._rollouts(job)
        left = self.pace_seconds - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)
        self.board.submit(self.name, job.job, rollouts)
        self.jobs_done += 1
        self.rollouts_done += len(rollouts)
        return True

    def _sample(self, model: nn.Module, job: Job, version: int) -> list[Rollout]:
        cfg = self.config
        return sample_group(model, job.prompt_ids, job.seeds, worker=self.name, job=job.job,
                            version=version, stop_id=self.board.codec.eot,
                            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            every=cfg.fingerprint_every, k=cfg.fingerprint_k, dtype=self.dtype)

    def _rollouts(self, job: Job) -> list[Rollout]:
        claimed = self.publisher.version if self.behaviour == "stale" else self.replica.version
        if self.behaviour == "wrong_model":
            self.forged_jobs.add(job.job)
            return self._sample(self.other_model, job, self.replica.version)
        if self.behaviour == "replay" and self._first is not None:
            self.forged_jobs.add(job.job)
            return [replace(r, job=job.job) for r in self._first]
        rollouts = self._sample(self.model, job, claimed)
        if self.behaviour == "replay":
            self._first = rollouts
        if self.behaviour == "stale" and claimed != self.replica.version:
            self.forged_jobs.add(job.job)
        if self.behaviour == "fabricate":
            answer = self.board.codec.tokenizer.encode(job.problem.answer,
                                                       add_special_tokens=False).ids
            honest = [r.completion_ids for r in rollouts]
            rollouts = [self._committed(r, answer + [self.board.codec.eot]) for r in rollouts]
            if honest != [r.completion_ids for r in rollouts]:
                self.forged_jobs.add(job.job)
        return rollouts

    @torch.no_grad()
    def _committed(self, rollout: Rollout, tokens: list[int]) -> Rollout:
        """``rollout`` with ``tokens`` as its completion and honest commitments for them."""
        tokens = tokens[:self.config.max_new_tokens]
        forged = replace(rollout, completion_ids=tokens)
        logits = recomputed_logits(self.model, [forged])[0]  # in the precision it sampled in
        logp = torch.log_softmax(logits / self.config.temperature, dim=-1)
        cfg = self.config
        return replace(forged,
                       logprobs=[float(logp[t, tok]) for t, tok in enumerate(tokens)],
                       fingerprints=[fingerprint_at(logits[t], t, cfg.fingerprint_k)
                                     for t in range(0, len(tokens), cfg.fingerprint_every)])

    def run(self, stop: threading.Event) -> None:
        """Jobs until ``stop`` is set or the board turns this worker away."""
        while not stop.is_set():
            if not self.do_job():
                return


def worker_model(model: nn.Module) -> nn.Module:
    """A worker's own module of the policy's architecture (weights arrive by fetch)."""
    return copy.deepcopy(model).eval()
