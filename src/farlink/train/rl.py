"""``farlink rl``: GRPO post-training of a base model with rollout workers, from one command.

This is the composition root of :mod:`farlink.rl`: it makes the base model (a ``farlink train``
run directory given with ``--base``, or the short recipe on the task's demonstrations), the
tokenizer, the codec of policy deltas, the trainer and its workers (honest ones, and with
``--malicious KIND`` cheats the verifier must catch), runs them, and writes per-step logs
(``steps.jsonl``: reward, held-out accuracy, KL, response length, staleness), the ledger of
workers (``ledger.json``) and a summary (``summary.json``) to ``--out``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import typer
from torch import nn

from farlink.codecs import make_codec
from farlink.data.tokenizer import train_tokenizer
from farlink.model.build import build_model, load_run_model
from farlink.rl.base import TextCodec, pretrain
from farlink.rl.board import RolloutBoard
from farlink.rl.broadcast import PolicyPublisher, PolicyReplica
from farlink.rl.evaluate import accuracy
from farlink.rl.loop import run_group
from farlink.rl.tasks import Task, demonstrations, make_task
from farlink.rl.trainer import GRPOTrainer, RLConfig, StepLog
from farlink.rl.workers import BEHAVIOURS, RolloutWorker, worker_model

SEQ_LEN = 32


@dataclass
class Base:
    """A base policy: its model, its tokenizer's codec, the task, and held-out problems."""

    model: nn.Module
    codec: TextCodec
    task: Task
    heldout: list
    pretrain_s: float = 0.0


_BASES: dict[tuple, dict] = {}  # one process's pre-trained weights, reused by bench scenarios


def make_base(task_spec: str, base_dir: Path | None = None, pretrain_steps: int = 300,
              correct_fraction: float = 0.3, seed: int = 0, heldout: int = 100,
              model_name: str = "nano") -> Base:
    """The base policy: read from a ``farlink train`` run, or the short recipe (cached in
    this process per arguments, so a bench's scenarios start from one base)."""
    task = make_task(task_spec)
    problems = task.heldout_set(heldout)
    if base_dir is not None:
        from farlink.data.tokenizer import load_tokenizer
        from farlink.train.export import run_tokenizer_path

        return Base(load_run_model(base_dir), TextCodec(load_tokenizer(run_tokenizer_path(base_dir))),
                    task, problems)
    documents = demonstrations(task, 20000, correct_fraction, seed=seed)
    # bytes plus end-of-text: one token per character keeps digits apart
    codec = TextCodec(train_tokenizer(documents[:2000], 257))
    key = (task_spec, pretrain_steps, correct_fraction, seed, model_name)
    torch.manual_seed(seed)
    model = build_model(model_name, codec.tokenizer.get_vocab_size(), SEQ_LEN)
    started = time.monotonic()
    if key not in _BASES:
        pretrain(model, codec, documents, pretrain_steps, seed=seed)
        _BASES[key] = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(_BASES[key])
    return Base(model.eval(), codec, task, problems, time.monotonic() - started)


@dataclass
class Session:
    """One trainer replica group, its workers and what they share."""

    trainer: GRPOTrainer
    workers: list[RolloutWorker]
    publisher: PolicyPublisher
    board: RolloutBoard
    base: Base
    logs: list[dict] = field(default_factory=list)


def make_session(base: Base, config: RLConfig, *, workers: int = 2, lr: float = 1e-3,
                 codec: str = "int4", malicious: list[str] = (), pace_seconds: float = 0.0,
                 worker_dtype: torch.dtype = torch.float32, step_fn=None) -> Session:
    """Trainer and workers around ``base.model`` (trained in place). ``step_fn`` replaces the
    AdamW step (e.g. a :class:`farlink.Optimizer`'s for DiLoCo between groups)."""
    model = base.model
    publisher = PolicyPublisher(model, make_codec(codec), keep=max(config.max_staleness + 2, 4))
    board = RolloutBoard(base.task, base.codec, config.group_size, seed=config.seed,
                         version=lambda: publisher.version)
    if step_fn is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

        def step_fn(tokens: int) -> None:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    reference = worker_model(model) if config.kl_coef > 0 else None
    trainer = GRPOTrainer(model, step_fn, board, publisher, worker_model(model), config,
                          reference=reference)
    kinds = ["honest"] * workers + list(malicious)
    for kind in malicious:
        if kind not in BEHAVIOURS:
            raise typer.BadParameter(f"unknown worker kind {kind!r}; one of {BEHAVIOURS}")
    other = worker_model(model)
    with torch.no_grad():  # another model: the base with its weights perturbed
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    crew = [RolloutWorker(f"{kind}-{i}", board, publisher,
                          PolicyReplica(worker_model(model), make_codec(codec),
                                        max_chain=config.max_staleness + 1),
                          config, behaviour=kind, pace_seconds=pace_seconds, dtype=worker_dtype,
                          other_model=other)
            for i, kind in enumerate(kinds)]
    return Session(trainer, crew, publisher, board, base)


