"""``farlink train --pipeline-stages S``: a run whose model is cut into stages on different peers.

The launcher becomes the pipeline trainer (SWARM's trainer, :mod:`farlink.parallel.pipeline`):
it starts S x P stage peers (``python -m farlink.parallel.stage_server``), P replicas of the
pipeline, and each step feeds every replica ``batch_size`` sequences of its own data shard in
``pipeline_micro_batches`` micro-batches. Replica p's micro-batches are wired through its own
peers while they live; when one dies, its stage's other peers take its micro-batches. Every
``inner_steps`` steps the peers of each stage meet in the run's outer step
(:mod:`farlink.parallel.stage_sync`: a round of the run's algorithm among a stage's peers,
through its exchange: codec, authentication, robust aggregation as in any run).

The run's outputs are those of any ``farlink train``: ``metrics/pipeline.jsonl`` (steps, outer
rounds, held-out evaluations, checkpoints), ``checkpoints/sSpJ/`` written by each stage peer
itself (weights and AdamW moments) next to ``checkpoints/trainer/`` (the stages' shared θ,
outer momentum, data positions and step), every one atomic and digested, ``model.safetensors``
(the unsplit GPT: export and generate work on it) and ``summary.json``. ``--resume`` restarts
the peers and loads all of them from the newest step the trainer's checkpoint verifies at.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from farlink import interrupt, lifeline
from farlink.comm.base import LinkModel
from farlink.compose import build_stage_members
from farlink.config import RunConfig
from farlink.data import PreparedData, ShardSampler, heldout_batches
from farlink.data.eval import perplexity
from farlink.links import get_profile
from farlink.model import GPT, preset_config
from farlink.parallel import stage_auth, wire
from farlink.parallel.peers import StagePeer, start_stage_peer, stop_pipeline
from farlink.parallel.pipeline import PeerFailure, PipelineTrainer, StageError
from farlink.parallel.stage_sync import StageAveraging
from farlink.parallel.swarm_router import StageUnavailable
from farlink.parallel.stages import build_stage, model_parameter_name, stage_bounds
from farlink.state.checkpoint import (is_disk_full, load_newest_intact,
                                      remove_stale_temps, save_checkpoint)
from farlink.state.files import temp_path
from farlink.sync.schedule import make_schedule
from farlink.train.console import console
from farlink.loggers import open_sinks
from farlink.train.metrics import MetricsLog, read_metrics
from farlink.train.result import RunResult

TRAINER = "trainer"  # checkpoints/trainer: what the trainer itself holds


def peer_name(stage: int, replica: int) -> str:
    """``s1p0``: stage 1's peer of pipeline replica 0 (its log, checkpoints and metrics)."""
    return f"s{stage}p{replica}"


