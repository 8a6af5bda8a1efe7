"""Metrics where people look: TensorBoard and Weights & Biases.

A run's own record stays its JSONL files (``metrics/w*.jsonl``), written whatever happens; this
module sends the same figures, as named scalars, to the dashboards people already watch. It is
library code: it takes figures (a metrics record, a :class:`farlink.Optimizer`) and sinks built
by the caller, and imports neither backend until a sink of that kind is opened (both are the
``metrics`` extra).

- :func:`open_sinks` builds the sinks a spec names (``"tensorboard,wandb"``: ``--log-to``).
- :func:`scalars_of` turns one record (a ``farlink train`` JSONL line, or the dict of
  ``Optimizer.metrics()``) into scalars with stable names (:data:`NAMES`).
- :class:`Reporter` is the hook for your own loop: call it after each ``sync.step``; it reads
  the optimizer's figures (bytes, round time and its phases, outer step, live peers, rejected
  updates per peer) and sends them with your loss and tokens to every sink.
- :func:`optimizer_scalars` gives the same figures as a dict, for frameworks that log through
  their own loggers (a Trainer or Lightning callback adds them to what it logs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from farlink.extras import require

#: the sinks ``--log-to`` knows
SINKS = ("tensorboard", "wandb")

#: record field -> scalar name. Held-out figures (an ``eval`` record's loss and ppl) go under
#: ``eval/``; everything cumulative is the total so far, as in the JSONL.
NAMES = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens": "train/tokens",
    "bytes_sent": "net/bytes_sent",
    "intra_bytes": "net/intra_bytes",
    "inter_bytes": "net/inter_bytes",
    "round_s": "round/seconds",
    "rounds_s": "round/seconds_total",
    "quorum_s": "round/quorum_s",
    "network_s": "round/network_s",
    "failed_rounds": "round/failed",
    "skipped_rounds": "round/skipped",
    "outer_step": "round/outer_step",
    "world_size": "peers/live",
    "rejected": "peers/rejected",
    "compute_s": "time/compute_s",
    "comm_s": "time/comm_s",
    "eval_s": "time/eval_s",
    "checkpoint_s": "time/checkpoint_s",
    "wall_s": "time/wall_s",
}
EVAL_NAMES = {"loss": "eval/loss", "ppl": "eval/ppl"}


class Sink(Protocol):
    """Where scalars go: a step and ``{name: value}``."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars as TensorBoard event files under ``directory`` (``tensorboard --logdir``)."""

    def __init__(self, directory: str | Path) -> None:
        require("tensorboard", "--log-to tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(directory)
        self.writer = SummaryWriter(log_dir=str(self.directory), flush_secs=10)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars as a Weights & Biases run (``WANDB_MODE=offline`` keeps it on disk, under
    ``directory``/wandb, for ``wandb sync`` later).

    Every scalar is plotted against ``step`` (the inner step) given as a value, not as W&B's
    own row counter: a held-out evaluation finishes in the background after later steps were
    logged, and W&B drops rows whose counter goes back."""

    def __init__(self, directory: str | Path, *, name: str | None = None,
                 group: str | None = None, project: str = "farlink",
                 config: Mapping[str, Any] | None = None) -> None:
        wandb = require("wandb", "--log-to wandb")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, group=group, dir=str(directory),
                              config=dict(config or {}), reinit="create_new")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def close(self) -> None:
        self.run.finish()


def parse_spec(spec: str | Iterable[str] | None) -> list[str]:
    """The sink names of a ``--log-to`` value (comma-separated), each known, none twice."""
    names = spec.split(",") if isinstance(spec, str) else list(spec or ())
    names = [n.strip().lower() for n in names if n.strip()]
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"--log-to {','.join(unknown)}: unknown; choose from {', '.join(SINKS)}")
    return list(dict.fromkeys(names))


def require_sinks(spec: str | Iterable[str] | None) -> None:
    """Import each named sink's package now (:class:`~farlink.extras.MissingExtra` naming
    ``farlink[metrics]`` if absent), so a run that asks for one is refused before it starts."""
    for kind in parse_spec(spec):
        require(kind, f"--log-to {kind}")


def open_sinks(spec: str | Iterable[str] | None, directory: str | Path, *, name: str,
               group: str | None = None, config: Mapping[str, Any] | None = None) -> list[Sink]:
    """The sinks ``spec`` names, writing under ``directory``: TensorBoard event files in
    ``directory/tensorboard/NAME``, a W&B run named NAME (in ``group``) under
    ``directory/wandb``. One per process and replica: each replica is its own curve."""
    sinks: list[Sink] = []
    for kind in parse_spec(spec):
        if kind == "tensorboard":
            sinks.append(TensorBoardSink(Path(directory) / "tensorboard" / name))
        else:
            sinks.append(WandbSink(directory, name=name, group=group, config=config))
    return sinks


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def scalars_of(kind: str, record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one metrics record: ``step``/``sync``/``end`` records (and
    ``Optimizer.metrics()``) give train, net, round, time and peer figures; an ``eval`` record
    the held-out loss and perplexity (its tokens and bytes under ``eval/`` too, so the held-out
    curve can be plotted against them). Round phases (``phases_s``) become ``round/phase/NAME``;
    per-peer rejections (``rejected_by_peer``) ``peers/rejected/PEER``; utilization is compute
    time over compute plus communication time."""
    if kind == "eval":
        out = {EVAL_NAMES[k]: v for k in EVAL_NAMES if (v := _number(record.get(k))) is not None}
        for key in ("tokens", "bytes_sent", "outer_step"):
            if (v := _number(record.get(key))) is not None:
                out[f"eval/{key}"] = v
        return out
    out = {NAMES[k]: v for k in NAMES if (v := _number(record.get(k))) is not None}
    for phase, seconds in (record.get("phases_s") or {}).items():
        if (v := _number(seconds)) is not None:
            out[f"round/phase/{phase}"] = v
    for peer, count in (record.get("rejected_by_peer") or {}).items():
        if (v := _number(count)) is not None:
            out[f"peers/rejected/{peer}"] = v
    compute, comm = _number(record.get("compute_s")), _number(record.get("comm_s"))
    if compute is not None and comm is not None and compute + comm > 0:
        out["time/utilization"] = compute / (compute + comm)
    return out


