"""``farlink rl``: GRPO post-training of a base model with rollout workers, from one command.

This is the composition root of :mod:`farlink.rl`: it makes the base model (a ``farlink train``
run directory given with ``--base``, or the short recipe on the task's demonstrations, of a
preset or of ``--model hf:DIR``), the
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
from torch import nn

from farlink.codecs import make_codec
from farlink.comm.base import LinkModel
from farlink.data.tokenizer import load_tokenizer, train_tokenizer
from farlink.links import get_profile
from farlink.model.build import build_model, hf_model_dir, load_run_model
from farlink.rl.base import TextCodec, pretrain
from farlink.rl.board import RolloutBoard
from farlink.rl.broadcast import PolicyPublisher, PolicyReplica
from farlink.rl.evaluate import accuracy, sampled_accuracy
from farlink.rl.linked import LinkClock, LinkedBoard, LinkedPublisher
from farlink.rl.loop import run_group
from farlink.rl.tasks import Task, demonstrations, make_task
from farlink.rl.trainer import GRPOTrainer, RLConfig, StepLog
from farlink.rl.workers import BEHAVIOURS, RolloutWorker, worker_model

SEQ_LEN = 32
#: the default task and recipe, chosen so held-out accuracy rises within minutes on 2 cores:
#: sorting's held-out prompts share their structure with training ones (single-digit
#: addition's ten held-out facts share nothing a small model carries over), and a 1000-step
#: base is right on held-out prompts by its greedy answer but not yet by its samples, which
#: is what GRPO sharpens; 300 steps left it guessing (pass@1 0.16) and RL had little to sharpen
TASK = "sorting:3"
PRETRAIN_STEPS = 1000
LR = 3e-4  # 2e-3 collapsed the reward to 0 in 3 steps; 5e-4 rose the reward but slowly
STEPS = 60


@dataclass
class Base:
    """A base policy: its model, its tokenizer's codec, the task, and held-out problems."""

    model: nn.Module
    codec: TextCodec
    task: Task
    heldout: list
    pretrain_s: float = 0.0


_BASES: dict[tuple, dict] = {}  # one process's pre-trained weights, reused by bench scenarios


def make_base(task_spec: str, base_dir: Path | None = None, pretrain_steps: int = PRETRAIN_STEPS,
              correct_fraction: float = 0.6, seed: int = 0, heldout: int = 100,
              model_name: str = "nano") -> Base:
    """The base policy: read from a ``farlink train`` run, or the short recipe (cached in
    this process per arguments, so a bench's scenarios start from one base) on
    ``model_name``: a preset, or ``hf:DIR``, a local transformers causal LM (its weights when
    the directory has them, and its own ``tokenizer.json`` when it has one)."""
    task = make_task(task_spec)
    problems = task.heldout_set(heldout)
    if base_dir is not None:
        from farlink.train.export import run_tokenizer_path

        return Base(load_run_model(base_dir), TextCodec(load_tokenizer(run_tokenizer_path(base_dir))),
                    task, problems)
    documents = demonstrations(task, 20000, correct_fraction, seed=seed)
    directory = hf_model_dir(model_name)
    if directory is not None and (directory / "tokenizer.json").is_file():
        codec = TextCodec(load_tokenizer(directory))  # the ids its weights were trained with
    else:  # bytes plus end-of-text: one token per character keeps digits apart
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
    optimizer: torch.optim.Optimizer | None = None
    logs: list[dict] = field(default_factory=list)
    #: each worker's emulated link (``worker_link``), by worker name
    links: dict[str, LinkClock] = field(default_factory=dict)