class PipelineRun:
    """One pipelined run: its peers, trainer, outer step, data, metrics and checkpoints."""

    def __init__(self, cfg: RunConfig, data: PreparedData) -> None:
        self.cfg, self.data = cfg, data
        self.stages, self.replicas = cfg.pipeline_stages, cfg.pipeline_peers_per_stage
        self.config = preset_config(cfg.model, vocab_size=data.vocab_size, seq_len=cfg.seq_len)
        self.bounds = stage_bounds(self.config.n_layer, self.stages)
        self.checkpoints = cfg.run_dir / "checkpoints"
        self.metrics = MetricsLog(cfg.run_dir / "metrics" / "pipeline.jsonl",
                                  open_sinks(cfg.log_to, cfg.run_dir, name="pipeline"))
        self.samplers = [ShardSampler(data.train, p, self.replicas, cfg.seq_len, cfg.batch_size,
                                      cfg.seed) for p in range(self.replicas)]
        self.heldout = heldout_batches(data.heldout, cfg.seq_len, cfg.batch_size,
                                       cfg.eval_batches)
        self.peers: list[list[StagePeer]] = []
        self.names: dict[str, str] = {}  # address -> peer name
        self.step = 0
        self.saved_step = -1  # the step of the newest checkpoint
        self.tokens = 0
        self.evals: list[dict] = []
        # the per-run token only this launcher and the stage peers it starts hold: nobody
        # else on the machine can drive them (docs/trust.md)
        self.token = stage_auth.new_token()
        #: when the stages' rounds fall and when the run ends: every inner_steps steps, or
        #: with --round-seconds every round_seconds of training (steps / inner_steps rounds)
        self.schedule = make_schedule(cfg.inner_steps, cfg.steps, cfg.round_seconds)
        self.round_step = 0  # the step of the stages' last round
        #: --emulate-link: every stage peer's link (activations, gradients, the trainer's
        #: averaging traffic) and the link its stage's members exchange over
        self.link = (LinkModel.of_profile(get_profile(cfg.emulate_link))
                     if cfg.emulate_link is not None else None)

    # -- peers --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every stage peer at once (each imports torch and builds the model: started
        one after another they would take S x P times as long) and wait for all of them."""
        from concurrent.futures import ThreadPoolExecutor

        cfg = self.cfg

        def start_one(s: int, p: int) -> StagePeer:
            return start_stage_peer(
                self.config, s, self.stages, seed=cfg.seed, lr=cfg.lr,
                weight_decay=cfg.weight_decay, slowdown=cfg.slowdown_of(s * self.replicas + p),
                host=cfg.host, threads=cfg.threads,
                log_path=cfg.run_dir / "logs" / f"{peer_name(s, p)}.log",
                env=lifeline.child_env(), token=self.token,
                checkpoint_dir=self.checkpoints / peer_name(s, p))

        with ThreadPoolExecutor(self.stages * self.replicas) as pool:
            futures = [[pool.submit(start_one, s, p) for p in range(self.replicas)]
                       for s in range(self.stages)]
        started = [[f.result() for f in row if f.exception() is None] for row in futures]
        failed = [f.exception() for row in futures for f in row if f.exception() is not None]
        if failed:
            stop_pipeline(started)
            raise failed[0]
        self.peers = started
        self.names = {peer.address: peer_name(s, p) for s, row in enumerate(started)
                      for p, peer in enumerate(row)}
        addresses = [[peer.address for peer in row] for row in self.peers]
        self.trainer = PipelineTrainer(
            addresses, micro_batches=self.replicas * self.micro_batches_per_replica,
            activation_codec=cfg.activation_codec, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
            total_steps=cfg.steps, auth=stage_auth.driver_auth(self.token),
            timeout=cfg.stage_peer_timeout, width=self.config.d_model,
            links={address: self.link for row in addresses for address in row}
            if self.link is not None else None,
            pipelines=[[addresses[s][p] for s in range(self.stages)]
                       for p in range(self.replicas)])
        self.outer = StageAveraging(
            [build_stage_members(cfg, s, addresses[s],
                                 lambda s=s: build_stage(self.config, cfg.seed, s, self.stages))
             for s in range(self.stages)],
            self.trainer.router.live, self._fetch, self._store)

    def _fetch(self, peer: str) -> dict[str, torch.Tensor] | None:
        try:
            return self.trainer.call(peer, wire.Message("state"), "averaging").tensors
        except PeerFailure:
            self.trainer.router.failed(peer)
            return None

    def _store(self, peer: str, tensors: dict[str, torch.Tensor]) -> None:
        try:
            self.trainer.call(peer, wire.Message("load", {}, tensors), "averaging")
        except PeerFailure:
            self.trainer.router.failed(peer)

    def stop(self) -> None:
        stop_pipeline(self.peers)

    # -- data ---------------------------------------------------------------------------------
    @property
    def micro_batches_per_replica(self) -> int:
        """Micro-batches of one replica's step: ``pipeline_micro_batches`` per batch of its
        ``grad_accum`` batches (a step's gradient is accumulated over all of them, as a worker
        accumulates over its ``grad_accum`` batches)."""
        return self.cfg.pipeline_micro_batches * self.cfg.grad_accum

    def _replica_batch(self, sampler: ShardSampler) -> tuple[torch.Tensor, torch.Tensor]:
        """One replica's step: ``grad_accum`` batches of its shard, one after another."""
        batches = [sampler.next_batch() for _ in range(self.cfg.grad_accum)]
        return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every replica's batch from its own shard, laid out so that the trainer's micro-batch
        i (wired to replica i mod P) holds rows of replica i mod P's shard."""
        m = self.micro_batches_per_replica
        batches = [self._replica_batch(sampler) for sampler in self.samplers]
        xs = [x.chunk(m) for x, _ in batches]
        ys = [y.chunk(m) for _, y in batches]
        order = [(j, p) for j in range(m) for p in range(self.replicas)]
        return (torch.cat([xs[p][j] for j, p in order]),
                torch.cat([ys[p][j] for j, p in order]))

    # -- checkpoints --------------------------------------------------------------------------
    def save(self) -> None:
        """Every live peer checkpoints itself, then the trainer publishes its own checkpoint of
        the same step: a step the trainer's checkpoint names has every peer's part written."""
        started = time.perf_counter()
        for s, row in enumerate(self.peers):
            for p, peer in enumerate(row):
                if peer.address not in self.trainer.router.live(s):
                    continue
                try:
                    self.trainer.call(peer.address, wire.Message("save", {"step": self.step}),
                                      "control")
                except PeerFailure:
                    self.trainer.router.failed(peer.address)
        meta = {"step": self.step, "tokens": self.tokens,
                "samplers": [sampler.state_dict() for sampler in self.samplers],
                "stages": self.stages, "replicas": self.replicas}
        path = save_checkpoint(self.checkpoints / TRAINER, self.step, self.outer.state_dict(),
                               meta)
        self.saved_step = self.step
        self.metrics.write("checkpoint", step=self.step, path=str(path),
                           seconds=round(time.perf_counter() - started, 3))

    def resume(self) -> bool:
        """Continue from the newest verified trainer checkpoint; each peer loads its own
        checkpoint of that step, or, when it has none that verifies, the stage's shared θ with
        fresh AdamW moments (said on the console and in the metrics). False: nothing to resume."""
        restored = load_newest_intact(self.checkpoints / TRAINER)
        for path, reason in restored.rejected:
            self.metrics.write("checkpoint_rejected", path=str(path), reason=reason)
            console.print(f"[yellow]{reason}; set aside as {path.name}[/]")
        if restored.path is None:
            return False
        meta = restored.meta
        if (meta["stages"], meta["replicas"]) != (self.stages, self.replicas):
            raise ValueError(f"{restored.path} is a run of {meta['stages']} stages x "
                             f"{meta['replicas']} peers, not {self.stages} x {self.replicas}")
        self.step, self.tokens = int(meta["step"]), int(meta["tokens"])
        # the evaluations of the state resumed from and before it, for the summary's curve
        self.evals = [{k: r[k] for k in ("step", "tokens", "loss", "ppl", "bytes_sent",
                                         "seconds")}
                      for r in read_metrics(self.metrics.path)
                      if r["kind"] == "eval" and r["step"] <= self.step]
        self.outer.load_state_dict(restored.tensors)
        self.round_step = (self.step if self.schedule.timed
                           else self.step - self.step % self.cfg.inner_steps)
        for sampler, state in zip(self.samplers, meta["samplers"]):
            sampler.load_state_dict(state)
        self.trainer.steps = self.step
        for s, row in enumerate(self.peers):
            for p, peer in enumerate(row):
                root = self.checkpoints / peer_name(s, p)
                try:
                    self.trainer.call(peer.address, wire.Message("restore", {"step": self.step}),
                                      "control")
                except StageError as exc:
                    self.metrics.write("checkpoint_rejected", path=str(root), reason=str(exc))
                    console.print(f"[yellow]{peer_name(s, p)}: {exc}; it continues from stage "
                                  f"{s}'s shared weights with fresh AdamW moments[/]")
                    self._store(peer.address, self.outer.globals[s])
        self.metrics.write("resume", step=self.step, path=str(restored.path))
        return True

    # -- training -----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        started = time.perf_counter()
        loss = self.trainer.evaluate(self.heldout)
        record = {"step": self.step, "tokens": self.tokens, "loss": loss,
                  "ppl": perplexity(loss), "bytes_sent": sum(self.trainer.bytes.values()),
                  "seconds": round(time.perf_counter() - started, 3)}
        self.metrics.write("eval", **record)
        self.evals.append(record)
        return record

    @property
    def done(self) -> bool:
        """Whether the run's budget is spent: its steps, or a time budget's rounds."""
        return self.schedule.finished(self.step, self.outer.rounds)

    def round_due(self) -> bool:
        """Whether the stages' round falls after the step just taken (and the run's last
        step, in steps, ends with one)."""
        return self.schedule.due(self.step) or (not self.schedule.timed and self.done)

    def train_step(self) -> float:
        tokens, targets = self.next_batch()
        report = self.trainer.step(tokens, targets,
                                   self.schedule.lr_step(self.step, self.outer.rounds))
        self.schedule.step_taken()
        self.step += 1
        self.tokens += report.tokens
        refused = {self.names.get(p, p): why for p, why in report.refused.items()}
        for name, why in refused.items():
            console.print(f"[yellow]step {self.step}: {name} refused ({why}); it is out and "
                          "its stage's other peers took its work[/]")
        if self.step % self.cfg.log_every == 0 or report.reroutes:
            self.metrics.write("step", step=self.step, loss=report.loss, tokens=self.tokens,
                               seconds=round(report.seconds, 4), reroutes=report.reroutes,
                               failed_peers=[self.names.get(p, p) for p in report.failed_peers],
                               refused=refused, bytes=report.bytes)
        return report.loss

    def outer_round(self) -> None:
        """The stages' outer step, then (on their cadence) evaluation and checkpoint; the next
        round's period starts after them."""
        started = time.perf_counter()
        final = self.schedule.last_round_due(self.step, self.outer.rounds)
        # what each pipeline replica trained on since the stages' last round
        self.outer.sync(max(self.step - self.round_step, 1) * self.cfg.tokens_per_step)
        self.round_step = self.step
        rounds = self.outer.rounds
        left_out = {self.names.get(p, p): why for _, p, why in self.outer.left_out}
        for name, why in left_out.items():
            console.print(f"[yellow]outer step {rounds}: {name} left out of its stage's "
                          f"average ({why}); it continues from the stage's new weights[/]")
        self.metrics.write("sync", step=self.step, outer_step=rounds, left_out=left_out,
                           seconds=round(time.perf_counter() - started, 3),
                           exchange_bytes=self.outer.exchange_bytes,
                           live_peers=[len(self.trainer.router.live(s))
                                       for s in range(self.stages)])
        if rounds % self.cfg.eval_every == 0 or final:
            self.evaluate()
        if rounds % self.cfg.checkpoint_every == 0 or final:
            self.save()
        self.schedule.start_period()

    def save_model(self) -> tuple[Path, str]:
        """The stages' shared θ as one unsplit GPT in ``model.safetensors`` (atomic); its
        SHA-256."""
        from safetensors.torch import save_model

        model = GPT(self.config)
        state = {}
        for (start, _), theta in zip(self.bounds, self.outer.globals):
            for name, tensor in theta.items():
                if name != "lm_head.weight":  # the unsplit model's head is its embedding
                    state[model_parameter_name(name, start)] = tensor
        state["lm_head.weight"] = state["embed.weight"]
        model.load_state_dict(state)
        path = self.cfg.run_dir / "model.safetensors"
        remove_stale_temps(path.parent)
        tmp = temp_path(path)
        save_model(model, str(tmp))
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        os.replace(tmp, path)
        return path, digest

    def summary(self, wall_s: float, model: tuple[Path, str] | None) -> dict:
        cfg, final = self.cfg, (self.evals or [None])[-1]
        moved = self.trainer.bytes
        return {
            "algorithm": cfg.algorithm, "pipeline_stages": self.stages,
            "peers_per_stage": self.replicas, "workers": self.stages * self.replicas,
            "activation_codec": cfg.activation_codec, "inner_steps": cfg.inner_steps,
            "steps": cfg.steps, "steps_done": self.step, "outer_steps": self.outer.rounds,
            "round_seconds": cfg.round_seconds,
            "final_heldout_loss": final["loss"] if final else None,
            "final_heldout_ppl": final["ppl"] if final else None,
            "total_tokens": self.tokens, "wall_s": round(wall_s, 3),
            "bytes_by_kind": dict(moved),
            # what the stages' members sent each other in their rounds (codec, signatures)
            "stage_exchange_bytes": self.outer.exchange_bytes,
            "bytes_per_token": sum(moved.values()) / max(self.tokens, 1),
            "live_peers": {self.names[peer.address]: peer.address in self.trainer.router.live(s)
                           for s, row in enumerate(self.peers) for peer in row},
            "evals": self.evals,
            **({"model": str(model[0]), "model_sha256": model[1]} if model else {}),
        }


