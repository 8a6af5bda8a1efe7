"""Who contributed what: tokens claimed, accepted and credited, updates accepted and rejected
(with reasons), and, in a loss-scored run, each peer's last score and rating.

Tokens *credited* are what a peer earned: at most one round's worth per accepted update, and
nothing for an update marked as a free ride, a replay or an inflated claim (the marks are
counted by kind); tokens *accepted* are what its accepted updates weighed.

A community run needs a record it can show: which peers did work that reached the model, which
were turned away and why. The ledger is written from the receive path (possibly several threads),
so every method takes one lock; it saves to JSON atomically (write, then rename) so a crash never
leaves half a file.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from farlink.robust.validate import reason_kind
from farlink.state.files import atomic_write


@dataclass
class PeerRecord:
    """One peer's totals."""

    tokens_claimed: float = 0.0  # over all updates it sent, accepted or not
    tokens_accepted: float = 0.0  # only in accepted updates: what reached the model (bounded)
    claims_capped: int = 0  # accepted updates whose claimed token count was bounded
    updates_accepted: int = 0
    updates_rejected: int = 0
    rejections: dict[str, int] = field(default_factory=dict)  # reason kind -> count
    rounds: int = 0  # distinct rounds it took part in
    first_round: int | None = None
    last_round: int | None = None
    tokens_credited: float = 0.0  # what it earned: bounded per round, 0 for a marked update
    marks: dict[str, int] = field(default_factory=dict)  # free_rider/replay/inflated -> count
    score: float | None = None  # its last loss score (a loss-scored run)
    rating: float | None = None  # its rating over rounds after that score

    @property
    def acceptance(self) -> float:
        total = self.updates_accepted + self.updates_rejected
        return self.updates_accepted / total if total else 0.0


class ContributionLedger:
    def __init__(self) -> None:
        self._peers: dict[str, PeerRecord] = {}
        self._seen: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def _touch(self, peer: str, round_id: int, tokens: float) -> PeerRecord:
        if not tokens >= 0:  # also refuses NaN
            raise ValueError(f"tokens must be a number >= 0, got {tokens}")
        rec = self._peers.setdefault(peer, PeerRecord())
        seen = self._seen.setdefault(peer, set())
        if round_id not in seen:
            seen.add(round_id)
            rec.rounds += 1
        rec.first_round = round_id if rec.first_round is None else min(rec.first_round, round_id)
        rec.last_round = round_id if rec.last_round is None else max(rec.last_round, round_id)
        rec.tokens_claimed += tokens
        return rec

    def record_accepted(self, peer: str, round_id: int, tokens: float,
                        claimed: float | None = None, capped: bool = False,
                        credited: float | None = None, mark: str | None = None) -> None:
        """``tokens`` is what the update weighed (the bounded count, counted as accepted);
        ``claimed`` what the peer said it trained on, when that was more (``capped``);
        ``credited`` what it earned (default ``tokens``), 0 with a ``mark`` saying why."""
        with self._lock:
            rec = self._touch(peer, round_id, tokens if claimed is None else claimed)
            rec.updates_accepted += 1
            rec.tokens_accepted += tokens
            rec.claims_capped += bool(capped)
            rec.tokens_credited += tokens if credited is None else credited
            if mark is not None:
                kind = reason_kind(mark)
                rec.marks[kind] = rec.marks.get(kind, 0) + 1

    def record_score(self, peer: str, score: float, rating: float) -> None:
        """A loss-scored round's judgement of ``peer``: its score and its rating after it. It is
        recorded as the round rates, before the round commits, so a peer may have a score and
        no round yet (its update is credited at the commit, if there is one)."""
        with self._lock:
            self._seen.setdefault(peer, set())
            rec = self._peers.setdefault(peer, PeerRecord())
            rec.score, rec.rating = float(score), float(rating)

    def record_rejected(self, peer: str, round_id: int, tokens: float, reason: str) -> None:
        """``reason`` is counted by its kind (text before the first colon, e.g. ``norm``)."""
        with self._lock:
            rec = self._touch(peer, round_id, tokens)
            rec.updates_rejected += 1
            kind = reason_kind(reason)
            rec.rejections[kind] = rec.rejections.get(kind, 0) + 1

    def get(self, peer: str) -> PeerRecord:
        with self._lock:
            rec = self._peers.get(peer)
            if rec is None:
                raise KeyError(f"no record for peer {peer!r}")
            return PeerRecord(**{**asdict(rec), "rejections": dict(rec.rejections),
                                 "marks": dict(rec.marks)})

    def peers(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    def to_dict(self) -> dict:
        with self._lock:
            return {"version": 1, "peers": {
                p: {**asdict(r), "round_ids": sorted(self._seen[p])}
                for p, r in sorted(self._peers.items())
            }}

    @classmethod
    def from_dict(cls, data: Mapping) -> ContributionLedger:
        if not isinstance(data, Mapping) or data.get("version") != 1:
            raise ValueError("not a version-1 contribution ledger")
        ledger = cls()
        try:
            for peer, fields in data["peers"].items():
                fields = dict(fields)
                ledger._seen[peer] = {int(r) for r in fields.pop("round_ids", [])}
                # a ledger written before credits were counted credited what it accepted
                fields.setdefault("tokens_credited", fields.get("tokens_accepted", 0.0))
                ledger._peers[peer] = PeerRecord(**fields)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"corrupt contribution ledger: {exc}") from exc
        return ledger

    def restore(self, data: Mapping) -> None:
        """Replace this ledger's records by :meth:`to_dict`'s ``data`` in place (the exchange
        and the optimizer hold this very object): a resumed member keeps the credits, marks
        and ratings of the rounds before its restart."""
        other = ContributionLedger.from_dict(data)
        with self._lock:
            self._peers, self._seen = other._peers, other._seen

    def save(self, path: Path) -> None:
        atomic_write(Path(path), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> ContributionLedger:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read ledger {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"ledger {path} is not JSON: {exc}") from exc
        return cls.from_dict(data)

    def summary(self) -> Table:
        """A rich table, one row per peer, most accepted tokens first."""
        with self._lock:
            rows = sorted(self._peers.items(), key=lambda kv: -kv[1].tokens_accepted)
            table = Table(title="Contributions")
            scored = any(r.rating is not None for r in self._peers.values())
            columns = ["peer", "rounds", "tokens claimed", "tokens accepted", "tokens credited",
                       "accepted", "rejected", *(["score", "rating"] if scored else []),
                       "reasons"]
            for col in columns:
                table.add_column(col, justify="left" if col in ("peer", "reasons") else "right")
            for peer, r in rows:
                reasons = ", ".join(f"{k} x{n}" for k, n in sorted(r.rejections.items()))
                if r.claims_capped:  # accepted, at a bounded weight
                    reasons = ", ".join(filter(None, [reasons, f"claim capped x{r.claims_capped}"]))
                marks = ", ".join(f"{k} x{n} (credited 0)" for k, n in sorted(r.marks.items()))
                reasons = ", ".join(filter(None, [reasons, marks]))
                judged = [f"{r.score:+.2f}" if r.score is not None else "-",
                          f"{r.rating:.2f}" if r.rating is not None else "-"] if scored else []
                table.add_row(peer, str(r.rounds), f"{r.tokens_claimed:,.0f}",
                              f"{r.tokens_accepted:,.0f}", f"{r.tokens_credited:,.0f}",
                              str(r.updates_accepted), str(r.updates_rejected), *judged,
                              reasons or "-")
            return table
