"""One worker process: inner steps on its own data shard, outer rounds through the collective.

The worker is a client of the public API, like any user's loop: it builds the model, the data
and the inner optimizer, and hands them to :class:`farlink.Optimizer`, which owns the backend,
the exchange, the algorithm, joining and checkpoints. What stays here is the loop and what only
``farlink train`` does: evaluation, emulated device speeds, the metrics JSONL, the final model.

Started as ``python -m farlink.worker RUN_DIR INDEX`` by the launcher, by ``farlink join``, or
by a standard launcher (torchrun, SLURM, Kubernetes): :mod:`farlink.worker` is the one entry.
The worker checkpoints after every committed round (atomic), so SIGINT, SIGTERM or SIGKILL at
any instant loses at most the uncommitted inner steps of the current round; committed progress is
never lost. On resume it restores parameters, optimizer states, data position and RNG exactly.

Checkpoint writes and held-out evaluations run beside training (:mod:`farlink.state.background`):
at a boundary the loop only copies tensors in memory and goes on, so its peers never wait for it
to evaluate or write. Its time accounts count everything: ``compute_s`` (inner steps),
``comm_s`` (blocked in rounds), ``eval_s`` and ``checkpoint_s`` (what evaluation and checkpoints
still cost the loop: the copies, and waiting for a job still running), ``setup_s`` (process start
to the first step) and ``wall_s``, all wall-clock since the process started (earlier lives
included after a resume).
"""

from __future__ import annotations

import copy
import glob
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from farlink import interrupt
from farlink.config import RunConfig
from farlink.state.background import Background
from farlink.state.checkpoint import (EXIT_DISK_FULL, DiskFull, is_disk_full,
                                      remove_stale_temps)
from farlink.state.files import TEMP_PREFIX, temp_path
from farlink.loggers import rejected_by_peer
from farlink.train.metrics import MetricsLog

log = logging.getLogger("farlink.worker")