def rejected_by_peer(ledger: Any) -> dict[str, int]:
    """Updates rejected so far, per peer that had any (a :class:`ContributionLedger`)."""
    return {peer: rec.updates_rejected for peer in ledger.peers()
            if (rec := ledger.get(peer)).updates_rejected}


def optimizer_scalars(sync: Any, outcome: Any = None) -> dict[str, float]:
    """A :class:`farlink.Optimizer`'s figures as scalars: its ``metrics()`` (bytes, round time
    and phases, outer step, failed rounds), rejected updates per peer from its ledger, and from
    the step's ``outcome`` (when given and it ran a round) the live peers, the round's seconds
    and its rejections."""
    record = dict(sync.metrics())
    ledger = getattr(sync, "ledger", None)
    if ledger is not None:
        record["rejected_by_peer"] = rejected_by_peer(ledger)
    if outcome is not None and getattr(outcome, "synced", False):
        record.update(world_size=outcome.world_size, round_s=outcome.comm_seconds,
                      rejected=outcome.rejected)
    return scalars_of("step", record)


class Reporter:
    """Send a :class:`farlink.Optimizer`'s figures and your loss to sinks, in your own loop::

        report = farlink.Reporter(sync, farlink.open_sinks("tensorboard", "runs/me", name="w0"))
        outcome = sync.step(tokens=n)
        report(outcome, loss=loss.item(), tokens=n)   # every `every` steps, and every round
        ...
        report.close()

    ``step`` defaults to the optimizer's inner step; tokens are summed over calls."""

    def __init__(self, sync: Any, sinks: Iterable[Sink], *, every: int = 1) -> None:
        self.sync, self.sinks, self.every = sync, list(sinks), every
        self.tokens = 0
        self.calls = 0

    def __call__(self, outcome: Any = None, *, loss: float | None = None, tokens: int = 0,
                 step: int | None = None, **extra: float) -> dict[str, float]:
        """Log this step (when due: every ``every`` calls, and every step that ran a round);
        the scalars sent, or an empty dict when not due."""
        self.tokens += tokens
        self.calls += 1
        synced = outcome is not None and getattr(outcome, "synced", False)
        if self.calls % self.every and not synced:
            return {}
        scalars = optimizer_scalars(self.sync, outcome)
        scalars.update(scalars_of("step", {"loss": loss, "tokens": self.tokens}))
        scalars.update({k: float(v) for k, v in extra.items()})
        step = self.sync.inner_steps if step is None else step
        for sink in self.sinks:
            sink.log(step, scalars)
        return scalars

    def evaluation(self, step: int, loss: float) -> None:
        """A held-out loss measured at ``step``."""
        scalars = scalars_of("eval", {"loss": loss, "ppl": math.exp(min(loss, 50.0))})
        for sink in self.sinks:
            sink.log(step, scalars)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
