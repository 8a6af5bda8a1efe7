"""The compressed all-reduce: a peer's bytes per round stay about ``2 (n-1)/n x payload``.

The gathered path sends every peer's encoded update to every other peer, ``(n-1) x payload`` per
peer per round. Here the update (every tensor flattened into one vector) is cut into ``n``
contiguous shards, one per member (its *owner*), as hivemind's butterfly all-reduce does:

1. **reduce-scatter**: each peer encodes each shard with the run's codec (error feedback over
   the whole vector: what the encoding of any shard dropped is added to the next round's
   vector) and sends shard ``j`` to member ``j``, in a signed envelope that carries its claimed
   tokens;
2. **screen**: each owner opens, verifies and decodes the shard messages it received and
   all-gathers a few bytes per sender (verdict, claim, squared norm of its shard). Every member
   then holds the whole-update facts of today's gathered path (a peer's norm is the root of the
   sum of its shard norms; one bad shard rejects the peer everywhere; claims are bounded once
   from the same numbers) and reaches the same decision;
3. **aggregate per shard**: each owner applies the rule to its shard of the accepted updates.
   Coordinate rules (mean, median, trimmed mean) need nothing more; rules that need the whole
   update's geometry get it from per-shard partials, all-gathered (centered clipping's distances
   to the centre per iteration, norm bounding's norms, Krum's ``n x n`` squared distances), so
   the result is the whole-update rule of the gathered path;
4. **all-gather**: the owner re-encodes its aggregated shard with the codec, signs it and sends
   it to every member; every member (the owner included) decodes the same bytes, so replicas
   stay bit-identical. Members compare digests of the shards they received (an owner that sends
   different shards to different members fails the round, named), check each returned shard's
   signature, size and norm against what its owner reported, and treat an owner that fails a
   check, or sends nothing, as failed for the round: the round is discarded everywhere and
   retried, and the owner is recorded in the ledger like a rejected peer.

Accuracy: the peers' own encoding error is carried by error feedback as in the gathered path;
the owner's re-encoding of the aggregate adds one more rounding of the same codec, which with
error feedback the owner carries to the same shard's next aggregate while it owns that shard.
``docs/allreduce.md`` has the measured effect.

The transport only moves bytes: :meth:`Collective.all_to_all_bytes` (in-process, torchft's Gloo
``alltoall``, hivemind's pushes) and :meth:`Collective.all_gather_bytes` for the small partials.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
from dataclasses import dataclass

import torch

from farlink.codecs import CodecError, envelope
from farlink.comm.errors import CommError
from farlink.robust import aggregators as rules
from farlink.robust.auth import AuthError
from farlink.robust.equivocation import MISSING, SLOT_DIGEST, differing_slots, slot_digests
from farlink.robust.validate import UpdateRejected
from farlink.robust.weights import bound_claims
from farlink.sync.result import ExchangeResult

log = logging.getLogger(__name__)

#: the name of the whole-vector residual in the compressor's error-feedback state
RESIDUAL = "__allreduce__"
#: what an owner's re-encoding of its aggregate shard dropped, and where that shard lies
#: (group size, rank, start, end): added to the same shard's next aggregate
OWNER_RESIDUAL, OWNER_PLACE = "__allreduce_owner__", "__allreduce_owner_at__"
#: how much longer than the root of its senders' summed squared shard norms an owner's returned
#: shard may be (every rule keeps each coordinate within its senders' range; the slack covers the
#: codec's re-encoding)
OWNER_NORM_SLACK = 1.25
#: per sender in an owner's report: verdict (0 = accepted), claimed tokens, squared shard norm
_REPORT = struct.Struct("<Bdd")
#: an owner's report starts with the round, its rank and the round's size (what it signs)
_HEAD = struct.Struct("<qII")
_VERDICTS = ["ok", "missing", "auth", "codec", "stale", "shape", "nonfinite", "duplicate",
             "impersonation"]


def shard_bounds(numel: int, members: int, align: int = 1) -> list[tuple[int, int]]:
    """``members`` contiguous ``[start, end)`` ranges covering ``numel`` elements, as equal as
    whole ``align``-element blocks allow (a block codec's blocks never straddle two shards)."""
    blocks = -(-numel // align)
    edges = [min(numel, (j * blocks // members) * align) for j in range(members + 1)]
    edges[-1] = numel
    return [(edges[j], edges[j + 1]) for j in range(members)]


def planned_bytes(exchange, numel: int, members: int) -> int:  # noqa: ANN001 - an Exchange
    """Bytes one peer sends in a round of ``numel`` elements over ``members`` (the larger
    shard, headers, screening reports, the rule's partials and the digests)."""
    n = members
    if n <= 1:
        return 0
    codec = exchange.compressor.codec
    bounds = shard_bounds(numel, n, getattr(codec, "block", 1))
    largest = max(b - a for a, b in bounds)
    header = len(exchange.authenticator.sign(envelope.pack(
        exchange.sender, 0, 1.0, {"aggregate": b""}, {"aggregate": (largest,)},
        {"aggregate": torch.float32}, meta={"shard": n, "of": n})))
    shard = codec.max_payload_nbytes((largest,)) + header
    name, kw = rule_of(exchange.aggregator) or ("mean", {})
    partials = {"centered_clip": (kw.get("iters", 3) + (kw.get("tau") is None)) * n * 8,
                "krum": n * n * 8}.get(name, 0)
    return 2 * (n - 1) * shard + (n - 1) * (n * (_REPORT.size + SLOT_DIGEST) + partials)


def partial_gathers(aggregator) -> int:  # noqa: ANN001 - any aggregator
    """How many all-gathers of per-shard partials a round of ``aggregator`` adds (centered
    clipping: one per iteration, one more to find tau; Krum: the distance matrix): each costs
    ``n-1`` hops on a ring, which the planner prices."""
    name, kw = rule_of(aggregator) or ("mean", {})
    return {"centered_clip": kw.get("iters", 3) + (kw.get("tau") is None),
            "krum": 1}.get(name, 0)


def rule_of(aggregator) -> tuple[str, dict] | None:  # noqa: ANN001 - any aggregator
    """(name, keyword arguments) of a whole-update rule this path applies per shard; None for
    one it cannot (a ``+per_tensor`` rule: tensor boundaries do not follow shards)."""
    if isinstance(aggregator, rules.PerTensor):
        return None
    base, kwargs = aggregator, {}
    if isinstance(aggregator, functools.partial):
        base, kwargs = aggregator.func, dict(aggregator.keywords)
    for name, fn in rules.AGGREGATORS.items():
        if base is fn:
            return name, kwargs
    return None


@dataclass
class _Sender:
    """What this owner found in one member's message for its shard."""

    verdict: str = "missing"
    why: str = ""
    identity: str = ""
    claim: float = 0.0
    sqnorm: float = 0.0
    shard: torch.Tensor | None = None


@dataclass
class _Redo:
    """What a member holds, after the screening, to redo a dead owner's shard: its own signed
    part of that shard (as it sent it), every owner's report, the accepted members and their
    weights, their whole norms, and the squared norm of the part it sent."""

    part: bytes
    table: list[list[tuple]]
    accepted: list[int]
    weights: torch.Tensor
    norms: dict[int, float]
    own_sqnorm: float


class ShardedReduce:
    """One round of the compressed all-reduce for an :class:`~farlink.sync.exchange.Exchange`
    (its collective, codec, authenticator, rule, bounds and ledger)."""

    def __init__(self, exchange) -> None:  # noqa: ANN001 - farlink.sync.exchange.Exchange
        self.x = exchange
        #: what the rule decided over whole updates in phase 3 (the same on every member), so a
        #: member redoing a dead owner's shard applies the same decision to it: centered
        #: clipping's tau and per-iteration clip factors, Krum's pick (index into accepted)
        self._clip: tuple[float, list[torch.Tensor]] | None = None
        self._krum_pick: int | None = None

    # --- the round ---------------------------------------------------------------------------
    def run(self, tensors: dict[str, torch.Tensor], weight: float, round_id: int):
        x = self.x
        coll = x.collective
        n, me = coll.round_members(), coll.round_rank()
        names = list(tensors)
        device = next(iter(tensors.values())).device
        flat = torch.cat([tensors[k].detach().float().reshape(-1) for k in names])
        bounds = shard_bounds(flat.numel(), n, getattr(x.compressor.codec, "block", 1))
        result = ExchangeResult({}, 0.0)

        # 1. reduce-scatter of encoded shards
        outgoing = []
        target = self._with_residual(flat)
        sent = torch.empty_like(target)
        for j, (a, b) in enumerate(bounds):
            payload = x.compressor.codec.encode(target[a:b]) if b > a else b""
            if b > a:
                sent[a:b] = x.compressor.codec.decode(payload, (b - a,), torch.float32,
                                                      target.device)
            outgoing.append(self._signed_message(round_id, weight, "shard", payload, b - a, j, n))
        if x.compressor.error_feedback:
            x.compressor.residuals[RESIDUAL] = target - sent
        received = coll.all_to_all_bytes(outgoing)
        if any(not m for k, m in enumerate(received) if k != me):
            return self._failed(result, "a member's shards did not arrive")
        senders = self._open_shards(received, round_id, n, me, bounds[me], device)

        # 2. screen: every owner's signed verdicts, claims and shard norms, all-gathered
        report = _HEAD.pack(round_id, me, n) + b"".join(
            _REPORT.pack(_VERDICTS.index(s.verdict), s.claim, s.sqnorm) for s in senders)
        reports = coll.all_gather_bytes(x.authenticator.sign(report))
        if len(reports) != n or any(not r for r in reports):
            return self._failed(result, "an owner's screening report did not arrive")
        ident = {k: senders[k].identity or f"rank{k}" for k in range(n)}
        table, broken = self._parse_reports(reports, n, round_id, ident)
        if broken:
            for owner, why in broken.items():
                x._reject(result, ident[owner], round_id, 0.0,
                          UpdateRejected(f"as owner of shard {owner}: {why}", "owner"))
            coll.fail_round(CommError(
                f"round {round_id} not committed: the screening report of "
                f"{', '.join(ident[o] for o in broken)} does not verify"), blame=sorted(broken))
            return ExchangeResult({}, 0.0, rejected=result.rejected)
        own_sent = [float((sent[a:b].double() ** 2).sum()) for a, b in bounds]
        if self._accused_too_many(table, ident, result, round_id, n):
            return ExchangeResult({}, 0.0, rejected=result.rejected)
        accepted, norms = self._decide(table, senders, result, round_id, n)
        if not accepted:
            return result
        claims = {k: table[0][k][1] for k in accepted}
        bounded, capped = bound_claims({k: claims[k] for k in accepted}, x.max_weight,
                                       x.claim_factor)
        for k in accepted:
            peer = ident[k]
            result.accepted.append(peer)
            result.tokens[peer], result.claimed[peer] = bounded[k], claims[k]
            if k in capped:
                result.capped[peer] = capped[k]
        result.total_weight = sum(bounded[k] for k in accepted)
        top = max(bounded[k] for k in accepted)
        w = torch.tensor([bounded[k] / top if top > 0 else 0.0 for k in accepted],
                         dtype=torch.float32, device=device)

        # 3. the rule on this owner's shard (geometry from all-gathered partials)
        stack = torch.stack([senders[k].shard for k in accepted]) if bounds[me][1] > bounds[me][0] \
            else torch.zeros((len(accepted), 0), device=device)
        try:
            shard = self._aggregate(stack, w, norms, accepted)
        except CommError as exc:  # a partial is missing: the collective failed the round
            return self._failed(result, str(exc))

        # 4. all-gather of the re-encoded aggregate shards
        a, b = bounds[me]
        payload = self._encode_aggregate(shard, (n, me, a, b)) if b > a else b""
        back = self._signed_message(round_id, result.total_weight, "aggregate", payload, b - a, me, n)
        returned = coll.all_to_all_bytes(self.return_shard(back, n))
        live, lost = self._owner_equivocated(returned, result, round_id, ident)
        if live is None:
            return ExchangeResult({}, 0.0, rejected=result.rejected)
        if lost and not coll.survives_departures:  # the transport failed the round itself
            return self._failed(result, "an owner's aggregate shard did not arrive")
        pieces = []
        for k, raw in enumerate(returned):
            if k in lost:
                pieces.append(None)
                continue
            numel = bounds[k][1] - bounds[k][0]
            try:
                pieces.append(self._open_aggregate(raw, k, n, round_id, numel, ident[k], table,
                                                   accepted, own_sent[k], me, device))
            except (CodecError, AuthError, UpdateRejected) as exc:
                return self._owner_failed(result, exc, k, k, round_id, ident)
        for dead in lost:  # 5. a dead owner's shard, redone by a live member
            redo = _Redo(outgoing[dead], table, accepted, w, norms, own_sent[dead])
            piece = self._reassign(dead, live, lost, redo, result, round_id, n, bounds, ident,
                                   device)
            if piece is None:
                return ExchangeResult({}, 0.0, rejected=result.rejected)
            pieces[dead] = piece
        out, offset = {}, 0
        whole = torch.cat(pieces) if pieces else torch.zeros(0, device=device)
        for name in names:
            numel = tensors[name].numel()
            out[name] = whole[offset:offset + numel].reshape(tensors[name].shape)
            offset += numel
        if not torch.isfinite(whole).all():
            return ExchangeResult({}, 0.0, rejected={**result.rejected,
                                                     "aggregate": "nonfinite: aggregate"})
        result.tensors = out
        return result

    # --- phase 1 -----------------------------------------------------------------------------
    def _with_residual(self, flat: torch.Tensor) -> torch.Tensor:
        comp = self.x.compressor
        residual = comp.residuals.get(RESIDUAL) if comp.error_feedback else None
        if residual is not None and residual.shape == flat.shape:
            return flat + residual.to(flat.device)
        return flat.clone()

    def _encode_aggregate(self, shard: torch.Tensor, place: tuple[int, int, int, int]) -> bytes:
        """The owner's encoding of its aggregate shard. With error feedback the owner keeps
        what its re-encoding dropped and adds it to the same shard's next aggregate, as long
        as it owns the same shard (same group size, rank and bounds); a new place starts
        afresh."""
        comp = self.x.compressor
        if not comp.error_feedback:
            return comp.codec.encode(shard)
        at = torch.tensor(place, dtype=torch.int64)
        held = comp.residuals.get(OWNER_RESIDUAL)
        if held is not None and torch.equal(comp.residuals.get(OWNER_PLACE, at * 0 - 1), at):
            shard = shard + held.to(shard.device)
        payload = comp.codec.encode(shard)
        comp.residuals[OWNER_RESIDUAL] = shard - comp.codec.decode(
            payload, shard.shape, torch.float32, shard.device)
        comp.residuals[OWNER_PLACE] = at
        return payload

    def _signed_message(self, round_id: int, weight: float, kind: str, payload: bytes, numel: int,
              shard: int, members: int) -> bytes:
        message = envelope.pack(self.x.sender, round_id, weight, {kind: payload},
                                {kind: (numel,)}, {kind: torch.float32},
                                meta={"shard": shard, "of": members})
        return self.x.authenticator.sign(message)

    def _open(self, raw: bytes, kind: str, shard: int, members: int, round_id: int,
              numel: int) -> tuple[str, envelope.Envelope]:
        signer, body = self.x.authenticator.open(raw)
        env = envelope.unpack(body)
        if signer is not None and signer != env.sender:
            raise UpdateRejected(f"signed by {signer} but claims to be {env.sender}",
                                 "impersonation")
        if env.round_id != round_id:
            raise UpdateRejected(f"update is for round {env.round_id}, this is round {round_id}",
                                 "stale")
        if (set(env.payloads) != {kind} or env.meta.get("shard") != shard
                or env.meta.get("of") != members or tuple(env.shapes[kind]) != (numel,)):
            raise UpdateRejected(f"not shard {shard} of {members} with {numel} elements",
                                 "shape")
        return signer or env.sender, env

    def _open_shards(self, received: list[bytes], round_id: int, n: int, me: int,
                     bound: tuple[int, int], device: torch.device) -> list[_Sender]:
        numel = bound[1] - bound[0]
        senders = [_Sender() for _ in range(n)]
        for k, raw in enumerate(received):
            s = senders[k]
            if not raw:  # nothing from this member (only when redoing a dead owner's shard)
                continue
            try:
                s.identity, env = self._open(raw, "shard", me, n, round_id, numel)
                s.claim = env.weight
                s.shard = self.x.compressor.codec.decode(env.payloads["shard"], (numel,),
                                                         torch.float32, device) \
                    if numel else torch.zeros(0, device=device)
                if not torch.isfinite(s.shard).all():
                    raise UpdateRejected("contains NaN or Inf", "nonfinite")
                s.sqnorm, s.verdict = float((s.shard.double() ** 2).sum()), "ok"
            except AuthError as exc:
                s.verdict, s.why = "auth", str(exc)
            except UpdateRejected as exc:
                s.verdict, s.why = exc.kind if exc.kind in _VERDICTS else "shape", str(exc)
            except CodecError as exc:
                s.verdict, s.why = "codec", str(exc)
            if not s.identity:
                s.identity = self.x._identity(raw, k)
        seen: dict[str, list[int]] = {}
        for k, s in enumerate(senders):
            if s.verdict == "ok":
                seen.setdefault(s.identity, []).append(k)
        for slots in seen.values():
            if len(slots) > 1:  # one identity in two slots: which is its own?
                for k in slots:
                    senders[k].verdict = "duplicate"
                    senders[k].why = f"found in slots {slots}"
        return senders

    # --- phase 2 -----------------------------------------------------------------------------
    def _parse_reports(self, reports: list[bytes], n: int, round_id: int,
                       ident: dict[int, str]) -> tuple[list[list[tuple]], dict[int, str]]:
        """Each owner's report as rows of (verdict, claim, squared norm) per sender, and the
        owners whose report does not verify, is not for this round and shard, or is malformed
        (owner -> why)."""
        table, broken = [], {}
        for owner, raw in enumerate(reports):
            try:
                signer, body = self.x.authenticator.open(raw)
                if signer is not None and signer != ident[owner]:
                    raise UpdateRejected(f"report signed by {signer}", "impersonation")
                if len(body) != _HEAD.size + n * _REPORT.size or \
                        _HEAD.unpack_from(body) != (round_id, owner, n):
                    raise UpdateRejected("report is not this round's, or malformed", "report")
                rows = [_REPORT.unpack_from(body, _HEAD.size + k * _REPORT.size)
                        for k in range(n)]
                if any(v[0] >= len(_VERDICTS) or not math.isfinite(v[1]) or v[1] < 0
                       or not math.isfinite(v[2]) or v[2] < 0 for v in rows):
                    raise UpdateRejected("report holds an impossible value", "report")
            except (AuthError, UpdateRejected) as exc:
                broken[owner] = getattr(exc, "reason", None) or f"report: {exc}"
                rows = []
            table.append(rows)
        return table, broken

    @staticmethod
    def _unconfirmed(table: list[list[tuple]], n: int) -> dict[int, list[int]]:
        """Owner -> the members whose shard it alone (or with some, not all, other owners)
        refused: accusations no other owner can confirm."""
        out: dict[int, list[int]] = {}
        for k in range(n):
            bad = [o for o in range(n) if o != k and table[o][k][0] != 0]
            if bad and len(bad) < n - 1:
                for o in bad:
                    out.setdefault(o, []).append(k)
        return out

    def _accused_too_many(self, table: list[list[tuple]], ident: dict[int, str], result,
                          round_id: int, n: int) -> bool:
        """An owner with more than one unconfirmed accusation fails the round (it and the
        members it accused are blamed): paying one update for each accusation, it could
        otherwise drop every honest update at the price of its own."""
        many = {o: ks for o, ks in self._unconfirmed(table, n).items() if len(ks) > 1}
        if not many:
            return False
        for owner, accused in many.items():
            self.x._reject(result, ident[owner], round_id, 0.0, UpdateRejected(
                f"as owner of shard {owner} refused the shards of members {accused}, which no "
                "other owner could check", "accuser"))
        blame = sorted(set(many) | {k for ks in many.values() for k in ks})
        self.x.collective.fail_round(CommError(
            f"round {round_id} not committed: {', '.join(ident[o] for o in many)} refused "
            "several members' shards that no other owner could check"), blame=blame)
        return True

    def _decide(self, table: list[list[tuple]], senders: list[_Sender], result, round_id: int,
                n: int) -> tuple[list[int], dict[int, float]]:
        """The whole-update verdict on each member, from every owner's report (the same on
        every member): rejected if any owner rejected its shard, if owners saw different
        claims, if its whole norm breaks the bound or the round's screen. An owner that refused
        a shard no other owner could check (one bad shard reaches one owner) loses its own
        update for the round too: a false accusation then costs the accuser as much as its
        victim (one each: more fail the round), so accusations cannot turn an honest majority
        into a minority."""
        x = self.x
        accepted, norms = [], {}
        # owner -> the one member only it accused (more fail the round: _accused_too_many)
        accusers = {o: ks[0] for o, ks in self._unconfirmed(table, n).items()}
        for k in range(n):
            bad = [(o, _VERDICTS[table[o][k][0]]) for o in range(n) if table[o][k][0] != 0]
            claims = {table[o][k][1] for o in range(n)}
            peer = senders[k].identity or f"rank{k}"
            if k in accusers and not bad:
                x._reject(result, peer, round_id, 0.0, UpdateRejected(
                    f"as owner of shard {k} refused member {accusers[k]}'s shard, which only it "
                    "could check: an unconfirmed accusation costs the accuser its own update "
                    "for the round", "accuser"))
            elif bad:
                owner, verdict = bad[0]
                why = senders[k].why if owner == x.collective.round_rank() else \
                    f"its shard for owner {owner} was refused"
                x._reject(result, peer, round_id, 0.0, UpdateRejected(why, verdict))
            elif len(claims) > 1:
                x._reject(result, peer, round_id, 0.0, UpdateRejected(
                    f"claimed different token counts to different owners: {sorted(claims)}",
                    "equivocation"))
            else:
                norms[k] = math.sqrt(sum(table[o][k][2] for o in range(n)))
                if x.max_update_norm is not None and norms[k] > x.max_update_norm:
                    x._reject(result, peer, round_id, table[0][k][1], UpdateRejected(
                        f"update norm {norms[k]:.3g} exceeds bound {x.max_update_norm:.3g}",
                        "norm"))
                else:
                    accepted.append(k)
        if x.screen_ratio is not None and len(accepted) >= 3:
            median = float(torch.tensor([norms[k] for k in accepted]).median())
            if median > 0:
                for k in [k for k in accepted if norms[k] > x.screen_ratio * median]:
                    accepted.remove(k)
                    x._reject(result, senders[k].identity or f"rank{k}", round_id,
                              table[0][k][1], UpdateRejected(
                                  f"update norm {norms[k]:.3g} > {x.screen_ratio:g} x round "
                                  f"median {median:.3g}", "norm"))
        return accepted, norms

    # --- phase 3 -----------------------------------------------------------------------------
    def _gather_partials(self, values: torch.Tensor) -> torch.Tensor:
        """The sum over owners of each owner's float64 ``values`` (same shape everywhere)."""
        raw = values.double().cpu().contiguous().numpy().tobytes()
        got = self.x.collective.all_gather_bytes(raw)
        total = torch.zeros_like(values, dtype=torch.float64, device="cpu")
        for r in got:
            if len(r) != len(raw):
                raise CommError("a partial did not arrive")
            part = torch.frombuffer(bytearray(r), dtype=torch.float64).reshape(values.shape)
            if not torch.isfinite(part).all():
                raise CommError("a partial is not finite")
            total += part
        return total

    def _aggregate(self, stack: torch.Tensor, w: torch.Tensor, norms: dict[int, float],
                   accepted: list[int]) -> torch.Tensor:
        name, kw = rule_of(self.x.aggregator)
        if name in ("mean", "median", "trimmed_mean") or len(accepted) == 1 and name != "krum":
            return rules.AGGREGATORS[name](stack, w, **kw) if stack.shape[1] \
                else torch.zeros(0, device=stack.device)
        if name == "norm_bounded":
            whole = torch.tensor([norms[k] for k in accepted], dtype=torch.float64)
            bound = kw.get("factor", 1.0) * float(rules.coordinate_median(whole[:, None], w)[0])
            scale = torch.clamp(bound / whole.clamp(min=1e-300), max=1.0).to(stack.device)
            return rules._mean64(stack.double() * scale[:, None],
                                 rules.cap_weights(w).to(stack.device)).to(stack.dtype)
        if name == "centered_clip":
            return self._centered_clip(stack, w, kw.get("tau"), kw.get("iters", 3))
        if name == "krum":
            return self._krum(stack, kw.get("f"))
        raise ValueError(f"aggregator {name} has no sharded form")

    def _centered_clip(self, stack: torch.Tensor, w: torch.Tensor, tau: float | None,
                       iters: int) -> torch.Tensor:
        """:func:`~farlink.robust.aggregators.centered_clip` over whole updates: each clip
        factor uses the whole offset's norm, summed from every owner's shard partials."""
        x = stack.double()
        wc = rules.cap_weights(w).to(x.device)
        v = rules.coordinate_median(x, w) if x.shape[1] else torch.zeros(0, dtype=x.dtype)
        if tau is None:
            dist = self._gather_partials(((x - v) ** 2).sum(1)).sqrt()
            tau = float(dist.median())
        self._clip = (tau, [])
        if float(wc.sum()) <= 0 or tau == 0.0:
            return v.to(stack.dtype)
        for _ in range(iters):
            d = x - v
            whole = self._gather_partials((d ** 2).sum(1)).sqrt().to(x.device)
            scale = torch.clamp(tau / whole.clamp(min=1e-300), max=1.0)
            self._clip[1].append(scale)
            v = v + (d * scale[:, None] * wc[:, None]).sum(0) / wc.sum()
        return v.to(stack.dtype)

    def _clip_again(self, stack: torch.Tensor, w: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Centered clipping of a redone shard with phase 3's whole-update clip factors (the
        ``rows`` of the accepted members whose parts the new owner holds)."""
        x = stack.double()
        wc = rules.cap_weights(w).to(x.device)
        v = rules.coordinate_median(x, w)
        tau, scales = self._clip
        if float(wc.sum()) <= 0 or tau == 0.0:
            return v.to(stack.dtype)
        for scale in scales:
            d = x - v
            v = v + (d * scale[rows, None] * wc[:, None]).sum(0) / wc.sum()
        return v.to(stack.dtype)

    def _krum(self, stack: torch.Tensor, f: int | None) -> torch.Tensor:
        """Krum's choice from the whole updates' squared distances (sum of every owner's)."""
        m_peers = stack.shape[0]
        x = stack.double()
        d2 = self._gather_partials(torch.cdist(x, x).pow(2) if x.shape[1]
                                   else torch.zeros(m_peers, m_peers, dtype=torch.float64))
        if m_peers <= 2:
            return rules.coordinate_median(stack, torch.ones(m_peers)) if stack.shape[1] \
                else stack[0]
        f = max((m_peers - 3) // 2, 0) if f is None else f
        d2.fill_diagonal_(float("inf"))
        scores = d2.sort(dim=1).values[:, :max(m_peers - f - 2, 1)].sum(1)
        self._krum_pick = int(scores.argmin())
        return stack[self._krum_pick].clone()

    # --- phase 4 -----------------------------------------------------------------------------
    def _owner_equivocated(self, returned: list[bytes], result, round_id: int,
                           ident: dict[int, str]) -> tuple[list[int] | None, list[int]]:
        """Compare the digests of the returned shards across members. Returns the members that
        took part (live) and the owners whose shard did not reach some member (lost), or
        ``(None, [])`` when an owner sent different shards to different members (the round is
        failed, the owner named)."""
        n = len(returned)
        reports = self.x.collective.all_gather_bytes(slot_digests(returned))
        if len(reports) != n:  # the transport failed the round (torchft: errored until quorum)
            self._failed(result, "an owner's aggregate shard or the shards' digests did not "
                                 "arrive")
            return None, []
        live = [m for m, r in enumerate(reports) if len(r) == n * SLOT_DIGEST]
        lost = sorted({s for m in live for s in range(n)
                       if reports[m][s * SLOT_DIGEST:(s + 1) * SLOT_DIGEST] == MISSING})
        differing = differing_slots(reports, n)
        if not differing:
            return live, lost
        for slot, dissent in differing.items():
            self.x._reject(result, ident[slot], round_id, 0.0, UpdateRejected(
                f"as owner of shard {slot} sent different aggregates to different members "
                f"in round {round_id} (members {dissent} received other bytes)", "owner"))
        self.x.collective.fail_round(CommError(
            f"round {round_id} not committed: an owner sent different aggregate shards to "
            "different members; the round is discarded everywhere and retried"),
            blame=sorted(differing))
        return None, []

    def return_shard(self, message: bytes, members: int) -> list[bytes]:
        """What this owner sends each member in the all-gather: the same signed shard."""
        return [message] * members

    def _open_aggregate(self, raw: bytes, owner: int, n: int, round_id: int, numel: int,
                        identity: str, table: list[list[tuple]], accepted: list[int],
                        own_sqnorm: float, me: int, device: torch.device) -> torch.Tensor:
        """Owner ``owner``'s aggregate shard, once it passes every check a member can make."""
        signer, env = self._open(raw, "aggregate", owner, n, round_id, numel)
        if signer is not None and signer != identity:
            raise UpdateRejected(f"signed by {signer}, not by the shard's owner {identity}",
                                 "impersonation")
        shard = self.x.compressor.codec.decode(env.payloads["aggregate"], (numel,),
                                               torch.float32, device) if numel \
            else torch.zeros(0, device=device)
        if not torch.isfinite(shard).all():
            raise UpdateRejected("contains NaN or Inf", "nonfinite")
        if me in accepted and owner != me and \
                abs(table[owner][me][2] - own_sqnorm) > 1e-6 * max(own_sqnorm, 1e-30) + 1e-30:
            raise UpdateRejected(
                f"reported this member's shard norm^2 as {table[owner][me][2]:.6g}, it sent "
                f"{own_sqnorm:.6g}", "report")
        limit = OWNER_NORM_SLACK * math.sqrt(sum(table[owner][k][2] for k in accepted))
        norm = float(shard.double().norm())
        if norm > limit + 1e-12:
            raise UpdateRejected(f"aggregate shard norm {norm:.4g} exceeds what its senders "
                                 f"sent ({limit:.4g})", "norm")
        return shard

    def _failed(self, result, why: str):
        """A member is gone and its part cannot be done without it: the round is failed here
        (a network collective has failed it already; in-process, a departed member's empty
        slot fails nothing by itself) and retried by the caller."""
        log.info("compressed all-reduce: %s; the round is discarded", why)
        self.x.collective.fail_round(CommError(f"compressed all-reduce: {why}"))
        result.rejected["round"] = f"missing: {why}"
        return ExchangeResult({}, 0.0, rejected=result.rejected)

    def _owner_failed(self, result, exc: Exception, shard: int, owner: int, round_id: int,
                      ident: dict[int, str]):
        """Member ``owner`` returned shard ``shard`` failing a check: named, round failed."""
        reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
        self.x._reject(result, ident[owner], round_id, 0.0,
                       UpdateRejected(f"as owner of shard {shard}: {reason}", "owner"))
        self.x.collective.fail_round(CommError(
            f"round {round_id} not committed: the owner of shard {shard} ({ident[owner]}) "
            f"returned a shard that fails its checks ({reason})"), blame=[owner])
        return ExchangeResult({}, 0.0, rejected=result.rejected)

    # --- phase 5: a dead owner's shard -------------------------------------------------------
    def _reassign(self, dead: int, live: list[int], lost: list[int], redo: _Redo, result,
                  round_id: int, n: int, bounds: list[tuple[int, int]], ident: dict[int, str],
                  device: torch.device) -> torch.Tensor | None:
        """Owner ``dead``'s aggregate shard reached no one (it died after the screening, while
        it owned the shard): the first live member after it (cyclically) redoes it. Every live
        member re-sends its signed part of that shard, as it sent it in the reduce-scatter, to
        the new owner; the new owner checks each part against what the dead owner reported of
        it (claim and squared norm: a sender cannot change its part now), applies the round's
        whole-update decision to the parts it holds, signs the aggregate and returns it to every
        live member, who check it as any owner's shard. The dead member's own part of its shard
        died with it: that shard is the rule over the live accepted members' parts. None (the
        round is failed, to be retried) when no more than half the round's members remain (two
        halves of a split round must not both commit), when no live owner can take it, or when
        the redo fails a check."""
        coll, me = self.x.collective, self.x.collective.round_rank()
        takers = [m for m in live if m not in lost]
        if len(live) * 2 <= n or len(live) < 2 or not takers:
            self._failed(result, f"the owner of shard {dead} ({ident[dead]}) is gone and "
                                 f"{len(live)} of {n} members remain: too few to redo it")
            return None
        owner = min(takers, key=lambda m: (m - dead) % n)
        parts = [b""] * n
        parts[owner] = redo.part
        received = coll.all_to_all_bytes(parts)
        a, b = bounds[dead]
        back = [b""] * n
        if me == owner:
            shard, liar = self._redo_shard(received, dead, live, redo, round_id, n, (a, b),
                                           device)
            if shard is None:
                why = f"member {ident[liar]} re-sent a part of shard {dead} other than the one " \
                    "its owner reported" if liar is not None else \
                    f"no part of shard {dead} that the round's rule takes remains"
                if liar is not None:
                    self.x._reject(result, ident[liar], round_id, 0.0,
                                   UpdateRejected(why, "equivocation"))
                coll.fail_round(CommError(f"round {round_id} not committed: {why}"),
                                blame=[liar] if liar is not None else [])
            else:
                payload = self.x.compressor.codec.encode(shard) if b > a else b""
                message = self._signed_message(round_id, result.total_weight, "aggregate", payload, b - a,
                                     dead, n)
                back = [message if k in live else b"" for k in range(n)]
        got = coll.all_to_all_bytes(back)
        alone = [got[k] if k == owner else b"" for k in range(n)]
        took_part, missing = self._owner_equivocated(alone, result, round_id, ident)
        if took_part is None:
            return None
        if owner in missing:
            self._failed(result, f"shard {dead}'s new owner {ident[owner]} returned nothing")
            return None
        try:
            piece = self._open_aggregate(got[owner], dead, n, round_id, b - a, ident[owner],
                                         redo.table, redo.accepted, redo.own_sqnorm, me, device)
        except (CodecError, AuthError, UpdateRejected) as exc:
            self._owner_failed(result, exc, dead, owner, round_id, ident)
            return None
        result.reassigned[ident[dead]] = ident[owner]
        log.info("compressed all-reduce: shard %d of %s redone by %s", dead, ident[dead],
                 ident[owner])
        return piece

    def _redo_shard(self, received: list[bytes], dead: int, live: list[int], redo: _Redo,
                    round_id: int, n: int, bound: tuple[int, int],
                    device: torch.device) -> tuple[torch.Tensor | None, int | None]:
        """The new owner's aggregate of shard ``dead`` from the live members' re-sent parts;
        (None, the member whose part differs from what the dead owner reported) or (None,
        None) when no accepted part remains or the rule's pick died."""
        senders = self._open_shards(received, round_id, n, dead, bound, device)
        rows = []
        for i, k in enumerate(redo.accepted):
            if k not in live:
                continue
            s, (_, claim, sqnorm) = senders[k], redo.table[dead][k][:3]
            if s.verdict != "ok" or s.claim != claim or \
                    abs(s.sqnorm - sqnorm) > 1e-6 * max(sqnorm, 1e-30) + 1e-30:
                return None, k
            rows.append(i)
        if not rows:
            return None, None
        numel = bound[1] - bound[0]
        stack = torch.stack([senders[redo.accepted[i]].shard for i in rows]) if numel \
            else torch.zeros((len(rows), 0), device=device)
        return self._aggregate_again(stack, redo, rows), None

    def _aggregate_again(self, stack: torch.Tensor, redo: _Redo,
                         rows: list[int]) -> torch.Tensor | None:
        """Phase 3's decision over whole updates, applied to a redone shard's ``rows`` (indices
        into the accepted members): the same clip factors, norm bound or Krum pick."""
        name, kw = rule_of(self.x.aggregator)
        w = redo.weights[rows]
        if not stack.shape[1]:
            return torch.zeros(0, device=stack.device)
        if name == "krum":
            if self._krum_pick is None:  # two or fewer accepted: the median
                return rules.coordinate_median(stack, torch.ones(len(rows)))
            return stack[rows.index(self._krum_pick)].clone() if self._krum_pick in rows \
                else None
        if len(redo.accepted) > 1 and name == "centered_clip":
            return self._clip_again(stack, w, rows)
        if len(redo.accepted) > 1 and name == "norm_bounded":
            whole = torch.tensor([redo.norms[k] for k in redo.accepted], dtype=torch.float64)
            bound = kw.get("factor", 1.0) * float(
                rules.coordinate_median(whole[:, None], redo.weights)[0])
            scale = torch.clamp(bound / whole.clamp(min=1e-300), max=1.0)[rows]
            return rules._mean64(stack.double() * scale[:, None].to(stack.device),
                                 rules.cap_weights(w).to(stack.device)).to(stack.dtype)
        return rules.AGGREGATORS[name](stack, w, **kw)