def run_session(session: Session, steps: int, eval_every: int = 10, max_wall_s: float = 1e9,
                out: Path | None = None, echo=None) -> dict:
    """Train ``steps`` steps; held-out accuracy before, every ``eval_every`` steps and after."""
    base = session.base
    started = time.monotonic()

    def heldout() -> float:
        return accuracy(base.model, base.codec, base.task, base.heldout,
                        session.trainer.config.max_new_tokens)

    first = heldout()
    session.logs.append({"step": -1, "heldout_accuracy": first, "wall_s": 0.0, "rollouts_total": 0})
    total = 0

    def on_step(log: StepLog) -> None:
        nonlocal total
        total += log.rollouts
        row = {**log.as_dict(), "rollouts_total": total,
               "wall_s": time.monotonic() - started}
        if (log.step + 1) % eval_every == 0:
            row["heldout_accuracy"] = heldout()
        session.logs.append(row)
        if echo is not None:
            echo(row)

    run_group(session.trainer, session.workers, steps, on_step, max_wall_s)
    final = heldout()
    summary = {
        "heldout_accuracy_base": first, "heldout_accuracy_final": final,
        "steps": session.trainer.step, "rollouts_used": total,
        "rollouts_made": sum(w.rollouts_done for w in session.workers),
        "wall_s": time.monotonic() - started,
        "rejections": [list(r) for r in session.trainer.rejections],
        "bytes_full_fp32": session.publisher.full_bytes,
        "workers": {w.name: {"rollouts": w.rollouts_done, "bytes_received": w.replica.bytes_received,
                             "full_fetches": w.replica.full_fetches,
                             "delta_updates": w.replica.delta_updates}
                    for w in session.workers},
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in session.logs))
        session.trainer.ledger.save(out / "ledger.json")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @app.command("rl")
    def rl(
        task: str = typer.Option("addition:1", help="addition[:D], sorting[:N], countdown[:N] "
                                 "or FILE.jsonl ({prompt, answer} a line)"),
        base: Path | None = typer.Option(None, help="a `farlink train` run directory to start "
                                         "from (default: pre-train on the task's examples)"),
        pretrain_steps: int = typer.Option(300, help="steps of the base-model recipe"),
        steps: int = typer.Option(40, help="GRPO steps"),
        workers: int = typer.Option(2, help="honest rollout workers (threads)"),
        malicious: list[str] = typer.Option([], help=f"add a cheating worker: {BEHAVIOURS[1:]}"),
        group_size: int = typer.Option(8, help="completions per prompt"),
        groups_per_step: int = typer.Option(8, help="prompts per step"),
        max_staleness: int = typer.Option(2, help="oldest policy version a rollout may use"),
        deadline: float = typer.Option(5.0, help="seconds a step waits for rollouts"),
        lr: float = typer.Option(1e-3),
        kl_coef: float = typer.Option(0.0, help="KL penalty to the base model"),
        codec: str = typer.Option("int4", help="codec of policy deltas to workers"),
        verify_fraction: float = typer.Option(0.25, help="groups recomputed (>= 1 per worker)"),
        pace_seconds: float = typer.Option(0.0, help="each job takes at least this long"),
        out: Path = typer.Option(Path("runs/rl"), help="logs, ledger and summary"),
        seed: int = typer.Option(0),
    ) -> None:
        """GRPO post-training with rollout workers whose rollouts are verified."""
        torch.set_num_threads(1)
        config = RLConfig(group_size=group_size, groups_per_step=groups_per_step,
                          max_staleness=max_staleness, deadline_s=deadline, kl_coef=kl_coef,
                          verify_fraction=verify_fraction, seed=seed)
        session = make_session(make_base(task, base, pretrain_steps, seed=seed), config,
                               workers=workers, lr=lr, codec=codec, malicious=malicious,
                               pace_seconds=pace_seconds)

        def echo(row: dict) -> None:
            acc = row.get("heldout_accuracy")
            typer.echo(f"step {row['step']:4d} reward {row['reward']:.3f} kl {row['kl']:.4f} "
                       f"len {row['response_len']:.1f} staleness {row['staleness_mean']:.1f} "
                       f"rejected {row['rejected_groups']}"
                       + (f" heldout {acc:.3f}" if acc is not None else ""))

        summary = run_session(session, steps, out=out, echo=echo)
        typer.echo(f"held-out accuracy {summary['heldout_accuracy_base']:.3f} -> "
                   f"{summary['heldout_accuracy_final']:.3f}; rejected: "
                   f"{len(summary['rejections'])}; logs in {out}")

    @bench_app.command("rl")
    def bench_rl(
        out: Path = typer.Option(Path("docs/results"), help="output directory"),
        steps: int = typer.Option(30, help="GRPO steps per scenario"),
        seeds: int = typer.Option(3, help="seeds of the accuracy-rise scenario"),
    ) -> None:
        """Accuracy and reward vs wall-clock and rollouts; workers 1/2/4, staleness, cheats."""
        from farlink.bench.rl import run

        run(out, steps, seeds)
