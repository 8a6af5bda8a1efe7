"""One round's exchange of named tensors: encode, sign, gather, verify, validate, aggregate.

This is the only place where an algorithm's update leaves the worker. Three paths:

* dense: fp32, plain token-weighted mean, no authentication -> one ring all-reduce of
  ``weight * tensor`` plus the weight (the cheapest exact path, used by DDP and plain DiLoCo);
* allreduce: a dense codec (fp32, fp16, bf16, int8, int4, with or without error feedback), any
  whole-update rule, with or without authentication, on a collective with a real all-to-all ->
  the compressed all-reduce of :mod:`farlink.sync.allreduce` (about ``2 (n-1)/n x payload`` per
  peer whatever n is, the same whole-update decisions as the gathered path);
* gathered: anything else (sparse or pre-encoded payloads, an algorithm's own ``combine``,
  ``+per_tensor`` rules, a collective without an all-to-all, or ``path="gathered"``) -> every
  peer's update is encoded by the codec, packed in an envelope,
  signed, all-gathered as real bytes, and each received message is verified, decoded and checked
  before a (possibly Byzantine-robust) aggregator combines them. A message that fails any check is
  dropped with its reason logged (and recorded in the ledger); the round goes on without it.
  Accepted updates are credited in the ledger once their round commits (:meth:`Exchange.settle`).

An algorithm whose update *is* a codec's output (DeMo's DCT top-k, SparseLoCo's sparse 2-bit
values) hands over :class:`Encoded` entries: their bytes are sent as they are, so what peers
decode is exactly what the sender took out of its error-feedback state (re-encoding a decoded
tensor would not give back the same bytes). Such an algorithm may also average the accepted
payloads its own way (DeMo averages each DCT coefficient over the peers that sent it): the
exchange is then built with that ``combine`` (the composition root asks the algorithm class for
its codec and combine before building the exchange, :meth:`SyncAlgorithm.wire_compressor` and
:meth:`SyncAlgorithm.wire_combine`); Byzantine-robust rules still see the decoded dense updates.

What an exchange is built with, it keeps: ``compressor``, ``combine`` and ``scorer`` are
read-only, so no object rewires another's exchange after construction (every member of a run
decides its path from them, and a swap after the first round would leave members disagreeing).

Around the update itself the gathered path checks the seams a member controls: each claimed token
count is bounded (:mod:`farlink.robust.weights`; the ledger credits the bounded count), one
identity (signing key or sender name) found in two slots is dropped in both, members compare a
digest of every slot they received so a member that sends different updates to different
receivers fails the round everywhere and is named (:mod:`farlink.robust.equivocation`), and an
aggregate that is not finite is never handed to the algorithm.

Accounting that cannot be inflated (gathered path): a peer is credited at most one round's
tokens (``round_allowance``), nothing when it claimed more than the run allows (``inflated``),
and nothing for an all-zero update or one that repeats an update of an earlier round
(:class:`farlink.robust.score.ReplayCheck`); the ledger marks each. With a ``scorer``
(:class:`farlink.robust.score.LossScorer`, ``--score loss``) every member also scores each
peer's update by the loss drop it gives, the members agree on each peer's rating (the median of
their signed reports, checked for equivocation like the updates), and each peer weighs
``tokens x factor(rating)``: a peer rated under the threshold is left out of the round and named.
Scoring needs each peer's whole update, so a scored run takes the gathered path: an owner of the
compressed all-reduce holds one shard of every update, and a loss is not a sum over shards.

Robust rules aggregate each peer's whole update, flattened into one vector (Krum picks one peer,
centered clipping bounds the whole update's norm); ``NAME+per_tensor`` applies them tensor by
tensor instead (see :mod:`farlink.robust.aggregators`).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from farlink.codecs import (
    BFloat16Codec,
    BlockQuantCodec,
    CodecError,
    Compressor,
    Float16Codec,
    Float32Codec,
    envelope,
    make_compressor,
)
from farlink.comm.base import Collective
from farlink.comm.errors import CommError
from farlink.robust.aggregators import Aggregator, PerTensor, make_aggregator, weighted_mean
from farlink.robust.auth import Authenticator, AuthError
from farlink.robust.score import LossScorer, ReplayCheck
from farlink.robust.equivocation import SLOT_DIGEST, differing_slots, slot_digests
from farlink.robust.validate import UpdateRejected, check_update, screen_norms
from farlink.robust.weights import CLAIM_FACTOR, bound_claims
from farlink.sync.allreduce import ShardedReduce, planned_bytes, rule_of
from farlink.sync.result import ExchangeResult

log = logging.getLogger(__name__)

PATHS = ("auto", "allreduce", "gathered")
SCORES = ("none", "loss")
#: codecs whose payload is a dense tensor: their shards can be averaged by their owner
DENSE_CODECS = (Float32Codec, Float16Codec, BFloat16Codec, BlockQuantCodec)


@dataclass(frozen=True)
class Encoded:
    """An update already encoded by the exchange's codec: ``payload`` goes on the wire as is;
    ``tensor`` is its decoded form (what every receiver reconstructs), used for its shape and
    by an emulated attacker that tampers with the dense update."""

    payload: bytes
    tensor: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape


Update = dict[str, "torch.Tensor | Encoded"]
# name, the accepted peers' payloads of that tensor, its shape, the device the combined tensor
# is built on (the update's own) -> the combined dense tensor
Combine = Callable[[str, list[bytes], torch.Size, torch.device], torch.Tensor]
# an emulated attacker's rewrite of its own dense update: (update, round_id) -> update
Tamper = Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]]


def dense_of(value: torch.Tensor | Encoded) -> torch.Tensor:
    return value.tensor if isinstance(value, Encoded) else value


class Exchange:
    def __init__(
        self,
        collective: Collective,
        compressor: Compressor,
        sender: str,
        aggregator: Aggregator = weighted_mean,
        authenticator: Authenticator | None = None,
        max_update_norm: float | None = None,
        ledger=None,
        tamper: Tamper | None = None,
        screen_ratio: float | None = None,
        max_weight: float | None = None,
        claim_factor: float | None = CLAIM_FACTOR,
        path: str = "auto",
        scorer: LossScorer | None = None,
        round_allowance: float | None = None,
        combine: Combine | None = None,
    ) -> None:
        self.collective = collective
        self._compressor = compressor
        self.sender = sender
        self.aggregator = aggregator
        self.authenticator = authenticator or Authenticator()
        self.max_update_norm = max_update_norm
        self.ledger = ledger
        self._tamper = tamper  # an emulated attacker's rewrite of this peer's updates
        self.screen_ratio = screen_ratio  # reject updates with norm > ratio x the round's median
        # bounds on a claimed token count (see farlink.robust.weights): the tokens one peer can
        # process in a round, and the factor over the round's median claim
        self.max_weight, self.claim_factor = max_weight, claim_factor
        self._combine = combine  # an algorithm's own average of the accepted payloads
        if path not in PATHS:
            raise ValueError(f"exchange path {path!r}: choose from {', '.join(PATHS)}")
        #: "auto": the cheapest path that is exact enough; "allreduce" or "gathered" by choice
        self.path = path
        self.last_path = ""  # the path of the last round, for the run's metrics
        self._scorer = scorer  # loss-scored contributions (None: weights are the bounded claims)
        #: tokens one peer can process in one round: the most one round credits it with
        self.round_allowance = round_allowance
        self.replays = ReplayCheck()

    @property
    def compressor(self) -> Compressor:
        """The codec (and its error feedback) of every payload this exchange sends."""
        return self._compressor

    @property
    def combine(self) -> Combine | None:
        """The algorithm's own average of the accepted payloads (None: the aggregator's)."""
        return self._combine

    @property
    def scorer(self) -> LossScorer | None:
        """The loss scorer of ``--score loss`` (None: weights are the bounded claims)."""
        return self._scorer

    @property
    def tamper(self) -> Tamper | None:
        """An emulated attacker's rewrite of this peer's dense update, ``(update, round_id) ->
        update``, before it is encoded (:mod:`farlink.robust.attacks`; None: an honest peer)."""
        return self._tamper

    @property
    def dense(self) -> bool:
        return (
            self.compressor.codec.name == "fp32"
            and not self.compressor.error_feedback
            and self.aggregator is weighted_mean
            and self.authenticator.name == "none"
            and self.scorer is None  # scores need each peer's update
            and self.collective.exact_all_reduce
        )  # decided by the run's configuration alone, so every peer takes the same path

    def gathered_reason(self, tensors: Update | None = None) -> str | None:
        """Why a round of ``tensors`` cannot take the compressed all-reduce (None: it can)."""

        if self.path == "gathered":
            return "chosen (path=gathered)"
        if self.scorer is not None:
            return "loss scoring needs each peer's whole update (an owner holds one shard)"
        if not self.collective.native_all_to_all and (
                self.path == "auto"
                or type(self.collective).all_to_all_bytes is Collective.all_to_all_bytes):
            return (f"{type(self.collective).__name__} has no all-to-all (none at all, or a "
                    "group member behind NAT that takes no pushes)")
        if not isinstance(self.compressor.codec, DENSE_CODECS):
            return f"codec {self.compressor.codec.name} is sparse: the union of payloads does " \
                "not shrink"
        if tensors is not None and any(isinstance(t, Encoded) for t in tensors.values()):
            return "the algorithm hands over pre-encoded payloads"
        if self.combine is not None:
            return "the algorithm combines payloads itself"
        if rule_of(self.aggregator) is None:
            return "a +per_tensor rule: tensor boundaries do not follow shards"
        if self.path == "auto" and tensors:
            members = self.collective.round_members()
            sharded, gathered = self.path_bytes(tensors, members)
            if sharded >= gathered:
                return (f"the gathered path is cheaper for an update this small ({gathered} "
                        f"against {sharded} bytes per peer over {members} members)")
        return None

    def path_bytes(self, tensors: Update, members: int) -> tuple[int, int]:
        """Bytes one peer sends in a round of ``tensors`` on the compressed all-reduce and
        on the gathered path, headers included (what ``auto`` compares)."""

        codec, n = self.compressor.codec, members
        shapes = {k: tuple(dense_of(t).shape) for k, t in tensors.items()}
        signed = len(self.authenticator.sign(b""))
        header = len(envelope.pack(self.sender, 0, 1.0, {k: b"" for k in shapes}, shapes,
                                   {k: torch.float32 for k in shapes})) + signed
        message = header + sum(codec.max_payload_nbytes(s) for s in shapes.values())
        gathered = (n - 1) * message + (n - 1) * n * SLOT_DIGEST
        return planned_bytes(self, sum(math.prod(s) for s in shapes.values()), n), gathered

    def sharded_reduce(self):  # noqa: ANN201 - farlink.sync.allreduce.ShardedReduce
        """One round of the compressed all-reduce over this exchange's parts."""

        return ShardedReduce(self)

    def average(self, tensors: Update, weight: float, round_id: int) -> ExchangeResult:
        """Token-weighted aggregate of every participant's ``tensors`` for this round.

        Entries may be :class:`Encoded` (sent as they are; the run then takes the gathered path).
        """
        if self.tamper is not None:  # an emulated attacker: its update is re-encoded below
            tensors = self.tamper({n: dense_of(t) for n, t in tensors.items()}, round_id)
            weight *= getattr(self.tamper, "claim_factor", 1.0)  # an inflated token claim
        if self.dense and not any(isinstance(t, Encoded) for t in tensors.values()) \
                and self.path != "allreduce":
            self.last_path = "dense"
            result = self._all_reduce(tensors, weight)
        elif self.path != "gathered" and tensors and self.gathered_reason(tensors) is None:
            self.last_path = "allreduce"
            result = self.sharded_reduce().run(tensors, weight, round_id)
        else:
            if self.path == "allreduce":
                raise ValueError(f"path=allreduce: {self.gathered_reason(tensors)}")
            self.last_path = "gathered"
            result = self._gather(tensors, weight, round_id)
        result.path = self.last_path
        return result

    def _all_reduce(self, tensors: dict[str, torch.Tensor], weight: float) -> ExchangeResult:
        names = list(tensors)
        flat = torch.cat([tensors[n].detach().float().reshape(-1) * weight for n in names])
        device = flat.device
        flat = torch.cat([flat, torch.tensor([weight], dtype=torch.float32, device=device)])
        # the wire is host memory (Gloo and hivemind move bytes over host sockets): one copy
        # there and back, none on the CPU, where ``cpu()`` is the tensor itself
        wire = flat.cpu()
        self.collective.all_reduce_sum([wire])
        flat = wire.to(device)
        total = float(flat[-1])
        if not torch.isfinite(flat).all():
            # a peer sent NaN/Inf: a sum cannot say who, so the whole round is dropped everywhere
            log.warning("round dropped: the all-reduced update is not finite")
            return ExchangeResult({}, 0.0, rejected={"aggregate": "nonfinite: all-reduced sum"})
        out, offset = {}, 0
        for n in names:
            numel = tensors[n].numel()
            chunk = flat[offset : offset + numel].reshape(tensors[n].shape)
            out[n] = chunk / total if total > 0 else torch.zeros_like(chunk)
            offset += numel
        return ExchangeResult(out, total)

    def _gather(self, tensors: Update, weight: float, round_id: int) -> ExchangeResult:
        payloads = {n: t.payload if isinstance(t, Encoded) else self.compressor.encode(n, t)
                    for n, t in tensors.items()}
        message = envelope.pack(
            self.sender, round_id, weight, payloads,
            {n: tuple(t.shape) for n, t in tensors.items()},
            {n: torch.float32 for n in tensors},
        )
        received = self.collective.all_gather_bytes(self.authenticator.sign(message))
        result = ExchangeResult({}, 0.0)
        if self._equivocation(received, round_id, result):
            return result
        opened: dict[int, tuple[str, envelope.Envelope]] = {}
        slots: dict[str, list[int]] = {}  # identity -> the slots it was found in
        for index, raw in enumerate(received):
            if not raw:  # nothing arrived from this member: the collective failed the round
                log.info("no update from member %d in round %d", index, round_id)
                continue
            peer = f"rank{index}"
            try:
                signer, body = self.authenticator.open(raw)
                peer = signer or envelope.sender_of(body) or peer  # to name it if refused
                env = envelope.unpack(body)
                if signer is not None and signer != env.sender:
                    raise UpdateRejected(
                        f"signed by {signer} but claims to be {env.sender}", "impersonation")
                peer = signer or env.sender
                opened[index] = (peer, env)
                slots.setdefault(peer, []).append(index)
            except (CodecError, AuthError, UpdateRejected) as exc:
                self._reject(result, peer, round_id, 0.0, exc)
        decoded: dict[str, dict[str, torch.Tensor]] = {}
        raw_payloads: dict[str, dict[str, bytes]] = {}
        claimed: dict[str, float] = {}
        for index, (peer, env) in opened.items():
            if len(slots[peer]) > 1:  # a copy in another member's slot: which is its own?
                self._reject(result, peer, round_id, env.weight, UpdateRejected(
                    f"{peer} found in slots {slots[peer]} of round {round_id}; one member "
                    "sent another's update as its own, so all of them are dropped",
                    "duplicate"))
                continue
            try:
                decoded[peer] = self._decode(env, tensors, round_id)
                claimed[peer] = env.weight
                raw_payloads[peer] = env.payloads
            except (CodecError, UpdateRejected) as exc:
                self._reject(result, peer, round_id, env.weight, exc)
        for peer, reason in screen_norms(decoded, self.screen_ratio).items():
            del decoded[peer]
            self._reject(result, peer, round_id, claimed[peer], UpdateRejected(reason, "norm"))
        if not decoded:
            return result
        observe = getattr(self.tamper, "observe", None)
        if observe is not None:  # an emulated adaptive attacker learns what it received
            observe({p: d for p, d in decoded.items() if p != self.sender}, round_id)
        peers = list(decoded)
        bounded, capped = bound_claims({p: claimed[p] for p in peers}, self.max_weight,
                                       self.claim_factor)
        marks = self._marks(decoded, claimed, round_id)
        factors = None
        if self.scorer is not None:
            factors = self._score(decoded, bounded, marks, round_id, result)
            if factors is None:  # a member reported different ratings to different members
                return result
            for peer in list(peers):
                if bounded[peer] > 0 and factors[peer] <= 0:
                    peers.remove(peer)
                    score, rating = result.scores[peer]
                    kind, why = "score", (f"discounted: loss score {score:+.2f}, rating "
                                          f"{rating:.2f} under {self.scorer.threshold:g}")
                    if peer in marks:  # counted by its mark: free_rider, replay, inflated
                        kind, _, why = marks[peer].partition(": ")
                        why = f"discounted: {why}"
                    self._reject(result, peer, round_id, claimed[peer],
                                 UpdateRejected(why, kind))
            if not peers:
                return result
        for peer in peers:
            result.accepted.append(peer)
            result.tokens[peer], result.claimed[peer] = bounded[peer], claimed[peer]
            result.credited[peer] = 0.0 if peer in marks else self._credit(bounded[peer])
            if peer in marks:
                result.marks[peer] = marks[peer]
                log.warning("round %d: %s is credited 0 tokens: %s", round_id, peer,
                            marks[peer])
            if peer in capped:
                result.capped[peer] = capped[peer]
                log.warning("round %d: %s %s; it counts as %.4g tokens", round_id, peer,
                            capped[peer], bounded[peer])
        if factors is not None:
            bounded = {p: bounded[p] * factors[p] for p in peers}
        device = dense_of(next(iter(tensors.values()))).device if tensors else None
        # weights relative to the largest (in float64 first): a rule only uses their ratios,
        # and their sum in float32 could overflow
        result.total_weight = sum(bounded[p] for p in peers)
        top = max(bounded[p] for p in peers)
        w = torch.tensor([bounded[p] / top if top > 0 else 0.0 for p in peers],
                         dtype=torch.float32, device=device)
        if self.combine is not None and self.aggregator is weighted_mean:
            senders = [p for p in peers if bounded[p] > 0]  # a zero-weight peer only receives
            result.tensors = {
                n: self.combine(n, [raw_payloads[p][n] for p in senders], dense_of(t).shape,
                                dense_of(t).device)
                for n, t in tensors.items()
            } if senders else {n: torch.zeros(dense_of(t).shape, device=dense_of(t).device)
                               for n, t in tensors.items()}
        else:
            result.tensors = self._aggregate(peers, decoded, w, list(tensors))
        bad = [n for n, t in result.tensors.items() if not torch.isfinite(t).all()]
        if bad:  # finite updates can still overflow float32 when combined
            log.warning("round %d dropped: the aggregate of %s is not finite (from %s); the "
                        "outer step is skipped on every member", round_id, ", ".join(bad[:3]),
                        ", ".join(peers))
            return ExchangeResult({}, 0.0, rejected={
                **result.rejected, "aggregate": f"nonfinite: aggregate of {', '.join(bad[:3])}"})
        return result

    def _credit(self, tokens: float) -> float:
        """What an accepted update of ``tokens`` (its bounded weight) earns: at most one
        round's tokens (on every path; the compressed all-reduce cannot see free riders)."""
        return tokens if self.round_allowance is None else min(tokens, self.round_allowance)

    def _marks(self, decoded: dict[str, dict[str, torch.Tensor]], claimed: dict[str, float],
               round_id: int) -> dict[str, str]:
        """Peers credited nothing this round, and why: an all-zero or replayed update
        (:class:`ReplayCheck`; a zero-claim peer only receives and is not marked), or a claim
        beyond what the run lets one peer process (``inflated``)."""
        marks = {p: m for p, m in self.replays.marks(decoded, round_id).items() if claimed[p] > 0}
        for peer in decoded:
            if self.max_weight is not None and claimed[peer] > self.max_weight:
                marks.setdefault(peer, f"inflated: claims {claimed[peer]:.4g} tokens, more than "
                                 f"the {self.max_weight:.4g} the run allows one peer")
        return marks

    def _score(self, decoded: dict[str, dict[str, torch.Tensor]], bounded: dict[str, float],
               marks: dict[str, str], round_id: int,
               result: ExchangeResult) -> dict[str, float] | None:
        """Each peer's weight factor. This member measures the loss drop of the peers whose
        turn it is (:meth:`turn`), every member reports its measures and its ratings so far
        (signed, all-gathered, checked for equivocation like the updates), and each peer's
        drop and prior rating are the medians of the reports: identical on every member, so
        every member weighs every peer alike (a joiner whose ratings start fresh, hardware
        whose numbers differ by rounding, a minority of members that lie). None when a member
        sent different reports to different members (the round fails, as for updates)."""
        judged = sorted(p for p in decoded if bounded[p] > 0)
        mine = self.scorer.measure(round_id, decoded, bounded, self.turn(judged, round_id),
                                   marks)
        report = json.dumps({"drops": mine, "marks": marks, "priors": {
            p: self.scorer.ratings[p] for p in judged if p in self.scorer.ratings}})
        received = self.collective.all_gather_bytes(self.authenticator.sign(report.encode()))
        if self._equivocation(received, round_id, result):
            return None
        drops: dict[str, list[float]] = {}
        priors: dict[str, list[float]] = {}
        marked: dict[str, list[str]] = {}
        reports = 0
        for raw in received:
            try:
                _, body = self.authenticator.open(raw)
                reported = json.loads(body)
                for peer, why in dict(reported["marks"]).items():
                    if peer in bounded and isinstance(why, str):
                        marked.setdefault(peer, []).append(why[:200])
                reports += 1
                for votes, key in ((drops, "drops"), (priors, "priors")):
                    for peer, value in dict(reported[key]).items():
                        if peer in bounded and isinstance(value, (int, float)) \
                                and math.isfinite(value):
                            votes.setdefault(peer, []).append(float(value))
            except (AuthError, ValueError, UnicodeDecodeError, KeyError, TypeError):
                continue  # a member's unreadable report is not a vote
        # marks by majority of the reports, as drops are by median: a member that has not seen
        # the earlier rounds (it resumed or joined) weighs every peer as the others do
        marks.clear()
        marks.update({p: sorted(whys)[0] for p, whys in marked.items() if 2 * len(whys) > reports})
        verdicts = self.scorer.rate(
            round_id, {p: statistics.median(v) for p, v in drops.items()},
            {p: max(-1.0, min(1.0, statistics.median(priors[p]))) if p in priors else None
             for p in judged}, judged, marks)
        factors = {p: 1.0 for p in decoded}  # a zero-claim peer weighs 0 whatever its factor
        for peer, verdict in verdicts.items():
            verdict.factor = 0.0 if peer in marks else self.scorer.factor(verdict.rating)
            factors[peer] = verdict.factor
            result.scores[peer] = (verdict.score, verdict.rating)
            if self.ledger is not None:
                self.ledger.record_score(peer, verdict.score, verdict.rating)
        return factors

    # --- resume ----------------------------------------------------------------------------------
    def trust_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What this member knows of its peers' records, for a checkpoint: the ledger (credits,
        marks), the scorer's ratings and the updates of the last rounds a replay is compared
        with; JSON and tensors (``trust.*``). Without it a restarted member, or a whole run
        resumed, would weigh an attacker as a newcomer again."""
        index, probes = self.replays.state()
        meta = {"replays": index,
                "ledger": self.ledger.to_dict() if self.ledger is not None else None,
                "scorer": self.scorer.state_dict() if self.scorer is not None else None}
        return meta, {f"trust.{k}": v for k, v in probes.items()}

    def load_trust_state(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`trust_state` (a checkpoint written without scoring restores no
        ratings). All or nothing: a malformed record, or a rating outside [-1, 1], is refused
        (``ValueError``) and this member's records stay as they were; none is dropped silently
        (the records come from a file or a framework's checkpoint, maybe of another farlink)."""
        before = self.trust_state()
        try:
            self._restore_trust_state(meta, tensors)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            self._restore_trust_state(*before)
            why = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"the saved record of this member's peers is refused ({why}); "
                             f"nothing of it was restored") from exc

    def _restore_trust_state(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.replays.load_state(meta["replays"], {k[len("trust."):]: v for k, v in tensors.items()
                                                  if k.startswith("trust.")})
        if self.ledger is not None and meta["ledger"] is not None:
            self.ledger.restore(meta["ledger"])
        if self.scorer is not None and meta["scorer"] is not None:
            self.scorer.load_state_dict(meta["scorer"])

    def turn(self, judged: list[str], round_id: int) -> list[str]:
        """The peers this member measures in round ``round_id``: the next ``scorer.turns`` of
        the others in name order, starting one further on each round. Every peer is measured
        by ``turns`` others and no member by itself; a member's cost stays bounded by ``turns``
        however many peers the round has."""
        ring = sorted(set(judged) | {self.sender})
        me, n = ring.index(self.sender), len(ring)
        if n == 1:
            return list(judged)
        others = [ring[(me + j) % n] for j in range(1, n)]
        start = round_id % len(others)
        rotated = others[start:] + others[:start]
        return [p for p in rotated[: self.scorer.turns] if p in judged]

    def _equivocation(self, received: list[bytes], round_id: int,
                      result: ExchangeResult) -> bool:
        """Compare with the groupmates a digest of every slot received; on a difference fail
        the round on this member (the collective then commits it nowhere), name the owner of
        each differing slot, and return True."""
        if len(received) < 2:
            return False
        reports = self.collective.all_gather_bytes(slot_digests(received))
        differing = differing_slots(reports, len(received))
        if not differing:
            return False
        named = []
        for slot, dissent in differing.items():
            peer = self._identity(received[slot], slot)
            named.append(peer)
            self._reject(result, peer, round_id, 0.0, UpdateRejected(
                f"member {slot} ({peer}) sent different updates to different members in round "
                f"{round_id} (members {dissent} received other bytes than the rest)",
                "equivocation"))
        self.collective.fail_round(CommError(
            f"round {round_id} not committed: {', '.join(named)} sent different updates to "
            "different members (equivocation), so replicas would diverge; the round is "
            "discarded everywhere and retried"), blame=sorted(differing))
        return True

    def _identity(self, raw: bytes, slot: int) -> str:
        """Who the update in ``slot`` says it is from (its signer or sender), for naming it."""
        try:
            signer, body = self.authenticator.open(raw)
            return signer or envelope.unpack(body).sender
        except (CodecError, AuthError):
            return f"rank{slot}"

    def _aggregate(self, peers: list[str], decoded: dict[str, dict[str, torch.Tensor]],
                   w: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
        """The aggregator over each peer's whole update (one flattened vector per peer), or
        tensor by tensor for a :class:`PerTensor` rule."""
        if isinstance(self.aggregator, PerTensor):
            return {n: self.aggregator(torch.stack([decoded[p][n] for p in peers]), w)
                    for n in names}
        flat = torch.stack([torch.cat([decoded[p][n].reshape(-1) for n in names])
                            for p in peers])
        combined, out, offset = self.aggregator(flat, w), {}, 0
        for n in names:
            ref = decoded[peers[0]][n]
            out[n] = combined[offset : offset + ref.numel()].reshape(ref.shape)
            offset += ref.numel()
        return out

    def settle(self, result: ExchangeResult | None, round_id: int, committed: bool) -> None:
        """Credit the accepted updates of a round in the ledger once the round committed: only
        then did they reach the model. A round that failed and is retried credits nothing, so a
        peer's accepted tokens are counted once per round, not once per attempt. (Rejections are
        recorded when they happen: the peer sent what it sent whatever the round's outcome.)"""
        if committed and result is not None and self.ledger is not None:
            for peer in result.accepted:
                self.ledger.record_accepted(peer, round_id, result.tokens[peer],
                                            claimed=result.claimed.get(peer),
                                            capped=peer in result.capped,
                                            credited=result.credited.get(
                                                peer, self._credit(result.tokens[peer])),
                                            mark=result.marks.get(peer))

    def _reject(self, result: ExchangeResult, peer: str, round_id: int, tokens: float,
                exc: Exception) -> None:
        reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
        result.rejected[peer] = reason
        log.warning("rejected update from %s in round %d: %s", peer, round_id, reason)
        if self.ledger is not None:
            self.ledger.record_rejected(peer, round_id, tokens, reason)

    def _decode(
        self, env: envelope.Envelope, expected: Update, round_id: int
    ) -> dict[str, torch.Tensor]:
        if env.round_id != round_id:
            raise UpdateRejected(
                f"update is for round {env.round_id}, this is round {round_id}", "stale")
        if set(env.payloads) != set(expected):
            raise UpdateRejected("update names a different set of tensors", "shape")
        out = {}
        for name, value in expected.items():
            ref = dense_of(value)
            if tuple(env.shapes[name]) != tuple(ref.shape):
                raise UpdateRejected(
                    f"{name}: shape {env.shapes[name]} != {tuple(ref.shape)}", "shape")
            tensor = self.compressor.decode(env.payloads[name], ref.shape, torch.float32,
                                            ref.device)
            check_update(name, tensor, tuple(ref.shape), self.max_update_norm)
            out[name] = tensor
        return out


class ExchangeOptions(BaseModel):
    """What an :class:`Exchange` is built from: the codec of its payloads, the aggregator of
    the updates it receives and the norm screen in front of it. Each value is checked here,
    where it is used; ``RunConfig`` composes these fields (flat flags, ``[exchange]`` in TOML)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    codec: str = Field("none", description="none, fp16, bf16, int8, int4, topk[:f], ...[+ef]")
    aggregator: str = Field("mean", description="mean, median, trimmed_mean, centered_clip, ...")
    screen_ratio: float = Field(
        10.0, ge=0, description="reject an update whose norm exceeds this x the round's median "
        "(0 turns the screen off)")
    score: str = Field("none", description="none, or loss: every peer's update judged by the "
                       "loss drop it gives, rated over rounds, weighted by its rating "
                       "(farlink.robust.score; default with --members open)")
    score_rows: int = Field(2, ge=1, description="--score loss: sequences of each scoring "
                            "batch (one of the peer's shard, one held out)")
    score_threshold: float = Field(0.25, ge=0, le=1, description="--score loss: a peer rated "
                                   "under this is left out of the round")
    score_turns: int = Field(3, ge=1, description="--score loss: peers each member measures "
                             "per round (each peer is measured by this many others)")

    @model_validator(mode="after")
    def _check_exchange(self) -> ExchangeOptions:
        make_compressor(self.codec)  # raises ValueError naming the valid codecs
        make_aggregator(self.aggregator)
        if self.score not in SCORES:
            raise ValueError(f"score {self.score!r} unknown; choose {' or '.join(SCORES)}")
        if 0 < self.screen_ratio <= 1:
            raise ValueError(f"screen_ratio={self.screen_ratio:g} would reject honest updates; "
                             "use a value above 1, or 0 to turn the screen off")
        return self