def process_started_at() -> float:
    """When this process started (epoch seconds; Linux's /proc), so that wall-clock also counts
    the interpreter, imports and setup; elsewhere, the first call of this function."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class SilentLog:
    """The metrics log of a replica group's ranks other than 0: rank 0 writes the worker's
    records."""

    def write(self, kind: str, *, extra_scalars=None, **fields) -> None:
        pass

    def close(self) -> None:
        pass


class Worker:
    def __init__(self, cfg: RunConfig, index: int, lighthouse: str, joining: bool = False,
                 collective=None, shard_claim=None) -> None:
        from farlink import Optimizer
        from farlink.data import ShardSampler, heldout_batches, prepare_data
        from farlink.model.build import build_model
        from farlink.sync import capabilities
        from farlink.train.compute import resolve_device

        self.cfg, self.index = cfg, index
        # None: this process is the whole replica
        self.replica_group = self._join_replica_group(cfg, index)
        self.device = (resolve_device(cfg.device, index) if self.replica_group is None
                       else self.replica_group.device(cfg.device))
        if self.replica_group is not None:
            from farlink.compose import advertised_host

            self.replica_group.start(host=advertised_host(cfg), device=self.device)
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir,
                                 tokenizer=cfg.given_tokenizer)
        self.model = build_model(cfg.model, self.data.vocab_size, cfg.seq_len).to(self.device)
        if self.replica_group is not None and cfg.sharding == "fsdp":
            from farlink.parallel.sharding import shard_model

            shard_model(self.model)  # FSDP2 over the replica group's ranks: each holds 1/K of it
        # with ddp every rank holds the whole replica; farlink.Optimizer averages the gradients
        self.sampler = ShardSampler(
            self.data.train, shard=index % cfg.workers, num_shards=cfg.workers,
            seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
        )
        self.heldout = heldout_batches(self.data.heldout, cfg.seq_len, cfg.batch_size,
                                       cfg.eval_batches)
        if capabilities(cfg.algorithm).islands:
            from farlink.train.network import NetworkPlan

            if NetworkPlan.load(cfg.run_dir) is None:
                raise SystemExit(f"{cfg.run_dir}/network.json is missing: {cfg.algorithm} "
                                 "workers are started by the launcher (farlink train), which "
                                 "forms the islands")
        # no inner optimizer given: the algorithm's own (AdamW), on farlink's lr schedule
        join = ({"peers": lighthouse} if cfg.backend == "hivemind" and lighthouse is not None
                else {"lighthouse": lighthouse})  # the launcher's one address, named per backend
        # score_data: with --score loss every peer's update is judged by the loss drop it
        # gives on batches of this corpus (the composition root builds the scorer)
        self.sync = Optimizer(self.model, None, config=cfg, index=index, lr_schedule=True,
                              collective=collective, replica_group=self.replica_group,
                              score_data=self.data, **join)
        self.replica_id = self.sync.replica_id
        self.ckpt_dir = cfg.run_dir / "checkpoints" / self.replica_id
        # a replica group's rank 0 reports for the replica: one metrics file per worker, as with K=1
        self.reports = self.replica_group is None or self.replica_group.rank == 0
        self.metrics = (MetricsLog(cfg.run_dir / "metrics" / f"{self.replica_id}.jsonl",
                                   self._open_sinks()) if self.reports else SilentLog())
        self.joining = joining
        self.tokens = 0
        self.pace_overruns = 0  # inner steps slower than --pace-seconds allowed
        self.widest_group = 0  # most peers of a committed round: 1 means it never averaged
        self.compute_s = 0.0  # inner steps: forward, backward, the inner optimizer
        self.comm_s = 0.0  # blocked in rounds (quorum, wire, aggregation)
        self.eval_s = 0.0  # evaluation's cost to the loop: snapshot, waiting for the last one
        self.checkpoint_s = 0.0  # checkpoints' cost to the loop: snapshot, waiting for a write
        self.setup_s = 0.0  # process start to the first step, every life
        self.wall_offset = 0.0  # wall-clock of earlier lives of this worker (resume)
        self.started_at = process_started_at()
        self.evaluations = Background("evaluation", nice=19)  # spare CPU only
        self.eval_model: torch.nn.Module | None = None  # the model copy evaluations read
        if cfg.resume:
            self._resume()
        #: a volunteer's claim on its shard (``farlink swarm join``): where the shard's last
        #: holder stopped, and where this worker stands after each committed round
        self.shard_claim = shard_claim
        if shard_claim is not None:
            self._take_over_position(shard_claim.committed_position())

    def _open_sinks(self) -> list:
        """The ``--log-to`` sinks of this worker: its own TensorBoard dir and W&B run (named by
        its replica, grouped by the run dir's name, the run's config attached)."""
        if not self.cfg.log_to:
            return []
        from farlink.loggers import open_sinks

        run = self.cfg.run_dir.resolve().name
        return open_sinks(self.cfg.log_to, self.cfg.run_dir, name=self.replica_id,
                          group=run, config=self.cfg.model_dump(mode="json"))

    @staticmethod
    def _join_replica_group(cfg: RunConfig, index: int):
        """This rank's place in its replica group when a worker is several ranks (torchrun's
        env)."""
        if cfg.ranks_per_worker == 1:
            return None
        from farlink.parallel.sharding import ReplicaGroup

        replica_group = ReplicaGroup.from_env(replica_index=index)
        if replica_group.size != cfg.ranks_per_worker:
            raise SystemExit(f"ranks_per_worker={cfg.ranks_per_worker}, but this process is "
                             f"one of WORLD_SIZE={replica_group.size}: start each worker with "
                             f"torchrun --nproc-per-node {cfg.ranks_per_worker}")
        return replica_group

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The worker's next batch; on a replica group, this rank's rows of it (every rank draws the
        whole batch, so the replica group trains on exactly what one process would)."""
        x, y = self.sampler.next_batch()
        if self.replica_group is None:
            return x, y
        share = len(x) // self.replica_group.size
        rows = slice(self.replica_group.rank * share, (self.replica_group.rank + 1) * share)
        return x[rows], y[rows]

    def fingerprint(self) -> str:
        """The committed state's hash; on a replica group, over every rank's shard (all ranks call
        it)."""
        mine = self.sync.fingerprint()
        if self.replica_group is None:
            return mine
        import hashlib

        return hashlib.sha256("".join(self.replica_group.gather(mine)).encode()).hexdigest()[:16]

    # --- checkpoints ---------------------------------------------------------------------------
    def _save(self) -> None:
        """Snapshot the state and hand its write to the background (see ``Optimizer.save``)."""
        t0 = time.perf_counter()
        self.sync.save(self.ckpt_dir, background=True, tokens=self.tokens,
                       sampler=self.sampler.state_dict(), model=self.cfg.model,
                       compute_s=self.compute_s, comm_s=self.comm_s, eval_s=self.eval_s,
                       checkpoint_s=self.checkpoint_s, setup_s=self.setup_s, wall_s=self.wall())
        self.sync.ledger.save(self.cfg.run_dir / "ledger" / self.ledger_name())
        self.checkpoint_s += time.perf_counter() - t0

    def ledger_name(self) -> str:
        """Each rank judges the updates of its own shard, so each keeps its own ledger:
        ``wI.json`` (rank 0, the whole replica when K=1), ``wI.rankR.json`` for rank R > 0."""
        rank = 0 if self.replica_group is None else self.replica_group.rank
        return f"{self.replica_id}.json" if rank == 0 else f"{self.replica_id}.rank{rank}.json"

    def _resume(self) -> None:
        try:
            meta = self.sync.load(self.ckpt_dir)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        rejected = self.sync.rejected_checkpoints
        for aside, reason in rejected:  # logged by the loader; the launcher reports it
            self.metrics.write("checkpoint_rejected", worker=self.replica_id, path=str(aside),
                               reason=reason)
        if meta is None:
            log.warning("no intact checkpoint under %s; starting from the initial state (a live "
                        "peer ahead of it, if any, heals it at its first quorum)", self.ckpt_dir)
            if rejected:
                self.metrics.write("resume", worker=self.replica_id, path=None, inner_steps=0,
                                   fell_back=True)
            return
        if rejected:
            log.warning("resuming from the older checkpoint %s; a live peer ahead of it, if "
                        "any, heals it at its first quorum", meta["path"])
        self.sampler.load_state_dict(meta["sampler"])
        self.tokens = meta["tokens"]
        self.compute_s, self.comm_s = meta["compute_s"], meta["comm_s"]
        self.eval_s, self.checkpoint_s = meta.get("eval_s", 0.0), meta.get("checkpoint_s", 0.0)
        self.setup_s = meta.get("setup_s", 0.0)
        self.wall_offset = meta.get("wall_s", 0.0)
        self.metrics.write("resume", worker=self.replica_id, path=meta["path"],
                           inner_steps=self.sync.inner_steps,
                           outer_step=self.sync.outer_step, fell_back=bool(rejected))

    def _take_over_position(self, taken: dict | None) -> None:
        """Continue the shard where its last holder's last committed round left it, when that
        is further than this worker's own checkpoint: its tokens are in the shared state
        already, and training them again would count them twice."""
        if taken is None:
            return
        try:
            if not self.sampler.advance_to(taken["sampler"]):
                return
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("the shard's stored data position does not fit this run (%s); "
                        "starting from this worker's own", exc)
            return
        epoch, position = self.sampler.epoch, self.sampler.position
        log.info("shard %d continues at epoch %d, batch %d (its last holder's position after "
                 "round %d)", self.sampler.shard, epoch, position // self.sampler.batch_size,
                 taken["round"])
        self.metrics.write("data_position", worker=self.replica_id, epoch=epoch,
                           position=position, round=taken["round"])

    # --- evaluation ----------------------------------------------------------------------------
    def _evaluate_in_background(self, step: int, final: bool) -> None:
        """Copy the parameters as they are now into a private model and evaluate that copy in
        the background; the record carries the step (and tokens, bytes, wall-clock) of the copy.

        The evaluation gets only spare CPU, so on busy cores it may not be done by the next
        boundary: that boundary's evaluation is skipped (an ``eval_skipped`` record says so)
        rather than stalling training, except the last one, which waits for it."""
        from farlink.data import evaluate
        from farlink.train.compute import autocast

        # a sharded forward is a collective of the replica group's ranks
        if self.replica_group is not None:
            self._evaluate_now(step)
            return
        if self.evaluations.running and not final:
            self.metrics.write("eval_skipped", worker=self.replica_id, step=step,
                               reason="the previous evaluation is still running")
            return
        t0 = time.perf_counter()
        self.evaluations.wait()
        if self.eval_model is None:
            self.eval_model = copy.deepcopy(self.model).requires_grad_(False)
        with torch.no_grad():
            for mine, live in zip(self.eval_model.state_dict().values(),
                                  self.model.state_dict().values()):
                mine.copy_(live)
        fields = dict(worker=self.replica_id, step=step, tokens=self.tokens,
                      outer_step=self.sync.outer_step, bytes_sent=self.sync.bytes_sent(),
                      wall_s=round(self.wall(), 3))
        eval_model, heldout, metrics = self.eval_model, self.heldout, self.metrics
        device, precision = self.device, self.cfg.precision

        def job() -> None:
            started = time.perf_counter()
            with autocast(device, precision):  # autocast state is per thread
                loss = evaluate(eval_model, heldout)
            metrics.write("eval", loss=round(loss, 5), ppl=round(math.exp(loss), 3),
                          eval_s=round(time.perf_counter() - started, 3), **fields)

        self.evaluations.submit(job)
        self.eval_s += time.perf_counter() - t0

    def _evaluate_now(self, step: int) -> None:
        """Evaluate the live sharded model on every rank of the replica group, in the loop (a
        background copy would need collectives of its own); rank 0 writes the record."""
        from farlink.data import evaluate
        from farlink.train.compute import autocast

        t0 = time.perf_counter()
        with autocast(self.device, self.cfg.precision):
            loss = evaluate(self.model, self.heldout)
        seconds = time.perf_counter() - t0
        self.metrics.write("eval", loss=round(loss, 5), ppl=round(math.exp(loss), 3),
                           eval_s=round(seconds, 3), worker=self.replica_id, step=step,
                           tokens=self.tokens, outer_step=self.sync.outer_step,
                           bytes_sent=self.replica_group_bytes_sent(), wall_s=round(self.wall(), 3))
        self.eval_s += seconds

    def replica_group_bytes_sent(self) -> int:
        """Bytes this worker sent: on a replica group, every rank's (each sends its own shard)."""
        sent = self.sync.bytes_sent()
        return sent if self.replica_group is None else self.replica_group.total(sent)

    def replica_group_traffic(self) -> dict[str, int]:
        """Bytes by level (hierarchical: inside the island, across islands): on a replica group,
        every rank's, as :meth:`replica_group_bytes_sent` (all ranks call it)."""
        traffic = self.sync.traffic()
        if self.replica_group is None:
            return traffic
        return {level: self.replica_group.total(sent) for level, sent in sorted(traffic.items())}

    # --- the loop ------------------------------------------------------------------------------
    def _at_boundary(self, step: int) -> None:
        """Every H inner steps (token-aligned for every algorithm): checkpoint and evaluate,
        both in the background."""
        cfg, sync = self.cfg, self.sync
        boundary = step // cfg.inner_steps if cfg.round_seconds is None else sync.outer_step
        final = sync.finished
        if boundary % cfg.checkpoint_every == 0 or final:
            self._save()
        rank0 = self.sync.rank == 0
        if rank0 and (boundary % cfg.eval_every == 0 or final):
            self._evaluate_in_background(step, final)

    def _wait_for_background_work(self) -> None:
        """Wait for the checkpoint write in flight (its error, a full disk, is raised here),
        then for the evaluation still running: a process that exits while a thread is inside
        torch aborts, so a stopped worker waits for it too."""
        t0 = time.perf_counter()
        self.sync.wait_for_checkpoint()
        t1 = time.perf_counter()
        self.evaluations.wait()
        self.checkpoint_s += t1 - t0
        self.eval_s += time.perf_counter() - t1

    def wall(self) -> float:
        """Wall-clock of this worker: since its process started, plus its earlier lives."""
        return self.wall_offset + time.time() - self.started_at

    def run(self) -> int:
        """Train until the run's end or a stop request (SIGINT/SIGTERM, checked between steps)."""
        from farlink.train.compute import accumulate_gradients, micro_batches

        cfg, sync = self.cfg, self.sync
        self.metrics.write("start", worker=self.replica_id, params=self.model.num_parameters(),
                           device=str(self.device), precision=cfg.precision,
                           inner_steps=sync.inner_steps, pid=os.getpid())
        life_started = time.perf_counter() - (time.time() - self.started_at)  # on perf_counter's clock
        first_step = True
        loss_value = float("nan")
        if self.joining:
            outcome = self.sync.join()
            if outcome is not None:
                self.metrics.write("join", worker=self.replica_id, committed=outcome.committed,
                                   healed=sync.healed, outer_step=sync.outer_step,
                                   step=sync.inner_steps,
                                   fingerprint=self.fingerprint(), world_size=outcome.world_size,
                                   comm_s=round(outcome.comm_seconds, 4))
        slowdown = cfg.slowdown_of(self.index)
        stopped = interrupt.requested()
        while not sync.finished and not stopped:
            t0 = time.perf_counter()
            if first_step:  # imports, data, model, collectives, join, the start line
                self.setup_s += t0 - life_started
                first_step = False
            self.model.train()
            loss_value, tokens = accumulate_gradients(
                self.model, micro_batches(self.next_batch, cfg.grad_accum),
                self.device, cfg.precision)
            if self.replica_group is not None:  # the replica group's batch: every rank's rows
                loss_value = self.replica_group.mean(loss_value)
                tokens = tokens * self.replica_group.size
            if cfg.pace_seconds is not None:  # emulated device of a fixed speed
                spare = slowdown * cfg.pace_seconds - (time.perf_counter() - t0)
                if spare > 0:
                    time.sleep(spare)
                else:  # the real step was slower than the emulated device: say so in the summary
                    self.pace_overruns += 1
            elif slowdown > 1:  # emulated slower device: stretch this step's compute
                time.sleep((slowdown - 1) * (time.perf_counter() - t0))
            waited_before = sync.checkpoint_wait_seconds
            outcome = self.sync.step(tokens=tokens)  # a round first lands the last checkpoint write
            if outcome.synced and outcome.committed:
                self.widest_group = max(self.widest_group, outcome.world_size)
                if self.shard_claim is not None:
                    self.shard_claim.record(outcome.outer_step, self.sampler.state_dict())
            elapsed = time.perf_counter() - t0
            waited = sync.checkpoint_wait_seconds - waited_before
            self.compute_s += elapsed - outcome.comm_seconds - waited
            self.comm_s += outcome.comm_seconds
            self.checkpoint_s += waited
            self.tokens += tokens
            step = sync.inner_steps
            fields = dict(
                worker=self.replica_id, step=step, loss=round(loss_value, 5), tokens=self.tokens,
                compute_s=round(self.compute_s, 4), comm_s=round(self.comm_s, 4),
                wall_s=round(self.wall(), 3), **self.sync.metrics(),
            )
            if outcome.synced and cfg.sync_every > 1:
                self.metrics.write("sync", committed=outcome.committed,
                                   fingerprint=self.fingerprint() if outcome.committed else None,
                                   world_size=outcome.world_size, healed=sync.healed,
                                   **({"skipped": True} if outcome.skipped else {}),
                                   **({"group": group} if (group := sync.round_group) else {}),
                                   round_s=round(outcome.comm_seconds, 4),
                                   rejected=outcome.rejected, **fields,
                                   extra_scalars={"rejected_by_peer": rejected_by_peer(
                                       sync.ledger)})
            elif step % cfg.log_every == 0 or (outcome.synced and not outcome.committed):
                self.metrics.write("step", **fields)
            if sync.at_boundary(outcome) or sync.finished:
                self._at_boundary(step)
            stopped = interrupt.requested() or (cfg.stop_at_step is not None
                                                and step >= cfg.stop_at_step)
            # a stop request reaches ranks apart: all stop together
            if self.replica_group is not None:
                stopped = self.replica_group.agree_any(stopped)
        pending = self.sync.finish()
        if pending is not None and not stopped:
            self._save()
        finished = sync.finished
        t0 = time.perf_counter()
        model_sha256 = self._save_final_model() if finished else None
        self.checkpoint_s += time.perf_counter() - t0
        self._wait_for_background_work()  # a stop too waits for the write in flight
        fingerprint, bytes_sent = self.fingerprint(), self.replica_group_bytes_sent()
        traffic = self.replica_group_traffic()
        self.metrics.write("end", worker=self.replica_id, finished=finished,
                           inner_steps=sync.inner_steps, tokens=self.tokens,
                           bytes_sent=bytes_sent,
                           compute_s=round(self.compute_s, 4), comm_s=round(self.comm_s, 4),
                           eval_s=round(self.eval_s, 4),
                           checkpoint_s=round(self.checkpoint_s, 4),
                           setup_s=round(self.setup_s, 4),
                           wall_s=round(self.wall(), 3),
                           failed_rounds=sync.failed_rounds,
                           skipped_rounds=sync.skipped_rounds,
                           pace_overruns=self.pace_overruns, outer_step=sync.outer_step,
                           widest_group=self.widest_group,
                           # the group of the last round it committed: smaller than the widest
                           # one, some replica was left out of the run's end (ended_apart)
                           last_group=sync.algorithm.last_group,
                           fingerprint=fingerprint, model_sha256=model_sha256,
                           **traffic)
        return 0 if finished or stopped else 1

    def _save_final_model(self) -> str:
        """Write ``final/wK.safetensors`` atomically; its SHA-256 goes into the end record, so
        the exported model is a file known to be the one this worker wrote."""
        import hashlib

        from safetensors.torch import save_model

        model = self.model
        # gather the shards (every rank); rank 0 writes the whole
        if self.replica_group is not None:
            from farlink.model.build import build_model
            from farlink.parallel.sharding import full_state_dict

            tensors = full_state_dict(self.model)
            if not self.reports:
                return None
            model = build_model(self.cfg.model, self.data.vocab_size, self.cfg.seq_len)
            model.load_state_dict(tensors)
        final = self.cfg.run_dir / "final"
        path = final / f"{self.replica_id}.safetensors"
        tmp = temp_path(path)
        try:
            final.mkdir(parents=True, exist_ok=True)
            # this worker's own leftovers only: the others write theirs here at the same time
            remove_stale_temps(final, f".{glob.escape(path.name)}{TEMP_PREFIX}*")
            save_model(model, str(tmp))
            digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
            os.replace(tmp, path)
        except Exception as exc:  # safetensors reports a failed write as its own error type
            tmp.unlink(missing_ok=True)
            if is_disk_full(exc) or "No space left" in str(exc):
                raise DiskFull(final, "the final model") from exc
            raise
        return digest

    def close(self) -> None:
        """Leave the run (``Optimizer.close`` lands a checkpoint write still in flight), after
        the evaluation still running (when the loop ended with an error)."""
        try:
            self.evaluations.wait()
        except Exception:  # noqa: BLE001 - an evaluation's error must not hide why we stop
            log.exception("the last evaluation failed")
        self.sync.close()
        self.metrics.close()
        if self.replica_group is not None:
            self.replica_group.close()


