"""Loss-scored contributions: each peer's update judged by what it does to the loss.

Robust statistics judge an update by where it lies among the others; an adaptive attacker (ALIE,
IPM) hides inside their spread, and a free rider or a copycat lies nowhere odd at all. A loss
score judges an update by what it *does*, as Templar's Gauntlet does (arXiv 2505.21684): every
member applies each peer's update alone to the round's starting parameters ``theta`` and measures
the loss drop

    drop_p = [L(theta; A_p) - L(theta - delta_p; A_p)] + [L(theta; H) - L(theta - delta_p; H)]

on a small batch ``A_p`` of the shard ``p`` was assigned and a small held-out batch ``H`` (the
same on every member). The score is the drop *per token claimed*, relative to the round's median
positive one and clipped to [-1, 1]: an honest peer scores about 1 whatever its speed (a slow
peer trained on fewer tokens and is weighted by fewer tokens already, so it is not scored down
for it), a peer that sends nothing scores 0, one that makes the model worse scores below 0, and
one that inflates its claim scores its true drop over its false claim.

A rating over rounds (an exponential average, ``decay`` per round when a peer scores below its
rating and the slower ``regain_decay`` when above: trust is lost fast and regained slowly; a new
peer starts at its first score) sets each peer's weight: ``tokens x rating`` when the rating is
at least ``threshold``, 0 below. Updates that repeat one seen in an earlier round (a replay, or a
copycat resending a peer's update) and all-zero updates are marked (:class:`ReplayCheck`) and
score 0 without being evaluated.

Peers are measured in turn (:meth:`farlink.sync.exchange.Exchange.turn`): each member measures
``turns`` other peers per round (the next ones in name order, one further each round), so every
peer is measured by ``turns`` others and never by itself. The members then exchange what they
measured and their ratings so far, and each peer's drop per token and prior rating are the
medians of the reports: the same numbers on every member (so one aggregate), whatever a
minority of lying members reports, whatever a joiner (no ratings yet) or hardware that rounds
differently computes.

An update much longer than the round's usual one is also judged in its *direction*: scaled to
the round's median length (its drop per token scaled alike), it must lower the loss too. A long
step reversed against the honest direction can lower the loss by its length alone early in
training (IPM, ``-eps mu`` with eps=4, did for three rounds); at an honest length it raises it.

An update is also judged as the aggregate will use it, not only applied alone: its share of the
token-weighted mean, added to the round's coordinate-median step, must not raise the held-out
loss above where the same share of the median step itself takes it by more than half of what
that step lowered it (:meth:`LossScorer._undoing`). A step
applied alone can lower the loss in either direction early in training (at H=20 the nano model's
loss fell by 1.47 a step of the honest mean's length *reversed* and by 1.2 four times that), so
IPM's update, ``-4 mu``, scored like an honest one for its first rounds; as a quarter of the mean
at the others' step, it returns the model to where the round started.

Cost per member and round: ``3 + 4 x turns`` forward passes of ``rows`` sequences (the held-out
batch at ``theta``, at the median step and at the median step plus a share of itself (one per
distinct share: one when the peers claim alike); each measured peer's held-out batch moved, its
shard batch at ``theta`` and moved, the held-out batch at the median step plus its share),
whatever the number of peers, plus 3 for each measured long step, against ``H x batch``
sequences forward and backward of the round's training; :attr:`LossScorer.seconds` measures it
in time and :attr:`LossScorer.sequences` in sequences run forward (a training sequence's forward
and backward cost about 3 forwards).
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

Batch = tuple[torch.Tensor, torch.Tensor]
#: cosine similarity above which an update counts as a copy of one seen in an earlier round
REPLAY_SIMILARITY = 0.999
#: an update longer than this times the round's (lower) median norm is also judged in its
#: direction, scaled to that norm (see :meth:`LossScorer.measure`)
LONG_STEP = 1.25
#: a peer whose share of the mean, added to the round's median step, raises the held-out loss
#: above a typical share's by more than this times its weight in the mean times what that step
#: lowered it is judged harmful (see :meth:`LossScorer._undoing`): 0.5 of the gain for a quarter
#: of the mean, 0.25 for an eighth
UNDOES = 2.0
#: ... and only where the median step lowers the held-out loss by at least this fraction of it:
#: a smaller gain is within the noise of a few sequences (the last round of a clean H=10 run:
#: 0.15%, and honest shares then measured up to 6 times it), and by then a harmful update's own
#: step raises the loss (IPM's did from its third round on)
MIN_GAIN = 0.01


def _norm(update: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in update.values()))


@dataclass
class Verdict:
    """One peer's judgement in one round."""

    score: float  # this round's score in [-1, 1] (0 for a marked update)
    rating: float  # the rating over rounds, this round included
    drop: float | None = None  # the loss drop per claimed token (None: not evaluated)
    mark: str | None = None  # why it earns nothing this round: free_rider, replay, harmful, ...
    factor: float = 0.0  # what its token weight is multiplied by (the agreed rating's factor)