def make_session(base: Base, config: RLConfig, *, workers: int = 2, lr: float = LR,
                 codec: str = "int4", malicious: list[str] = (), pace_seconds: float = 0.0,
                 worker_dtype: torch.dtype = torch.float32, step_fn=None,
                 worker_link: str | None = None) -> Session:
    """Trainer and workers around ``base.model`` (trained in place). ``step_fn`` replaces the
    AdamW step (e.g. a :class:`farlink.Optimizer`'s for DiLoCo between groups).
    ``worker_link``: a link profile (``home``, ...) each worker's fetches and hand-ins cross,
    emulated in-process (:mod:`farlink.rl.linked`)."""
    model = base.model
    publisher = PolicyPublisher(model, make_codec(codec), keep=max(config.max_staleness + 2, 4))
    board = RolloutBoard(base.task, base.codec, config.group_size, seed=config.seed,
                         version=lambda: publisher.version)
    optimizer = None
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
            raise ValueError(f"unknown worker kind {kind!r}; one of {BEHAVIOURS}")
    other = worker_model(model)
    with torch.no_grad():  # another model: the base with its weights perturbed
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    names = [f"{kind}-{i}" for i, kind in enumerate(kinds)]
    links = {name: worker_link_clock(worker_link) for name in names} if worker_link else {}
    crew = [RolloutWorker(name,
                          LinkedBoard(board, links[name]) if links else board,
                          LinkedPublisher(publisher, links[name]) if links else publisher,
                          PolicyReplica(worker_model(model), make_codec(codec),
                                        max_chain=config.max_staleness + 1),
                          config, behaviour=kind, pace_seconds=pace_seconds, dtype=worker_dtype,
                          other_model=other)
            for name, kind in zip(names, kinds)]
    return Session(trainer, crew, publisher, board, base, optimizer, links=links)


def worker_link_clock(profile: str) -> LinkClock:
    """A worker's access link of the named profile: its upload and download rates, and the
    per-hop latency the planner and ``--emulate-link`` charge (delay + jitter)."""
    link = get_profile(profile)
    if not link.shaped:
        raise ValueError(f"link profile {profile!r} is not shaped; nothing to emulate")
    return LinkClock(LinkModel.of(link.up_mbit, link.hop_latency_ms),
                     LinkModel.of(link.down_mbit, link.hop_latency_ms))


def save_state(root: Path, session: Session) -> Path:
    """Checkpoint a committed step: the model, the AdamW state, the served copy and its
    version, the next job number and the ledger (atomic; a crash keeps the previous one)."""
    from farlink.state.checkpoint import save_checkpoint

    # parameters, not state_dict(): a tied weight is saved once
    tensors = {f"model.{k}": v for k, v in session.base.model.named_parameters()}
    tensors.update({f"served.{k}": v for k, v in session.publisher.served.items()})
    groups = []
    if session.optimizer is not None:
        state = session.optimizer.state_dict()
        for index, values in state["state"].items():
            for key, value in values.items():
                tensors[f"opt.{index}.{key}"] = torch.as_tensor(value)
        groups = state["param_groups"]
    meta = {"step": session.trainer.step, "version": session.publisher.version,
            "next_job": session.board.next_job, "param_groups": groups,
            "ledger": session.trainer.ledger.to_dict()}
    return save_checkpoint(root, session.trainer.step, tensors, meta)