def run_worker(cfg: RunConfig, index: int, lighthouse: str, joining: bool = False,
               collective=None, shard_claim=None) -> int:
    """Train as worker ``index`` of ``cfg`` until the run ends or a stop request; the exit code.

    ``farlink join`` calls it with its own config in memory, so a joiner never rewrites the
    config saved in a run dir it shares. ``collective``: one already built (``farlink swarm
    join`` builds its own first, to claim its shard through it); it is closed at the end.
    ``shard_claim``: that volunteer's :class:`~farlink.comm.swarm_shards.ShardClaim`, which
    hands over the shard's data position."""
    interrupt.install(raise_now=False)  # stop between steps, never mid-update
    from farlink.lifeline import watch_parent

    watch_parent()  # a launcher killed with SIGKILL leaves no worker behind
    from farlink.comm.errors import MembershipRefused
    from farlink.robust.gate import AdmissionError
    from farlink.train.index_lock import IndexInUse, IndexLock

    lock = None
    try:
        # one live process per index; a replica group's rank 0 holds it for the replica group (a
        # previous life of this worker, just killed, may still be exiting: wait a little for it)
        if cfg.ranks_per_worker == 1 or os.environ.get("RANK", "0") == "0":
            lock = IndexLock(cfg.run_dir, index, wait_s=10.0)
        worker = Worker(cfg, index, lighthouse, joining=joining, collective=collective,
                        shard_claim=shard_claim)
    except BaseException as exc:
        if lock is not None:
            lock.release()
        if collective is not None:  # the worker that would have closed it does not exist
            collective.close()
        if isinstance(exc, IndexInUse):
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        if isinstance(exc, (AdmissionError, MembershipRefused)):  # say why; no retrying
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 3
        raise
    try:
        from farlink.train.start_line import StartLine

        start_line = StartLine.from_env()
        if start_line is not None and not joining:
            start_line.wait(index, cfg.join_timeout)
        code = worker.run()
    except (DiskFull, OSError) as exc:
        if not (isinstance(exc, DiskFull) or is_disk_full(exc)):
            raise
        # one line, not a traceback: what is full and how to go on (partial files are removed)
        line = str(exc) if isinstance(exc, DiskFull) else f"disk full under {cfg.run_dir}: {exc}"
        try:
            print(f"error: {line}; free space there, then continue with `farlink train "
                  f"--resume --run-dir {cfg.run_dir}`", file=sys.stderr, flush=True)
        except OSError:
            pass  # the log sits on the same full disk
        return EXIT_DISK_FULL
    finally:
        worker.close()
        if lock is not None:
            lock.release()
    return code