def train_pipeline(cfg: RunConfig, data: PreparedData, show_progress: bool = True):
    """Run ``cfg`` (``pipeline_stages`` >= 2) to its end, a stop point or Ctrl-C."""
    from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    run = PipelineRun(cfg, data)
    started = time.perf_counter()
    interrupted, model, problem = False, None, None
    console.print(f"pipeline: {run.stages} stages (blocks "
                  f"{', '.join(f'{a}-{b - 1}' for a, b in run.bounds)}) x {run.replicas} peers "
                  f"each, {cfg.algorithm} within a stage every {cfg.inner_steps} steps, "
                  f"activations {cfg.activation_codec}")
    columns = [TextColumn("[bold blue]{task.description}"), BarColumn(),
               TextColumn("{task.completed}/{task.total} {task.fields[unit]}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    try:
        with console.status("starting stage peers"):
            run.start()
        if not (cfg.resume and run.resume()):
            run.evaluate()  # the initial state's held-out loss: what training improves on
        with Progress(*columns, console=console, disable=not show_progress) as progress:
            timed = run.schedule.timed  # a time budget's progress is its rounds
            task = progress.add_task(
                "training", total=run.schedule.total_rounds if timed else cfg.steps,
                completed=run.outer.rounds if timed else run.step, info="",
                unit="rounds" if timed else "steps")
            run.schedule.start_period()
            while not run.done:
                interrupt.check()
                loss = run.train_step()
                if run.round_due():
                    run.outer_round()
                if cfg.stop_at_step == run.step and run.saved_step != run.step:
                    run.save()  # each peer keeps its own drifted weights: nothing is lost
                info = f"loss {loss:.3f}"
                if run.evals:
                    info += f" | held-out {run.evals[-1]['loss']:.3f}"
                progress.update(task, completed=run.outer.rounds if timed else run.step,
                                info=info)
                if cfg.stop_at_step == run.step:
                    break
        if run.done:
            model = run.save_model()
    except (StageUnavailable, StageError) as exc:
        problem = str(exc)
        console.print(f"[red]error: {exc}; logs of the stage peers in {cfg.run_dir / 'logs'}[/]")
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted: the stage peers stop; the last checkpoint is the "
                      "run's committed state[/]")
    finally:
        run.stop()
    summary = run.summary(time.perf_counter() - started, model)
    if problem is not None:
        summary["problem"] = problem
    run.metrics.write("end", step=run.step, tokens=run.tokens, wall_s=summary["wall_s"],
                      model_sha256=model[1] if model else None, bytes=summary["bytes_by_kind"])
    run.metrics.close()
    try:
        (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        console.print(f"[red]disk full writing {cfg.run_dir / 'summary.json'}[/]")
    if interrupted or not run.done:
        console.print(f"checkpoints kept under {run.checkpoints}; continue with "
                      f"`farlink train --resume --run-dir {cfg.run_dir}`")
    return RunResult(cfg.run_dir, [], summary, interrupted, problem)
