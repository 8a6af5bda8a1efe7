"""One trainer replica group's loop: take groups, check them, score them, step, publish.

Per step the trainer takes up to ``groups_per_step`` submitted groups (waiting at most
``deadline_s``: a slow or dead worker costs its own job, never the step), and for each:

1. **admits** it: the job exists, was issued to this worker and not handed in before (else a
   replay), the prompt and seeds are the job's, the version claimed exists;
2. drops it, unpunished, when its version is more than ``max_staleness`` behind;
3. **verifies** a sampled fraction (at least one group per worker per step) by recomputing the
   claimed version's logits (:func:`farlink.rl.verify.check`); a worker whose group fails is
   recorded in the ledger and all its groups of the step are dropped; it is banned, unless the
   failure is a near-tie that honest rounding can cause (then only at ``near_ties_to_ban``
   near-ties in a row);
4. **scores** every completion itself with the task's verifier (a worker sends no reward).

Then one GRPO step over the admitted groups and the next policy version is published.
``step_fn(tokens)`` applies the gradients: a plain optimizer's step, or a
:class:`farlink.Optimizer`'s (DiLoCo between trainer replica groups).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from farlink.rl.board import RolloutBoard, Submission
from farlink.rl.broadcast import PolicyPublisher
from farlink.rl.grpo import group_advantages, grpo_loss
from farlink.rl.policy import PRECISIONS, completion_logits, token_logprobs
from farlink.rl.verify import NEAR_TIE, Tolerance, check, recomputed_logits
from farlink.robust.ledger import ContributionLedger


@dataclass
class RLConfig:
    group_size: int = 8
    groups_per_step: int = 8
    max_staleness: int = 2
    deadline_s: float = 5.0
    clip: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0
    max_new_tokens: int = 6
    verify_fraction: float = 0.25
    fingerprint_every: int = 4
    fingerprint_k: int = 4
    #: a worker whose checked groups are refused as near-ties this many times in a row is
    #: banned (honest bf16 rounding makes one in ~50 groups a near-tie)
    near_ties_to_ban: int = 3
    seed: int = 0


@dataclass
class StepLog:
    step: int
    version: int
    groups: int
    rollouts: int
    reward: float
    kl: float
    response_len: float
    staleness_mean: float
    staleness_max: int
    dropped_stale: int
    rejected_groups: int
    verified_groups: int
    clipped_fraction: float
    loss: float
    wall_s: float
    staleness: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class GRPOTrainer:
    """``model`` trains; ``checker`` (same architecture) recomputes claimed versions;
    ``reference`` (optional, frozen) anchors the KL penalty."""

    def __init__(self, model: nn.Module, step_fn: Callable[[int], object], board: RolloutBoard,
                 publisher: PolicyPublisher, checker: nn.Module, config: RLConfig,
                 ledger: ContributionLedger | None = None, reference: nn.Module | None = None,
                 tolerance: Tolerance = Tolerance()) -> None:
        self.model, self.step_fn, self.board, self.publisher = model, step_fn, board, publisher
        self.checker, self.config, self.reference, self.tolerance = checker, config, reference, tolerance
        self.ledger = ledger if ledger is not None else ContributionLedger()
        self.step = 0
        self.rejections: list[tuple[str, str]] = []  # (worker, reason), in order
        self.accepted_jobs: set[int] = set()  # jobs whose groups went into a step
        self._near_ties: dict[str, int] = {}  # worker -> near-tie refusals in a row
        self._rng = random.Random(config.seed + 7)
        self._checker_version: int | None = None
        self._vocab: int | None = getattr(getattr(model, "config", None), "vocab_size", None)

    # --- checks ------------------------------------------------------------------------------
    def admit(self, sub: Submission) -> str | None:
        """Why ``sub`` cannot be this step's (a reason the ledger counts), or None."""
        job = self.board.jobs.get(sub.job)
        if job is None and sub.job < self.board.first_job:
            return None  # issued before this trainer restarted: dropped as expired, not blamed
        if job is None:
            return f"replay: job {sub.job} was never issued"
        if job.worker != sub.worker:
            return f"replay: job {sub.job} was issued to another worker"
        if sub.job in self.board.consumed:
            return f"replay: job {sub.job} was handed in before"
        if len(sub.rollouts) != len(job.seeds):
            return f"malformed: {len(sub.rollouts)} completions for a group of {len(job.seeds)}"
        for rollout, seed in zip(sub.rollouts, job.seeds):
            if rollout.prompt_ids != job.prompt_ids or rollout.seed != seed:
                return f"replay: a completion of job {sub.job} answers another prompt or seed"
            if rollout.job != sub.job or rollout.worker != sub.worker:
                return f"replay: a completion names job {rollout.job} of {rollout.worker}"
            if not 0 <= rollout.version <= self.publisher.version:
                return f"version: claims version {rollout.version}, newest is {self.publisher.version}"
            if not rollout.completion_ids or len(rollout.completion_ids) > self.config.max_new_tokens:
                return f"malformed: a completion of {len(rollout.completion_ids)} tokens"
            # every group, checked or not, enters the update: what would break it is refused
            if len(rollout.logprobs) != len(rollout.completion_ids):
                return (f"malformed: {len(rollout.logprobs)} log-probabilities for "
                        f"{len(rollout.completion_ids)} tokens")
            if self._vocab is not None and not all(0 <= t < self._vocab
                                                   for t in rollout.completion_ids):
                return f"malformed: a token id outside the vocabulary of {self._vocab}"
            if not all(math.isfinite(v) for v in rollout.logprobs) or not all(
                    math.isfinite(v) for fp in rollout.fingerprints for v in fp.values):
                return "malformed: a log-probability or fingerprint value that is not finite"
        versions = {r.version for r in sub.rollouts}
        if len(versions) != 1:
            return f"malformed: one group claims versions {sorted(versions)}"
        precisions = {r.precision for r in sub.rollouts}
        if len(precisions) != 1 or not precisions <= set(PRECISIONS):
            return f"malformed: precisions {sorted(precisions)}, one of {sorted(PRECISIONS)}"
        return None

    def _load_checker(self, version: int) -> bool:
        if self._checker_version == version:
            return True
        weights = self.publisher.weights(version)
        if weights is None:
            return False
        with torch.no_grad():
            for name, param in self.checker.named_parameters():
                param.copy_(weights[name])
        self._checker_version = version
        return True

    @torch.no_grad()
    def verify(self, sub: Submission) -> str | None:
        version = sub.rollouts[0].version
        if not self._load_checker(version):
            return None  # not kept any more: only possible beyond max_staleness, dropped anyway
        self.checker.eval()
        logits = recomputed_logits(self.checker, sub.rollouts)
        for rollout, rows in zip(sub.rollouts, logits):
            reason = check(rollout, rows, self.config.temperature, self.config.fingerprint_every,
                           self.tolerance)
            if reason is not None:
                return reason
        return None

    def _reject(self, sub: Submission, reason: str) -> None:
        """Record the refusal; ban the worker unless it is a near-tie that has not repeated
        ``near_ties_to_ban`` times in a row."""
        tokens = sum(len(r.completion_ids) for r in sub.rollouts)
        self.ledger.record_rejected(sub.worker, self.step, tokens, reason)
        self.rejections.append((sub.worker, reason))
        if reason.startswith(NEAR_TIE):
            self._near_ties[sub.worker] = self._near_ties.get(sub.worker, 0) + 1
            if self._near_ties[sub.worker] < self.config.near_ties_to_ban:
                return
        self.board.ban(sub.worker)

    def _sort(self, sub: Submission, version: int, kept: list[Submission],
              counts: dict[str, int]) -> None:
        """Admit ``sub`` into ``kept``, or count it as rejected (a cheat, banned) or dropped
        (expired, too stale, or of a version this trainer cannot check after a restart)."""
        cfg = self.config
        reason = self.admit(sub)
        self.board.consumed.add(sub.job)
        if reason is not None:
            self._reject(sub, reason)
            counts["rejected"] += 1
        elif sub.job not in self.board.jobs:
            counts["dropped"] += 1
        elif (version - sub.rollouts[0].version > cfg.max_staleness
              or self.publisher.weights(sub.rollouts[0].version) is None):
            counts["dropped"] += 1
        else:
            kept.append(sub)

    # --- the step ----------------------------------------------------------------------------
    def train_step(self, subs: list[Submission] | None = None) -> StepLog | None:
        """One step over the groups handed in (taken from the board unless given); None when
        nothing usable came before the deadline (no step is taken, nothing is published).

        Taking from the board goes on until ``groups_per_step`` groups are usable or the
        deadline passes: a group dropped as too stale (or rejected) does not take a usable
        one's place, so a backlog of old hand-ins cannot shrink a step to one or two groups."""
        start = time.monotonic()
        cfg = self.config
        version = self.publisher.version
        kept: list[Submission] = []
        counts = {"rejected": 0, "dropped": 0}
        if subs is not None:
            for sub in subs:
                self._sort(sub, version, kept, counts)
        else:
            end = start + cfg.deadline_s
            while len(kept) < cfg.groups_per_step and time.monotonic() < end:
                taken = self.board.take(cfg.groups_per_step - len(kept),
                                        end - time.monotonic())
                if not taken:
                    break
                for sub in taken:
                    self._sort(sub, version, kept, counts)
        rejected, dropped, verified = counts["rejected"], counts["dropped"], 0
        workers = sorted({s.worker for s in kept})
        must_check = {w: self._rng.choice([s for s in kept if s.worker == w]).job for w in workers}
        refused: set[str] = set()  # workers with a group refused this step
        for sub in list(kept):
            if sub.worker in refused or sub.worker in self.board.banned:  # none of its groups count
                kept.remove(sub)
                continue
            if must_check[sub.worker] == sub.job or self._rng.random() < cfg.verify_fraction:
                verified += 1
                reason = self.verify(sub)
                if reason is None:
                    self._near_ties.pop(sub.worker, None)
                else:
                    self._reject(sub, reason)
                    refused.add(sub.worker)
                    rejected += 1
        # a refused worker's unchecked groups of this step go too: they may be forged alike
        kept = [s for s in kept if s.worker not in refused and s.worker not in self.board.banned]
        if not kept:
            return None
        return self._update(kept, version, start, rejected, dropped, verified)

    def _update(self, kept: list[Submission], version: int, start: float, rejected: int,
                dropped: int, verified: int) -> StepLog:
        cfg = self.config
        rollouts, advantages, rewards = [], [], []
        for sub in kept:
            job = self.board.jobs[sub.job]
            scores = [self.board.task.reward(job.problem,
                                             self.board.codec.completion_text(r.completion_ids))
                      for r in sub.rollouts]
            adv = group_advantages(torch.tensor(scores))
            rollouts += sub.rollouts
            advantages += adv.tolist()
            rewards += scores
            tokens = sum(len(r.completion_ids) for r in sub.rollouts)
            self.ledger.record_accepted(sub.worker, self.step, tokens)
            self.accepted_jobs.add(sub.job)
        self.model.train()
        logits = completion_logits(self.model, rollouts)
        new = [token_logprobs(lg, r.completion_ids, cfg.temperature)
               for lg, r in zip(logits, rollouts)]
        old = [torch.tensor(r.logprobs) for r in rollouts]
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = [token_logprobs(lg, r.completion_ids, cfg.temperature)
                       for lg, r in zip(completion_logits(self.reference, rollouts), rollouts)]
        parts = grpo_loss(new, old, advantages, cfg.clip, cfg.kl_coef, ref)
        parts.loss.backward()
        tokens = sum(len(r.completion_ids) for r in rollouts)
        self.step_fn(tokens)
        self.publisher.publish(self.model)
        staleness = [version - s.rollouts[0].version for s in kept]
        log = StepLog(
            step=self.step, version=version, groups=len(kept), rollouts=len(rollouts),
            reward=sum(rewards) / len(rewards), kl=parts.kl,
            response_len=tokens / len(rollouts),
            staleness_mean=sum(staleness) / len(staleness), staleness_max=max(staleness),
            dropped_stale=dropped, rejected_groups=rejected, verified_groups=verified,
            clipped_fraction=parts.clipped_fraction, loss=float(parts.loss.detach()),
            wall_s=time.monotonic() - start, staleness=staleness)
        self.step += 1
        return log