def restore_state(root: Path, session: Session) -> int | None:
    """Resume ``session`` from the newest intact checkpoint under ``root``; its step."""
    from farlink.robust.ledger import ContributionLedger
    from farlink.state.checkpoint import load_newest_intact

    restored = load_newest_intact(root)
    if restored.path is None:
        return None
    tensors, meta = restored.tensors, restored.meta
    model_state = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    missing = set(dict(session.base.model.named_parameters())) - set(model_state)
    if missing:
        raise ValueError(f"checkpoint {restored.path} lacks {sorted(missing)[:3]}")
    session.base.model.load_state_dict(model_state, strict=False)
    if session.optimizer is not None and meta["param_groups"]:
        state: dict = {}
        for key, value in tensors.items():
            if key.startswith("opt."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = value
        session.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    session.publisher.restore({k[7:]: v for k, v in tensors.items() if k.startswith("served.")},
                              meta["version"])
    session.board.restart_at(meta["next_job"])
    session.trainer.step = meta["step"]
    session.trainer.ledger = ContributionLedger.from_dict(meta["ledger"])
    return meta["step"]


def _accepted(session: Session, worker: str) -> int:
    ledger = session.trainer.ledger
    return ledger.get(worker).updates_accepted if worker in ledger.peers() else 0


def _link_figures(session: Session, worker: str) -> dict:
    clock = session.links.get(worker)
    if clock is None:
        return {}
    return {"link_s": clock.seconds, "link_bytes_up": clock.bytes_up,
            "link_bytes_down": clock.bytes_down}


def serve(session: Session, codec: str, host: str = "127.0.0.1", port: int = 0, **limits):
    """A server through which worker processes (``farlink rl-worker``) take jobs, fetch the
    policy and hand in, beside the session's thread workers; ``limits``: the server's
    ``idle_s``, ``max_connections``, ``max_per_host``."""
    from farlink.rl.remote import RolloutServer
    from farlink.train.rl_worker import hello_for

    hello = hello_for(session.base.model, codec, session.trainer.config, session.base.codec.eot)
    return RolloutServer(session.board, session.publisher, hello, host, port, **limits)


def spawn_workers(address: tuple[str, int], count: int, pace_seconds: float = 0.0,
                  prefix: str = "proc", *, identity_dir: Path) -> list:
    """``count`` local ``farlink rl-worker`` processes connected to ``address``, labelled
    ``prefix-i``, each with its own key ``identity_dir/prefix-i.key`` (made here when missing,
    so the caller knows every key id at once; kept for a rerun: the ledger knows a worker by
    its key)."""
    import subprocess
    import sys

    from farlink.robust.keys import load_or_generate

    labels = [f"{prefix}-{i}" for i in range(count)]
    for label in labels:
        load_or_generate(identity_dir / f"{label}.key")
    return [subprocess.Popen([sys.executable, "-m", "farlink.train.rl_worker",
                              "--connect", f"{address[0]}:{address[1]}", "--name", label,
                              "--identity", str(identity_dir / f"{label}.key"),
                              "--pace-seconds", str(pace_seconds)])
            for label in labels]


def run_session(session: Session, steps: int, eval_every: int = 10, max_wall_s: float = 1e9,
                out: Path | None = None, echo=None, checkpoints: Path | None = None,
                remote: bool = False, server=None) -> dict:
    """Train ``steps`` steps; held-out accuracy before, every ``eval_every`` steps and after.
    With the ``server`` worker processes use, the summary names the address each of them
    connected from (``worker_hosts``) and the label each key id gave (``worker_labels``)."""
    base = session.base
    started = time.monotonic()

    def heldout() -> float:  # sampled pass@1; greedy is kept for the summary
        return sampled_accuracy(base.model, base.codec, base.task, base.heldout,
                                session.trainer.config.max_new_tokens)

    def greedy() -> float:
        return accuracy(base.model, base.codec, base.task, base.heldout,
                        session.trainer.config.max_new_tokens)

    first, first_greedy = heldout(), greedy()
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
        if checkpoints is not None:
            save_state(checkpoints, session)
        if echo is not None:
            echo(row)

    loop_started = time.monotonic()
    run_group(session.trainer, session.workers, steps, on_step, max_wall_s, remote=remote)
    loop_s = time.monotonic() - loop_started
    final = heldout()
    summary = {
        "heldout_accuracy_base": first, "heldout_accuracy_final": final,
        "heldout_greedy_base": first_greedy, "heldout_greedy_final": greedy(),
        "steps": session.trainer.step, "rollouts_used": total,
        "rollouts_made": sum(w.rollouts_done for w in session.workers),
        "groups_handed_in": session.board.submissions,
        "groups_accepted": {peer: session.trainer.ledger.get(peer).updates_accepted
                            for peer in session.trainer.ledger.peers()},
        "wall_s": time.monotonic() - started, "loop_s": loop_s,
        "rejections": [list(r) for r in session.trainer.rejections],
        "bytes_full_fp32": session.publisher.full_bytes,
        "workers": {w.name: {"rollouts": w.rollouts_done, "bytes_received": w.replica.bytes_received,
                             "full_fetches": w.replica.full_fetches,
                             "delta_updates": w.replica.delta_updates,
                             "groups_accepted": _accepted(session, w.name),
                             "forged_groups_handed_in": len(w.forged_jobs),
                             "forged_groups_accepted": len(w.forged_jobs
                                                           & session.trainer.accepted_jobs),
                             "delta_bytes_per_version": w.replica.delta_bytes
                             / max(w.replica.delta_versions, 1),
                             **_link_figures(session, w.name)}
                    for w in session.workers},
    }
    if server is not None:  # worker processes are named by key id; their labels beside
        summary["worker_hosts"] = {name: sorted(hosts)
                                   for name, hosts in sorted(server.worker_hosts.items())}
        summary["worker_labels"] = dict(sorted(server.worker_labels.items()))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "steps.jsonl", "a") as fh:  # a resumed run continues the log
            fh.write("".join(json.dumps(r) + "\n" for r in session.logs))
        session.trainer.ledger.save(out / "ledger.json")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
