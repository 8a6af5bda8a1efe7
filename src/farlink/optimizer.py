"""farlink as a library: your model, your optimizer, your loop, farlink's outer algorithms.

One object per process wraps the model and its inner optimizer and is called once per step,
after ``loss.backward()``, in place of ``optimizer.step(); optimizer.zero_grad()``::

    sync = farlink.Optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                             algorithm="diloco", inner_steps=50, backend="torchft",
                             lighthouse="http://host:29510", index=rank)
    sync.load("ckpt/w0")                          # resume, if a checkpoint is there
    for x, y in batches:
        loss_fn(model(x), y).backward()
        outcome = sync.step(tokens=x.numel())     # inner step; every H: the outer round
        if outcome.committed:
            sync.save("ckpt/w0", batch=i)         # exact resume point (atomic)
    sync.close()

What ``step`` does is the algorithm's: DDP averages the gradients and then steps your optimizer;
DiLoCo steps it H times alone, then averages the pseudo-gradient and takes the outer step
(Nesterov SGD, lr 0.7, momentum 0.9 unless you inject ``outer_optimizer``); Streaming DiLoCo
syncs fragments in the background; DeMo replaces your optimizer by its sign step; SparseLoCo
sends a 2-bit top-k of an error-feedback accumulator and takes a plain outer step (lr 1.0);
hierarchical DiLoCo averages inside islands and sends only leaders across (the list of them
all is :data:`farlink.ALGORITHMS`). Any backend
(``torchft``: a Lighthouse coordinates replica groups; ``hivemind``: a DHT, no coordinator;
``inprocess``: peers as threads, or one process alone), any codec and aggregator, and
authentication (``auth="secret"``/``"ed25519"``) work the same way, since they sit below the
algorithm. Peers that join late heal from live ones (``join()``); a lagging one heals inside a
round. Every option is a ``farlink train`` flag (same name, ``_`` for ``-``). Without an
optimizer of yours, farlink builds AdamW, or with ``inner="muon"`` Muon for the hidden matrices
and AdamW for the rest (:class:`farlink.sync.muon.MuonAdamW`, which you may also build and pass).

The model may live on any device (move it there before building its optimizer): the global
copy, the outer optimizer's state, pseudo-gradients and codec residuals are kept on that device
and codecs encode there; only the bytes on the wire pass through host memory. Autocast and
gradient accumulation are your loop's (``farlink train`` has ``--precision`` and
``--grad-accum``).

Your optimizer keeps its own lr and scheduler: farlink neither rescales nor clips your gradients
unless you ask (``lr_schedule=True`` uses warmup + cosine over ``steps``; ``grad_clip=1.0``).

The object is itself a ``torch.optim.Optimizer``, so it goes wherever a loop or framework expects
one (Hugging Face ``Trainer(optimizers=(sync, scheduler))``, ``accelerator.prepare``, Lightning's
``configure_optimizers``): its ``param_groups`` and ``state`` are your optimizer's (a scheduler
built on it drives your lr), ``step(closure)`` runs the closure, your step and, when due, the
round, ``zero_grad`` clears the gradients, and ``state_dict()`` is torch's format (your
optimizer's ``state`` and ``param_groups``) plus a ``"farlink"`` entry with the rest of an exact
resume: the committed state, the outer optimizer, codec residuals, local parameters, the round
position, and this member's record of its peers (ledger, ratings, replay probes). A round
weighs each replica by its tokens: ``step(tokens=N)`` or ``count_tokens(N)`` (once per
micro-batch) where the loop knows them; a step with neither counts as one (every replica's
steps then weigh the same). docs/frameworks.md shows each framework.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from farlink.compose import Parts, compose
from farlink.parallel.reshard import ReshardError, reshard
from farlink.state.checkpoint import (checkpoint_path, load_checkpoint_parts, load_newest_intact,
                                      load_rank_part, read_verified_meta, save_checkpoint,
                                      save_sharded_checkpoint)
from farlink.sync import StepOutcome

log = logging.getLogger(__name__)

#: what a newcomer waits for the members' next round (their rounds may be long)
JOIN_QUORUM_TIMEOUT = 3600.0
TRUST = "trust"  # checkpoint meta: the exchange's records of its peers (Exchange.trust_state)
#: a replica group's checkpoint meta: how many ranks wrote it (the key checkpoints have carried
#: since before the name "replica group", so that they all still load)
REPLICA_GROUP_RANKS = "site_ranks"
# a replica group's checkpoint: this rank's bytes (each sends its shard)
BYTES_SENT = "counter.bytes_sent"


class Optimizer(torch.optim.Optimizer):
    """One replica of a farlink run around a model farlink did not build; a
    ``torch.optim.Optimizer`` whose parameters, groups and state are ``inner_optimizer``'s.

    ``model``: any ``nn.Module``; its trainable parameters are what is synchronized.
    ``inner_optimizer``: any ``torch.optim.Optimizer`` over exactly those parameters, or None
    for the algorithm's default (AdamW, betas 0.9/0.95, with farlink's lr schedule).
    ``parts``: the replica already built (:class:`~farlink.compose.Parts`: its algorithm,
    collective, exchange, ledger, checkpoint writer; :func:`farlink.compose.compose` builds them
    from the arguments below, which is what giving those arguments here does).
    ``config``: a whole :class:`~farlink.config.RunConfig` (what ``farlink train`` passes), or
    give its fields as keyword ``options`` (``algorithm``, ``backend``, ``inner_steps``,
    ``codec``, ``aggregator``, ``auth``, ``secret``, ``outer_lr``, ...). Without ``steps`` the
    run has no fixed length: your loop decides when it ends.
    ``lighthouse``: the torchft Lighthouse address; ``peers``: hivemind's initial peers (the
    multiaddrs of a replica already running: its :attr:`addresses`; none for the first replica,
    which starts the DHT); each is refused on the other's backend. Default: the config's
    ``lighthouse``/``initial_peers``, then ``TORCHFT_LIGHTHOUSE``. On hivemind every replica
    says how many a round waits for: ``workers=N`` (all N replicas you start) or
    ``min_replicas=M`` (elastic). The DHT listens on ``host`` (default 127.0.0.1) and never
    maps ports, uses relays or public bootstrap peers.
    ``index``: this replica's number in the run (names it ``w{index}``).
    ``outer_optimizer``: a factory ``params -> torch.optim.Optimizer`` for the outer step.
    ``collective``: a ready :class:`~farlink.comm.base.Collective` (e.g. an
    :class:`~farlink.comm.inprocess.InProcessGroup` member) instead of building one.
    ``replica_group``: for a model sharded with FSDP2 over several ranks (one replica trained by a
    replica group of K processes, started by torchrun): the
    :class:`~farlink.parallel.sharding.ReplicaGroup`; by default read from torchrun's environment
    and started here. Each rank then syncs its own shard with the same rank of the other replica
    groups (torchft or hivemind), the ranks write each checkpoint together (``directory/step-N``,
    one per step, through ``torch.distributed.checkpoint``), and the replica group resumes from the
    newest one that verifies, each rank reading its own part. ``global_lighthouse`` /
    ``global_collective``: ``hierarchical_diloco`` only, for islands you form yourself (``farlink
    train`` forms them from measured links): every replica gives its island's Lighthouse as
    ``lighthouse`` (or its island's ``collective``), and exactly one replica per island, its
    leader, also gives the Lighthouse (or collective) the leaders share; only leaders cross that
    slow link. ``tamper``: make this replica an emulated attacker: ``(update, round_id) -> update``
    rewrites each update it sends (:mod:`farlink.robust.attacks`), to test a run's defences.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer | None = None,
                 *, parts: Parts | None = None, **arguments: Any) -> None:
        if parts is None:  # the keyword form: the composition root builds the parts
            parts = compose(model, inner_optimizer, **arguments)
        elif arguments or inner_optimizer is not None:
            raise TypeError("give either parts=compose(...) or the model's arguments, not both")
        self.parts = parts
        self.config = parts.config  # the run's config, for callers that want to read it
        self.index, self.replica_id = parts.index, parts.replica_id
        self.model, self.algorithm = parts.model, parts.algorithm
        self.collective, self.exchange, self.ledger = parts.collective, parts.exchange, parts.ledger
        self.tiers, self.replica_group = parts.tiers, parts.replica_group
        self.trainable = parts.trainable
        self.whole_replica_per_rank = parts.whole_replica_per_rank
        self.checkpoint_writes = parts.checkpoint_writes
        self.rejected_checkpoints: list[tuple[Path, str]] = []  # set aside by the last load
        self.last_outcome = StepOutcome()  # what the last step did (a framework drops it)
        self._tokens_counted = 0  # count_tokens() since the last step
        self._first_step = True
        self._start_torch_optimizer()

    # --- torch.optim.Optimizer -----------------------------------------------------------------
    def _start_torch_optimizer(self) -> None:
        """torch's bookkeeping (defaults, hooks, the profiled step) without its own
        ``param_groups`` and ``state``: those are the inner optimizer's, so whatever a framework
        or scheduler does to them reaches the optimizer that steps. An algorithm with its own
        update rule (DeMo) has one group of its own, whose lr it does not read."""
        inner = self.algorithm.inner_opt
        self._own_groups = None if inner is not None else [
            {"params": list(self.algorithm.module_params), "lr": self.algorithm.current_lr()}]
        self._own_state: dict = defaultdict(dict)
        self.defaults = dict(inner.defaults) if inner is not None else {"lr": 0.0}
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                      "load_state_dict_pre", "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (an lr scheduler writes their ``lr``)."""
        inner = self.algorithm.inner_opt
        return inner.param_groups if inner is not None else self._own_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if self.algorithm.inner_opt is None:
            self._own_groups = groups
        else:
            self.algorithm.inner_opt.param_groups = groups

    @property
    def state(self) -> dict:
        """The inner optimizer's per-parameter state (a framework moves it between devices)."""
        inner = self.algorithm.inner_opt
        return inner.state if inner is not None else self._own_state

    @state.setter
    def state(self, value: dict) -> None:
        if self.algorithm.inner_opt is None:
            self._own_state = value
        else:
            self.algorithm.inner_opt.state = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("farlink synchronizes the parameters it was built with; build "
                         "farlink.Optimizer over all of them (an inner optimizer of several "
                         "groups is fine)")

    def state_dict(self) -> dict[str, Any]:
        """torch's format: the inner optimizer's ``state`` and ``param_groups``, and under
        ``"farlink"`` the rest of an exact resume (the algorithm's name and its tensors:
        committed state, outer optimizer, codec residuals, local parameters, round position)
        and, as in :meth:`save`, this member's record of its peers (``"trust"``: ledger,
        ratings; the replay probes are ``trust.*`` tensors), so a run a framework resumes
        does not trust an attacker afresh. Plain tensors, numbers, strings, lists and dicts,
        so ``torch.load(weights_only=True)`` reads it."""
        inner = self.algorithm.inner_opt
        torch_format = (inner.state_dict() if inner is not None
                        else torch.optim.Optimizer.state_dict(self))
        tensors = {k: v for k, v in self.algorithm.state_dict().items()
                   if not k.startswith("inner.")}  # the inner state is torch's "state" above
        own = {"algorithm": self.algorithm.name, "tensors": tensors}
        # as in save(): a replica group (one ledger per rank, never scored) keeps none
        if self.replica_group is None:
            own[TRUST], trust_tensors = self.exchange.trust_state()
            tensors.update(trust_tensors)
        return {**torch_format, "farlink": own}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: this replica continues exactly where it was
        (a live peer ahead of it heals it at its next round, as after :meth:`load`)."""
        own = state_dict.get("farlink")
        if own is None:
            raise ValueError("not a farlink.Optimizer state (no 'farlink' entry): load the "
                             "inner optimizer's own state into it before wrapping it")
        if own["algorithm"] != self.algorithm.name:
            raise ValueError(f"this optimizer state was written by algorithm "
                             f"{own['algorithm']!r}, not {self.algorithm.name!r}; resume "
                             f"with the same algorithm")
        tensors = dict(own["tensors"])
        self._restore_trust(own.get(TRUST), tensors)
        self._load_tensors(tensors)
        torch_format = {k: v for k, v in state_dict.items() if k != "farlink"}
        inner = self.algorithm.inner_opt
        if inner is not None:  # after the algorithm's load, which leaves it no state
            inner.load_state_dict(torch_format)
        else:
            for group, saved in zip(self._own_groups, torch_format["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})

    def _warn_of_an_unread_scheduler(self) -> None:
        """A torch lr scheduler marks the groups it drives (``initial_lr``): say once, at the
        first step, when farlink does not step with the lr it sets."""
        if not any("initial_lr" in group for group in self.param_groups):
            return
        if self.algorithm.inner_opt is None:
            log.warning("%s steps with its own lr and update rule: the lr scheduler on this "
                        "optimizer changes nothing", self.algorithm.name)
        elif self.algorithm.lr_schedule:
            log.warning("farlink's lr schedule (lr_schedule=True) sets the inner lr every step, "
                        "over the lr scheduler's; give lr_schedule=False to use yours")

    def __repr__(self) -> str:
        inner = self.algorithm.inner_opt
        return (f"farlink.Optimizer({self.algorithm.name}, "
                f"inner={type(inner).__name__ if inner is not None else None})")

    # --- the loop ------------------------------------------------------------------------------
    def count_tokens(self, tokens: int) -> None:
        """Add ``tokens`` to the next step's count (call once per micro-batch where the loop
        knows its batches' tokens but does not call :meth:`step` itself)."""
        self._tokens_counted += int(tokens)

    def step(self, closure: Callable[[], Any] | None = None, *,
             tokens: int | None = None) -> Any:
        """After ``loss.backward()`` (or with a ``closure`` that computes the loss and its
        gradients, as torch optimizers take it): the inner step and, when due, the outer round.
        ``tokens`` weighs this replica's contribution (a slower replica that did less counts less);
        without it, the tokens given to :meth:`count_tokens` since the last step, or 1. On a DDP
        replica group it first averages the gradients over the replica group's ranks, and after a
        round gives every rank the slices the others updated. Returns the closure's loss when given
        one (torch's contract), else the :class:`~farlink.sync.StepOutcome` (also kept in
        :attr:`last_outcome`)."""
        if closure is not None and not callable(closure):
            raise TypeError("step(closure) takes a function that computes the loss; give the "
                            "batch's token count as step(tokens=N)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._first_step:
            self._first_step = False
            self._warn_of_an_unread_scheduler()
        counted, self._tokens_counted = self._tokens_counted, 0
        weight = tokens if tokens is not None else counted or 1
        if self.whole_replica_per_rank:
            self.replica_group.average_gradients(self.trainable)
        outcome = self.algorithm.step(weight)
        # every round (an island's too) rewrote each rank's own slice
        if self.whole_replica_per_rank and (outcome.synced or outcome.island_round):
            self.replica_group.share_parts(self.trainable)
        self.last_outcome = outcome
        return outcome if closure is None else loss

    def join(self) -> StepOutcome | None:
        """A newcomer's first act, before any inner step: a zero-weight round that heals it from
        live peers (waiting for the members' next round, however long theirs are)."""
        outcome = self.algorithm.join(
            timeout=max(self.collective.quorum_timeout, JOIN_QUORUM_TIMEOUT))
        if self.whole_replica_per_rank:  # each rank healed its own slice
            self.replica_group.share_parts(self.trainable)
        return outcome

    def finish(self) -> StepOutcome | None:
        """After the last step: land a round still in flight (streaming). A run whose last
        round left a replica out is logged (:meth:`SyncAlgorithm.ended_apart`)."""
        outcome = self.algorithm.finish()
        apart = self.algorithm.ended_apart()
        if apart is not None:
            log.warning("replicas may have ended on different states: %s", apart)
        return outcome

    @property
    def finished(self) -> bool:
        """Whether the run's ``steps`` (or time-budgeted rounds) are done; never without one."""
        return self.algorithm.finished()

    def at_boundary(self, outcome: StepOutcome) -> bool:
        """Whether the step that returned ``outcome`` ends a period, the moment to checkpoint
        or evaluate: every H inner steps, or after every round of a time-budgeted or
        island-level algorithm (whose rounds do not fall on multiples of H)."""
        return self.algorithm.at_boundary(outcome)

    @property
    def outer_step(self) -> int:
        """Committed outer rounds so far (the same on every replica after a round)."""
        return self.algorithm.outer_step

    @property
    def inner_steps(self) -> int:
        """Inner steps this replica has taken (a healed replica adopts its peer's count)."""
        return self.algorithm.inner_steps_done

    @property
    def healed(self) -> bool:
        """Whether the last round replaced this replica's state by a live peer's (a newcomer
        or one that fell behind)."""
        last = self.algorithm.last_round
        return bool(last is not None and last.healed)

    @property
    def round_group(self) -> str | None:
        """Who the last round's members were (a short hash of their ids), when a round's group
        may be smaller than the swarm (Moshpit groups): two groups then commit one round number
        with different states, and the run's audit tells them apart by this. None otherwise:
        there every round has one group, and two states for one round are a divergence."""
        last = self.algorithm.last_round
        if last is None or not last.peers or not self.collective.partial_groups:
            return None
        return hashlib.sha256("|".join(sorted(last.peers)).encode()).hexdigest()[:12]

    @property
    def addresses(self) -> list[str]:
        """Where other replicas join this one: on hivemind its multiaddrs (pass them to the
        next replica as ``peers=``); empty on torchft (the Lighthouse is the
        address) and in-process."""
        return self.collective.maddrs

    @property
    def rank(self) -> int:
        """This replica's rank in the last round (0 before any)."""
        last = self.algorithm.last_round
        return last.rank if last is not None else 0

    def fingerprint(self) -> str:
        """Hash of the committed state: the same on every replica after a committed round."""
        return self.algorithm.fingerprint()

    # --- metrics -------------------------------------------------------------------------------
    def bytes_sent(self) -> int:
        """Bytes this replica sent, on every collective it holds."""
        if self.tiers is not None:
            return self.tiers.bytes_sent()
        return self.collective.stats.bytes_sent

    def traffic(self) -> dict[str, int]:
        """Bytes sent by level, for algorithms with levels (``hierarchical_diloco``:
        ``intra_bytes`` inside the island, ``inter_bytes`` across islands); else empty."""
        return self.algorithm.traffic()

    @property
    def skipped_rounds(self) -> int:
        """Rounds in which no group took this replica in time (Moshpit groups smaller than the
        swarm): it averaged nothing and went on with its local update."""
        return self.algorithm.skipped_rounds

    @property
    def failed_rounds(self) -> int:
        """Rounds that did not commit (a peer failed mid-round) and were retried or skipped."""
        return self.collective.stats.failed_rounds

    @property
    def checkpoint_wait_seconds(self) -> float:
        """Time the loop spent waiting for background checkpoint writes (a round, a save or
        :meth:`wait_for_checkpoint` waits for the write in flight): counted inside
        :meth:`step` and :meth:`save`, so a loop that times them can tell it apart."""
        return self.checkpoint_writes.waited_s

    def metrics(self) -> dict[str, Any]:
        """Cumulative figures for logs: bytes sent (by level where the algorithm has levels),
        where rounds spent their time (quorum, wire, total), rounds that failed."""
        algo = self.algorithm
        phases = self.collective.stats.phase_seconds
        return {"bytes_sent": self.bytes_sent(), "outer_step": algo.outer_step,
                "lr": algo.current_lr(), "quorum_s": round(algo.quorum_seconds, 4),
                "network_s": round(algo.network_seconds, 4),
                "rounds_s": round(algo.round_seconds, 4),
                **({"phases_s": {k: round(v, 4) for k, v in phases.items()}} if phases else {}),
                "failed_rounds": self.failed_rounds,
                # the path of the last round's exchange: dense, allreduce or gathered
                **({"exchange_path": path} if (path := getattr(
                    getattr(algo, "exchange", None), "last_path", "")) else {}),
                # Moshpit groups that left this replica out: it averaged nothing those rounds
                **({"skipped_rounds": self.skipped_rounds} if self.skipped_rounds else {}),
                **self.traffic()}

    # --- state ---------------------------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What :meth:`save` writes, as named tensors: committed state, this replica's local
        parameters, optimizer states, codec residuals, torch's RNG (a loop of one's own owns
        no other copy of it; a framework's checkpoint holds :meth:`state_dict` instead)."""
        tensors = self.algorithm.state_dict()
        tensors["rng.torch"] = torch.get_rng_state()
        return tensors

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`checkpoint_tensors` (what :meth:`load` does with a checkpoint)."""
        self._load_tensors(tensors)
        torch.set_rng_state(tensors["rng.torch"])

    def _load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.algorithm.load_state_dict(tensors)
        if self.whole_replica_per_rank:  # each rank restored its own slice
            self.replica_group.share_parts(self.trainable)
        self.collective.load_committed_step(self.algorithm.outer_step)

    def save(self, directory: str | Path, *, background: bool = False, **meta: Any) -> Path:
        """An atomic checkpoint under ``directory`` (the last two are kept), with ``meta``
        (JSON: your data position, counters) returned by :meth:`load`; its path. The
        checkpoint also keeps what this member knows of its peers (the contribution ledger,
        loss-scoring ratings, the recent updates a replay is compared with: a resumed run
        does not forget an attacker's record); :attr:`ledger` is readable on its own too
        (``sync.ledger.save(path)``). A replica group of several ranks (one ledger per rank, never
        scored) keeps no such record.

        ``background=True`` copies the state in memory and returns at once; a thread writes it
        while training goes on. The checkpoint is published (``LATEST``) only once fully written,
        one write is in flight at a time (a new save waits for the previous one), and the next
        round begins only after the write landed, so no more committed progress is at risk than
        with a synchronous save. A failed write (:class:`~farlink.state.checkpoint.DiskFull`)
        is raised by the next round, save or :meth:`wait_for_checkpoint`."""
        directory = Path(directory)
        step = self.algorithm.inner_steps_done
        meta = {**meta, "algorithm": self.algorithm.name, "inner_steps": step,
                "outer_step": self.algorithm.outer_step, "bytes_sent": self.bytes_sent()}
        if self.replica_group is not None:
            return self._save_replica_group(directory, step, meta, background)
        meta[TRUST], trust_tensors = self.exchange.trust_state()
        if not background:
            tensors = {**self.checkpoint_tensors(), **trust_tensors}
            self.checkpoint_writes.wait()
            return save_checkpoint(directory, step, tensors, meta)
        # what a round still in flight decides (an outer step off the critical path) is
        # waited for by the write's thread: the loop goes on at once
        now, rest = self.algorithm.checkpoint_parts()
        tensors = {**now, "rng.torch": torch.get_rng_state(), **trust_tensors}
        # the live tensors change at the next inner step: the write gets its own copy
        snapshot = {k: v.detach().clone() for k, v in tensors.items()}

        def write() -> Path:
            snapshot.update(rest())
            return save_checkpoint(directory, step, snapshot, meta)

        self.checkpoint_writes.submit(write)
        return checkpoint_path(directory, step)

    def _save_replica_group(self, directory: Path, step: int, meta: dict, background: bool) -> Path:
        """One checkpoint of the whole replica group per step, written by all its ranks together
        through DCP (:func:`~farlink.state.checkpoint.save_sharded_checkpoint`); every rank calls
        it at the same step. In the background the write runs on a process group of its own, so its
        collectives never interleave with the training thread's (FSDP's, the replica group's)."""
        # created by every rank, in the training thread
        group = self.replica_group.checkpoint_group()
        meta = {**meta, REPLICA_GROUP_RANKS: self.replica_group.size}
        # bytes differ by rank (each sends its own shard): each rank's count travels with it
        tensors = {**self.checkpoint_tensors(), BYTES_SENT: torch.tensor(self.bytes_sent())}
        write = partial(save_sharded_checkpoint, directory, step, meta=meta,
                        rank=self.replica_group.rank, group=group)
        if not background:
            self.checkpoint_writes.wait()
            return write(tensors)
        snapshot = {k: v.detach().clone() for k, v in tensors.items()}
        self.checkpoint_writes.submit(lambda: write(snapshot))
        return checkpoint_path(directory, step)

    def wait_for_checkpoint(self) -> None:
        """Block until a background checkpoint write has landed; raise its error if it failed."""
        self.checkpoint_writes.wait()

    def load(self, directory: str | Path) -> dict | None:
        """Resume from the newest intact checkpoint under ``directory``: its ``meta`` (with
        ``path``), or None (and nothing changed) when there is none yet. Newer checkpoints that
        fail their digests are set aside and listed in :attr:`rejected_checkpoints`; a live
        peer ahead of the one loaded heals this replica at its first quorum."""
        directory = Path(directory)
        if self.replica_group is not None:
            return self._load_replica_group(directory)
        restored = load_newest_intact(directory)
        self.rejected_checkpoints = restored.rejected
        path, tensors, meta = restored.path, restored.tensors, restored.meta
        if path is None:
            return None
        return self._restore(path, tensors, meta)

    def _restore(self, path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
        if meta["algorithm"] != self.algorithm.name:
            raise ValueError(f"checkpoint {path} was written by algorithm {meta['algorithm']!r}, "
                             f"not {self.algorithm.name!r}; resume with the same algorithm")
        written_by = meta.get(REPLICA_GROUP_RANKS, 1)
        ranks = 1 if self.replica_group is None else self.replica_group.size
        if written_by != ranks:  # each rank's part is its own shard: cut them again
            tensors = self._resharded(path, meta)
        bytes_sent = tensors.pop(BYTES_SENT, None)
        self._restore_trust(meta.get(TRUST), tensors)
        self.load_checkpoint_tensors(tensors)
        self.collective.stats.bytes_sent = (meta["bytes_sent"] if bytes_sent is None
                                            else int(bytes_sent))
        return {**meta, "path": str(path)}

    def _restore_trust(self, records: dict | None, tensors: dict[str, torch.Tensor]) -> None:
        """Restore this member's record of its peers (ratings, credits, recent updates) from
        :meth:`save`'s or :meth:`state_dict`'s ``records`` and their ``trust.*`` tensors, which
        it takes out of ``tensors``. First, so that a refused record (malformed, or a rating
        outside [-1, 1]) leaves the replica as it was; a checkpoint written before the records
        were kept restores none."""
        trust_tensors = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("trust.")]}
        if records is not None:
            self.exchange.load_trust_state(records, trust_tensors)

    def _resharded(self, path: Path, meta: dict) -> dict[str, torch.Tensor]:
        """This rank's state from a checkpoint written by a replica group of another number of
        ranks: every part read, cut again to what each rank of this replica group holds (a
        collective of the replica group's ranks: they tell each other their shapes). The bytes the
        old ranks sent go to rank 0 (the replica group's total is what its metrics report)."""
        parts, _ = load_checkpoint_parts(path)
        sent = [part.pop(BYTES_SENT, None) for part in parts]
        mine = {**self.algorithm.state_shapes(), "rng.torch": tuple(torch.get_rng_state().shape)}
        rank = 0 if self.replica_group is None else self.replica_group.rank
        layout = ([mine] if self.replica_group is None else
                  [{k: tuple(v) for k, v in json.loads(text).items()}
                   for text in self.replica_group.gather(json.dumps(mine))])
        try:
            tensors = reshard(parts, rank, layout)
        except ReshardError as exc:
            raise ValueError(f"checkpoint {path} (a replica group of {len(parts)} ranks) does not "
                             f"fit this replica group of {len(layout)}: {exc}") from None
        total = (sum(int(s) for s in sent) if all(s is not None for s in sent)
                 else int(meta["bytes_sent"]))
        tensors[BYTES_SENT] = torch.tensor(total if rank == 0 else 0)
        log.info("resharded %s from %d ranks to %d", path, len(parts), len(layout))
        return tensors

    def _load_replica_group(self, directory: Path) -> dict | None:
        """A replica group resumes from its newest checkpoint that verifies: rank 0 checks the
        digests (setting aside any that fail) and names the step; every rank reads its own part of
        it, or, when another number of ranks wrote it, every part, cut again for this replica group
        (:meth:`_resharded`). A step is published only once all ranks wrote it, so each published
        step is whole."""
        restored = load_newest_intact(directory, rank=0) if self.replica_group.rank == 0 else None
        name = [restored.path.name if restored and restored.path else None]
        dist.broadcast_object_list(name, src=0, group=self.replica_group.gloo_group())
        self.rejected_checkpoints = restored.rejected if restored else []
        if name[0] is None:
            earlier = sorted(directory.glob("rank*/step-*"))
            if earlier:  # never start over silently beside a run's earlier state
                raise ValueError(
                    f"{directory} holds per-rank checkpoints ({earlier[-1].relative_to(directory)}"
                    f", ...) of an earlier layout, which this farlink does not read (a replica "
                    f"group now writes one torch.distributed.checkpoint directory per step); "
                    f"finish that run with the farlink that wrote it, or start a new --run-dir")
            return None
        path = directory / name[0]
        if self.replica_group.rank == 0:
            tensors, meta = restored.tensors, restored.meta
        else:  # a rank the checkpoint has no part for reads them all (resharding)
            meta = read_verified_meta(path)
            tensors = ({} if meta.get(REPLICA_GROUP_RANKS, 1) != self.replica_group.size
                       else load_rank_part(path, self.replica_group.rank))
        return self._restore(path, tensors, meta)

    def close(self) -> None:
        """Leave the run (after a background checkpoint write has landed): release sockets,
        threads and the Manager(s)."""
        try:
            self.checkpoint_writes.wait()
        finally:
            self.collective.close()
        if self.tiers is not None:
            self.tiers.close()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