class ReplayCheck:
    """Marks an all-zero update (a free rider) and one that repeats an update seen in one of
    the last ``memory`` rounds (a replay, or a copycat resending a peer's update), from a fixed
    seeded sample of ``probe`` coordinates: a copy has cosine near 1 with its original, two
    honest updates of different rounds or peers do not."""

    def __init__(self, memory: int = 2, probe: int = 4096) -> None:
        self.probe = probe
        self.memory = memory
        self._seen: dict[int | None, dict[str, torch.Tensor]] = {}  # round -> its probes
        self._index: dict[str, torch.Tensor] = {}

    def marks(self, updates: dict[str, dict[str, torch.Tensor]],
              round_id: int | None = None) -> dict[str, str]:
        """peer -> why its update earns nothing; remembers this round's updates. An update is
        compared with those of *other* rounds only: a round that failed and is tried again
        carries the same honest updates, which are no replay."""
        probes = {p: self._probe_of(u) for p, u in updates.items()}
        earlier = [seen for r, seen in self._seen.items() if r is None or r != round_id]
        out = {p: m for p, probe in probes.items()
               if (m := self._mark(probe, earlier)) is not None}
        self._seen.pop(round_id, None)
        self._seen[round_id] = probes
        while len(self._seen) > self.memory:
            del self._seen[next(iter(self._seen))]
        return out

    def _probe_of(self, update: dict[str, torch.Tensor]) -> torch.Tensor:
        total = sum(t.numel() for t in update.values())
        parts = []
        for name in sorted(update):
            flat = update[name].detach().reshape(-1)
            index = self._index.get(name)
            if index is None or (index.numel() and int(index.max()) >= flat.numel()):
                count = max(1, math.ceil(self.probe * flat.numel() / max(total, 1)))
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                index = torch.randint(flat.numel(), (min(count, flat.numel()),), generator=gen)
                self._index[name] = index
            parts.append(flat[index.to(flat.device)].double().cpu())
        return torch.cat(parts) if parts else torch.zeros(1, dtype=torch.float64)

    # --- resume ----------------------------------------------------------------------------------
    def state(self) -> tuple[list, dict[str, torch.Tensor]]:
        """What a checkpoint keeps: ``[[round, [peer, ...]], ...]`` (oldest round first) and
        the remembered probes as tensors ``replay.I`` in that order, so a copy of an update of
        the last rounds before a restart is still marked after it."""
        index, tensors = [], {}
        for round_id, probes in self._seen.items():
            index.append([round_id, sorted(probes)])
            for peer in sorted(probes):
                tensors[f"replay.{len(tensors)}"] = probes[peer].clone()
        return index, tensors

    def load_state(self, index: list, tensors: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state` (the probes on the CPU, where they are compared, whatever
        device a framework loaded its checkpoint to)."""
        seen, count = {}, 0
        for round_id, peers in index:
            seen[None if round_id is None else int(round_id)] = {
                str(peer): tensors[f"replay.{count + i}"].to("cpu", torch.float64)
                for i, peer in enumerate(peers)}
            count += len(peers)
        self._seen = seen

    @staticmethod
    def _mark(probe: torch.Tensor, rounds: list[dict[str, torch.Tensor]]) -> str | None:
        norm = float(probe.norm())
        if norm == 0.0:
            return "free_rider: an all-zero update"
        for earlier in rounds:
            for other, seen in earlier.items():
                if seen.shape == probe.shape and float(seen.norm()) > 0:
                    cos = float(probe @ seen) / (norm * float(seen.norm()))
                    if cos > REPLAY_SIMILARITY:
                        return f"replay: repeats {other}'s update of an earlier round"
        return None


class LossScorer:
    """Scores each peer's update by the loss drop it gives (see the module doc).

    ``model``: a module whose ``forward(inputs, targets)`` returns ``(logits, loss)``;
    ``base()``: the named parameters the round's updates are relative to (DiLoCo's global
    parameters: an update ``delta`` moves them to ``theta - delta``); ``assigned(peer, round_id)``:
    a small batch of the shard ``peer`` was assigned (None when its shard is unknown: then the
    held-out batch alone judges it); ``heldout``: a small held-out batch.
    """

    def __init__(self, model: nn.Module, base: Callable[[], dict[str, torch.Tensor]],
                 assigned: Callable[[str, int], Batch | None], heldout: Batch,
                 threshold: float = 0.25, decay: float = 0.5, turns: int = 3,
                 regain_decay: float = 0.75) -> None:
        for what, value in (("decay", decay), ("regain decay", regain_decay)):
            if not 0 <= value < 1:
                raise ValueError(f"rating {what} must be in [0, 1), got {value}")
        self.regain_decay = regain_decay
        self.model, self.base, self.assigned, self.heldout = model, base, assigned, heldout
        if turns < 1:
            raise ValueError(f"each member must measure at least one peer, got turns={turns}")
        self.threshold, self.decay, self.turns = threshold, decay, turns
        self.ratings: dict[str, float] = {}
        self.history: list[tuple[int, dict[str, float]]] = []  # (round, agreed ratings)
        self.seconds = 0.0  # time spent scoring, all rounds together
        #: sequences the scorer ran forward, all rounds together: its cost in a unit the
        #: machine's load does not change (a training sequence costs about 3: forward, backward)
        self.sequences = 0
        self.rounds = 0

    # --- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The ratings and counters a checkpoint keeps (JSON), so a restarted member, or a whole
        run resumed, still weighs a peer by its record: an attacker's bad rounds are not
        forgotten by restarting. The per-round history (for plots) is not kept."""
        return {"ratings": dict(self.ratings), "rounds": self.rounds, "seconds": self.seconds,
                "sequences": self.sequences}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a rating that is not a finite number in [-1, 1] is
        refused (a checkpoint is verified by its digests, but it may come from another farlink)."""
        ratings = {str(p): float(r) for p, r in dict(state["ratings"]).items()}
        wrong = [p for p, r in ratings.items() if not (math.isfinite(r) and -1 <= r <= 1)]
        if wrong:
            raise ValueError(f"ratings out of [-1, 1] for {', '.join(sorted(wrong))}")
        rounds, seconds = int(state.get("rounds", 0)), float(state.get("seconds", 0.0))
        sequences = int(state.get("sequences", 0))
        self.ratings, self.rounds, self.seconds = ratings, rounds, seconds
        self.sequences = sequences

    # --- the round's judgement -----------------------------------------------------------------
    def judge(self, round_id: int, updates: dict[str, dict[str, torch.Tensor]],
              tokens: dict[str, float], marks: dict[str, str] | None = None) -> dict[str, Verdict]:
        """One member alone: :meth:`measure` every peer, then :meth:`rate` on its own numbers."""
        judged = [p for p in updates if tokens.get(p, 0.0) > 0]
        drops = self.measure(round_id, updates, tokens, judged, marks)
        return self.rate(round_id, drops, {p: self.ratings.get(p) for p in judged}, judged,
                         marks)

    def measure(self, round_id: int, updates: dict[str, dict[str, torch.Tensor]],
                tokens: dict[str, float], evaluate: list[str],
                marks: dict[str, str] | None = None) -> dict[str, float]:
        """The loss drop per claimed token of each peer of ``evaluate`` that claimed tokens
        and is not marked (``marks``: :class:`ReplayCheck`'s, earning nothing whatever they
        do); the cost counted in :attr:`seconds`.

        An update more than :data:`LONG_STEP` times as long as the round's median one is also
        measured scaled down to that median length, per token scaled alike, and keeps the
        smaller of the two: a long step can lower the loss by its length alone while its
        direction raises it (IPM at eps=4 early in training: measured as sent, it beat every
        honest update for three rounds). An honest update that is long because its peer
        trained more still descends in its direction and keeps its drop per token."""
        started = time.perf_counter()
        marks = marks or {}
        chosen = [p for p in evaluate if tokens.get(p, 0.0) > 0 and p not in marks]
        base = {n: t.detach() for n, t in self.base().items()}
        at_base = self._loss(base, self.heldout) if chosen else 0.0
        norms = {p: _norm(u) for p, u in updates.items()
                 if tokens.get(p, 0.0) > 0 and p not in marks}
        ordered = sorted(norms.values())
        usual = ordered[(len(ordered) - 1) // 2] if ordered else 0.0  # the lower median
        undone = self._undoing(base, at_base, updates, tokens, sorted(norms), chosen)
        out = {}
        for p in chosen:
            drop = self._drop(base, at_base, updates[p], p, round_id) / tokens[p]
            if usual > 0 and norms[p] > LONG_STEP * usual:
                # a long step: judged in its direction too, at the usual length
                k = usual / norms[p]
                scaled = {n: k * t for n, t in updates[p].items()}
                drop = min(drop, self._drop(base, at_base, scaled, p, round_id) / (k * tokens[p]))
            if p in undone:
                drop = min(drop, -abs(drop))  # it undoes the others' step: harmful
            out[p] = drop
        self.seconds += time.perf_counter() - started
        return out

    def _undoing(self, base: dict[str, torch.Tensor], at_base: float,
                 updates: dict[str, dict[str, torch.Tensor]], tokens: dict[str, float],
                 pool: list[str], chosen: list[str]) -> set[str]:
        """The peers of ``chosen`` whose share of the aggregate, per unit of their weight in
        it, undoes more than :data:`UNDOES` times the step the others agree on, on the held-out
        batch.

        The others' step is the coordinate median ``c`` of the ``pool``'s updates (an
        attacker among a majority of honest peers barely moves it); a peer's share is its
        update times its weight ``a`` in the token-weighted mean (``tokens[p] / sum``), as the
        mean would add it. Its effect is compared with a typical share's, the median step's:
        ``L(theta - c - a u_p) - L(theta - c - a c)``, over the median step's own gain
        ``L(theta) - L(theta - c)`` times ``a``: both the effect of a share and its spread
        among honest peers grow with its weight, so one bound holds for a quarter of the mean
        and an eighth (two IPM attackers of eight each weigh an eighth and together reverse
        the mean as one of four does). An honest share points where the median step does and
        differs from it by a fraction of the gain (``bench attack``, on the 2 held-out
        sequences, a quarter of the mean: within 0.25 of the gain). Compared with
        ``L(theta - c)`` instead, late rounds whose median step lowers these sequences' loss
        little and has overshot them put honest shares at up to 0.7 of the gain. IPM's share (``-eps mu / n``) walks the median step
        back: at eps=4 among four it returns the model to ``theta`` (more than the whole gain),
        however much its own step lowered the loss applied alone (early in training a step of
        four honest lengths reversed does: the loss is nearly even in that direction at first,
        see docs/trust.md). Needs three peers in the pool (the median of two is their mean)
        and a median step that lowers the held-out loss by :data:`MIN_GAIN` of it (else there
        is nothing to undo, or too little to tell from the few sequences' noise)."""
        if len(pool) < 3 or not chosen:
            return set()
        total = sum(tokens[p] for p in pool)
        names = [n for n in updates[pool[0]] if n in base]
        median = {n: torch.stack([updates[p][n].to(base[n]) for p in pool]).median(dim=0).values
                  for n in names}
        stepped = {n: base[n] - median[n] if n in median else base[n] for n in base}
        at_median = self._loss(stepped, self.heldout)
        gain = at_base - at_median
        if not gain > MIN_GAIN * abs(at_base):  # within the held-out batch's noise
            return set()
        typical: dict[float, float] = {}  # share -> the loss with that share of the median step
        out = set()
        for p in chosen:
            share = tokens[p] / total
            if share not in typical:
                typical[share] = self._loss(
                    {n: stepped[n] - share * median[n] if n in median else stepped[n]
                     for n in stepped}, self.heldout)
            moved = {n: stepped[n] - share * updates[p][n].to(base[n]) if n in median
                     else stepped[n] for n in stepped}
            if self._loss(moved, self.heldout) - typical[share] > UNDOES * share * gain:
                out.add(p)
        return out

    def rate(self, round_id: int, per_token: dict[str, float],
             priors: dict[str, float | None], judged: list[str],
             marks: dict[str, str] | None = None) -> dict[str, Verdict]:
        """Verdicts of the ``judged`` peers from their loss drops per token (``per_token``;
        agreed among the members) and their ratings before this round (``priors``, None for
        a new peer): the score is the drop per token over the round's median positive one,
        clipped to [-1, 1] (0 for a marked peer, and for one nobody measured), and the rating
        ``decay x prior + (1 - decay) x score`` (a new peer: its score), or with
        ``regain_decay`` in place of ``decay`` when the score is above the prior: trust is lost
        fast and regained slowly. Why: ALIE at z=3 raises the loss in the rounds after it first
        sees the others' updates and helps afterwards; regained at the rate it was lost, its
        rating was back above an honest peer's after one noisy honest round (0.87 against 0.76
        in ``bench attack``), and it is the record, not the last rounds, that tells them apart.
        Adopts the ratings."""
        marks = marks or {}
        positive = sorted(v for p, v in per_token.items() if v > 0 and p not in marks)
        reference = positive[(len(positive) - 1) // 2] if positive else None
        verdicts = {}
        for p in judged:
            value = per_token.get(p)
            if p in marks or value is None:
                score = 0.0
            elif reference is None:
                score = -1.0 if value < 0 else 0.0
            else:
                score = max(-1.0, min(1.0, value / reference))
            prior = priors.get(p)
            if prior is None:
                rating = score
            else:
                keep = self.regain_decay if score > prior else self.decay
                rating = keep * prior + (1 - keep) * score
            self.ratings[p] = rating
            mark = marks.get(p) or ("harmful" if score < 0 else None)
            verdicts[p] = Verdict(score, rating, value, mark)
        self.history.append((round_id, {p: v.rating for p, v in verdicts.items()}))
        self.rounds += 1
        return verdicts

    def factor(self, rating: float) -> float:
        """The weight multiplier of a peer rated ``rating``: the rating itself (at most 1) when
        it reaches the threshold, else 0."""
        return min(1.0, rating) if rating >= self.threshold and rating > 0 else 0.0

    # --- parts -----------------------------------------------------------------------------------
    def _drop(self, base: dict[str, torch.Tensor], heldout_at_base: float,
              update: dict[str, torch.Tensor], peer: str, round_id: int) -> float:
        """The loss drop of ``base - update`` on the held-out batch and on ``peer``'s own."""
        moved = {n: base[n] - update[n].to(base[n]) for n in update if n in base}
        drop = heldout_at_base - self._loss(moved, self.heldout)
        mine = self.assigned(peer, round_id)
        if mine is not None:
            drop += self._loss(base, mine) - self._loss(moved, mine)
        return drop

    @torch.no_grad()
    def _loss(self, params: dict[str, torch.Tensor], batch: Batch) -> float:
        device = next(iter(params.values())).device
        was_training = self.model.training
        self.model.eval()
        try:
            inputs, targets = batch
            _, loss = functional_call(self.model, params, (inputs.to(device), targets.to(device)))
            self.sequences += int(inputs.shape[0])
        finally:
            self.model.train(was_training)
        return float(loss)
