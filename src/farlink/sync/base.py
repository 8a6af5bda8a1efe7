"""The outer-algorithm interface: what happens to the parameters after each backward pass.

An algorithm owns three kinds of facts, all in its own file:

* its **options**: a small pydantic model (``Options``) of the knobs it reads; ``RunConfig``
  inherits every algorithm's options, so the flat CLI flags and TOML keys are these fields;
* its **optimizers**: the inner one is injected (the user's own, any ``torch.optim.Optimizer``)
  or built by :meth:`SyncAlgorithm.default_inner_optimizer`; the outer one is injected as a
  factory of the global parameters;
* its **capabilities** (:class:`Capabilities`): what the config, the planner, the benchmarks and
  the worker ask for instead of lists of algorithm names.

An algorithm owns the optimizers (inner and outer) because that is where the families differ:
DDP averages gradients before every AdamW step, DiLoCo runs AdamW alone for H steps and then takes
an outer Nesterov step on the averaged pseudo-gradient, DeMo replaces AdamW by a sign step on
gathered DCT momentum. The training loop only calls :meth:`SyncAlgorithm.step` after
``loss.backward()``; algorithms talk to peers only through an :class:`~farlink.sync.exchange.Exchange`
and the :class:`~farlink.comm.base.Collective` it wraps, never through a concrete backend.

Committed state is what every replica agrees on after an outer step (global parameters, outer
optimizer state, the round counter). It is what a newcomer receives (:meth:`shared_state`) and what
a checkpoint must restore exactly (:meth:`state_dict`, which adds this worker's private state).
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from farlink.codecs import Compressor, make_compressor
from farlink.comm.base import Collective, RoundInfo
from farlink.sync.digest import (StateTransferError, state_digest, verified,  # noqa: F401
                                 with_digest)
from farlink.sync.exchange import Combine, Exchange, ExchangeResult
from farlink.sync.moshpit import GroupMixing
from farlink.sync.schedule import Schedule, make_schedule, nearest_step_boundary  # noqa: F401

log = logging.getLogger(__name__)

TensorState = dict[str, torch.Tensor]
OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class SyncOptions(BaseModel):
    """The knobs every algorithm reads: the inner schedule and the round's retries."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    inner_steps: int = Field(50, ge=1, description="H: inner steps between outer syncs")
    steps: int | None = Field(None, ge=1, description="inner steps per worker (the token budget)")
    lr: float = Field(3e-3, gt=0, description="inner learning rate")
    inner: Literal["adamw", "muon"] = Field(
        "adamw", description="inner optimizer farlink builds: adamw (betas 0.9/0.95), or muon "
        "for the hidden matrices with AdamW for embeddings, norms and biases (MuLoCo)")
    warmup_steps: int = Field(30, ge=0, description="linear warmup of the inner lr")
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max grad norm, 0 disables")
    round_retries: int = Field(2, ge=0, description="retries of a failed round before moving on")


@dataclass(frozen=True)
class Capabilities:
    """What an algorithm can do. Config validation, the planner, the benchmarks and the worker
    ask these instead of keeping lists of algorithm names (which drift apart)."""

    syncs_every_step: bool = False  # a round after every inner step (H is only the checkpoint
    #                                 and evaluation cadence)
    time_budget: bool = False  # rounds may last --round-seconds instead of H steps
    islands: bool = False  # two tiers of collectives (island + global) the launcher plans
    fragments: bool = False  # the model syncs in --fragments parts, one round each
    backends: tuple[str, ...] = ("torchft", "hivemind", "inprocess")
    planned: bool = True  # the planner (farlink plan) models its rounds
    inner_optimizer: bool = True  # it steps an inner optimizer (DeMo replaces it)
    outer_optimizer: bool = False  # an outer optimizer can be injected (DiLoCo family)
    wire_codec: str | None = None  # the codec family it must send with (DeMo: dct_topk)
    sharded: bool = False  # runs on a replica group's local shards (FSDP2): each rank owns the
    #                        part of its state that matches its shard (elementwise, or per-shard
    #                        chunks)
    stage_averaging: bool = False  # its rounds can average the peers of one pipeline stage
    #                                (farlink train --pipeline-stages): a round at the
    #                                trainer's call (``count_tokens``, ``sync``) on weights the
    #                                peer trained elsewhere (:mod:`farlink.parallel.stage_sync`)
    partial_groups: bool = False  # it averages its committed state in groups smaller than the
    #                               swarm (hivemind --group-size, :meth:`mix_group_states`)
    delayed_outer: bool = False  # its outer step can land one round late, the round's exchange
    #                              overlapping the next round's compute (--outer-overlap,
    #                              :mod:`farlink.sync.delayed`)


@dataclass
class StepOutcome:
    """What one call to :meth:`SyncAlgorithm.step` did, for metrics."""

    synced: bool = False  # a round was attempted during this step
    committed: bool = False  # ... and every participant committed it
    outer_step: int = 0  # committed rounds so far
    world_size: int = 1
    comm_seconds: float = 0.0  # time this step spent blocked on communication
    rejected: int = 0  # peer updates dropped by validation this step
    # an island-level round ran (hierarchical_diloco, whose ``synced`` counts global rounds
    # only): it rewrote the parameters too
    island_round: bool = False
    # no group formed for this worker in time (Moshpit groups left it out): it averaged
    # nothing and goes on with its local update
    skipped: bool = False


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup then cosine decay to ``min_ratio * base_lr`` (nanoGPT's schedule)."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_state(opt: torch.optim.Optimizer, prefix: str) -> TensorState:
    """Flatten an optimizer's per-parameter state into named tensors (safetensors-friendly).
    The state of a sharded parameter is this rank's shard of it."""
    from farlink.parallel.sharding import local_shard

    out: TensorState = {}
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            out[f"{prefix}.{index}.{key}"] = local_shard(tensor).detach().clone()
    return out


def _optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _like_param(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A saved shard of a sharded parameter's state back as a DTensor laid out like it
    (scalars such as Adam's step stay plain)."""
    from farlink.parallel.sharding import is_sharded

    if not is_sharded(param) or value.shape != param.to_local().shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride())


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: TensorState, prefix: str) -> None:
    full = opt.state_dict()
    params = _optimizer_params(opt)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if not name.startswith(prefix + "."):
            continue
        index, key = name[len(prefix) + 1 :].split(".", 1)
        state.setdefault(int(index), {})[key] = _like_param(params[int(index)], value.clone())
    full["state"] = state
    opt.load_state_dict(full)


def worker_private_state(algo: SyncAlgorithm, residuals: bool = True) -> TensorState:
    """What a checkpoint adds for a local-update algorithm beyond the committed state: its inner
    optimizer, its local (not yet synced) parameters and its codec residuals (``residuals``
    false leaves them out: a round in flight is still encoding, and so rewriting, them)."""
    state = optimizer_state(algo.inner_opt, "inner")
    state.update({f"local.{n}": p.detach().clone() for n, p in zip(algo.names, algo.params)})
    if residuals:
        state.update(algo.exchange.compressor.state_dict())
    return state


def nothing_more() -> TensorState:
    """The second part of a checkpoint that has none (see ``SyncAlgorithm.checkpoint_parts``)."""
    return {}


def load_worker_private_state(algo: SyncAlgorithm, state: TensorState) -> None:
    load_optimizer_state(algo.inner_opt, state, "inner")
    with torch.no_grad():
        for n, p in zip(algo.names, algo.params):
            p.copy_(state[f"local.{n}"])
    algo.exchange.compressor.load_state_dict(
        {k: v for k, v in state.items() if k.startswith("residual.")}
    )


def nesterov(lr: float, momentum: float) -> OuterOptimizerFactory:
    """The default outer optimizer: SGD with Nesterov momentum (DiLoCo: lr 0.7, momentum 0.9)."""

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    return make


def healed_in_any_try(info: RoundInfo, healed: bool) -> tuple[RoundInfo, bool]:
    """A try of a round, as the retry loop must see it: a worker healed in an earlier try of
    the round (``healed``) counts as healed in this one too. The retry's quorum finds it up to
    date and would not say so, but what it would send and its weight still belong to its state
    before the heal: it sends nothing of its own, with zero weight. Returns the try's info and
    whether the round healed this worker so far."""
    if healed and not info.healed:
        return replace(info, healed=True), True
    return info, info.healed


class SyncAlgorithm(ABC):
    """One outer algorithm. ``options`` is the algorithm's ``Options`` (a ``RunConfig`` is one);
    ``inner_optimizer`` is the caller's optimizer over the model's parameters, or None for
    :meth:`default_inner_optimizer`. ``lr_schedule`` sets the inner lr every step (warmup +
    cosine over ``options.steps``); by default only for an optimizer farlink built, so a user's
    optimizer keeps the lr (and scheduler) the user gave it. ``before_round``: called before
    every round begins (the owner of background checkpoint writes lands the previous one)."""

    name: ClassVar[str]
    Options: ClassVar[type[SyncOptions]] = SyncOptions
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: the codec of a second exchange over the same collective that this algorithm hands one
    #: member's state to the others through (hierarchical DiLoCo's leader passes the new global
    #: state to its island), or None: it has none. Declared so the composition root builds that
    #: exchange (:func:`farlink.compose.build_handoff`) and hands it in as ``handoff_exchange``,
    #: as it builds every exchange
    handoff_codec: ClassVar[str | None] = None

    def __init__(
        self,
        model: nn.Module,
        options: SyncOptions,
        collective: Collective,
        exchange: Exchange,
        *,
        inner_optimizer: torch.optim.Optimizer | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
        lr_schedule: bool | None = None,
        part_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
        agree: Callable[[bool], bool] | None = None,
        schedule: Schedule | None = None,
        before_round: Callable[[], None] | None = None,
    ) -> None:
        if not isinstance(options, self.Options):
            raise TypeError(f"{self.name} takes {self.Options.__name__} (or a RunConfig), "
                            f"not {type(options).__name__}")
        self.model = model
        self.cfg = options
        self.collective = collective
        self.exchange = exchange
        from farlink.parallel.sharding import is_sharded, local_shard

        #: the model's trainable parameters as the model holds them (DTensors under FSDP2):
        #: what the inner optimizer steps and gradient clipping measures
        self.module_params = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.sharded = part_of is not None or any(is_sharded(p) for p in self.module_params)
        if self.sharded and not self.capabilities.sharded:
            raise ValueError(f"{self.name} cannot run on a sharded model (FSDP2 across a replica "
                             "group's ranks): its update is not elementwise. Use diloco, "
                             "local_sgd, streaming, sparseloco, ddp or demo, or one rank per "
                             "replica")
        #: what the algorithm synchronizes: this rank's shard of each parameter (a view sharing its
        #: storage), or the slice ``part_of`` gives (a DDP replica group's rank syncs 1/K of each
        #: whole parameter), the parameter itself when the model is not sharded
        self.shard_of = part_of or local_shard
        #: on a replica group of several ranks, a yes/no every rank must share although each reads
        #: it from its own clock (a time-budgeted round's end): True on all ranks if on any
        self.agree = agree or (lambda flag: flag)  # one process is the whole replica
        self.params = [self.shard_of(p) for p in self.module_params]
        self.lr_schedule = inner_optimizer is None if lr_schedule is None else lr_schedule
        if self.lr_schedule and options.steps is None:
            raise ValueError("the inner lr schedule (warmup + cosine) needs steps, the run's "
                             "length in inner steps; give steps=N or lr_schedule=False")
        self.inner_opt: torch.optim.Optimizer | None = None
        if not self.capabilities.inner_optimizer:
            if inner_optimizer is not None:
                log.warning("%s steps with its own update rule; the inner optimizer given is "
                            "not used", self.name)
        elif inner_optimizer is not None:
            self._check_covers(inner_optimizer)
            self.inner_opt = inner_optimizer
        else:
            self.inner_opt = self.default_inner_optimizer(self.module_params, options, model)
        if outer_optimizer is not None and not self.capabilities.outer_optimizer:
            raise ValueError(f"{self.name} takes no injected outer optimizer")
        self.outer_factory = outer_optimizer
        #: when rounds fall and when the run ends (H steps, or a time budget where the
        #: algorithm has :attr:`Capabilities.time_budget` and the options give round_seconds)
        self.schedule = schedule or make_schedule(
            options.inner_steps, options.steps,
            getattr(options, "round_seconds", None) if self.capabilities.time_budget else None,
            self.agree)
        self.inner_steps_done = 0
        self.outer_step = 0
        self.last_round: RoundInfo | None = None
        #: the most replicas of a round this replica committed, and those of the last one it
        #: committed: a run's last round with fewer left some replica out (:meth:`ended_apart`)
        self.widest_group = 0
        self.last_group: int | None = None
        #: rounds in which no group formed for this worker in time (see RoundInfo.skipped)
        self.skipped_rounds = 0
        #: of those, the ones since this replica last committed: a schedule that counts rounds
        #: (a time-budgeted run) counts them too, or a left-out replica would run rounds past
        #: the run's end with nobody left to group with
        self.rounds_skipped_since_commit = 0
        #: a newcomer's wait for a quorum until its first committed round (:meth:`join`), and
        #: whether the round being run is its zero-weight joining round
        self._newcomer_wait: float | None = None
        self._joining_round = False
        self.last_exchange: ExchangeResult | None = None
        #: the group state mixing layer (Moshpit): used by algorithms with partial_groups
        self.mixing = GroupMixing(collective, self.agree)
        self._mixed_state: TensorState | None = None  # staged by mix_group_states
        # where rounds spend their time, cumulative: waiting for the quorum (which absorbs
        # stragglers), moving bytes, and the rest (encode, decode, validate, apply) on this
        # worker; benchmarks compare them with the planner's terms
        self.quorum_seconds = 0.0
        self.network_seconds = 0.0
        self.round_seconds = 0.0
        # the training time between the last two rounds, the estimate of when the next is due
        self._round_ended: float | None = None
        self._round_gap: float | None = None
        #: called before every round begins, outside its timing: the owner of background
        #: checkpoint writes lands the previous write there (and raises its error, a full disk),
        #: so no round is committed while an earlier committed round's checkpoint is unwritten
        self.before_round = before_round
        collective.register_state(self.export_state, self.import_state)

    @classmethod
    def default_inner_optimizer(cls, params: list[nn.Parameter], options: SyncOptions,
                                model: nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW(betas=(0.9, 0.95)), the inner optimizer of DiLoCo's paper and nanoGPT; with
        ``inner="muon"``, Muon for ``model``'s hidden matrices and AdamW for the rest
        (:class:`farlink.sync.muon.MuonAdamW`)."""
        if options.inner == "muon":
            from farlink.sync.muon import MuonAdamW

            if model is None:
                raise ValueError("inner=muon sorts the model's parameters: give the model")
            return MuonAdamW.for_model(model, options.lr, options.weight_decay)
        return torch.optim.AdamW(params, lr=options.lr, betas=(0.9, 0.95),
                                 weight_decay=options.weight_decay)

    def _check_covers(self, optimizer: torch.optim.Optimizer) -> None:
        """An inner optimizer must step exactly the trainable parameters, or outer steps and
        checkpoints would silently leave some out."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if held != {id(p) for p in self.module_params}:
            raise ValueError("the inner optimizer must hold exactly the model's trainable "
                             "parameters (build it from model.parameters())")

    @classmethod
    def check_run(cls, cfg) -> None:  # noqa: ANN001 - a RunConfig (imports it would cycle)
        """Raise ValueError if a run's configuration cannot run this algorithm (its own rules;
        the generic ones come from :attr:`capabilities`)."""

    @classmethod
    def wire_spec(cls, cfg) -> str:  # noqa: ANN001 - a RunConfig
        """The codec spec this algorithm's updates go on the wire with under ``cfg``, as the
        planner (:mod:`farlink.plan.payload`) reads it: the run's ``--codec`` unless the
        algorithm sends with its own codec (DeMo, SparseLoCo), whose knobs then set it."""
        return cfg.codec

    @classmethod
    def wire_compressor(cls, options: SyncOptions, codec: str) -> Compressor:
        """The compressor this algorithm's exchange must be built with, from the run's codec
        spec (``--codec``) and the algorithm's ``options``: the run's codec unless the
        algorithm sends with its own (DeMo, SparseLoCo), which refuses a codec it cannot send.
        Asked before the exchange is built, so that the exchange is built once with the codec it
        will use and the algorithm never replaces it."""
        return make_compressor(codec)

    @classmethod
    def wire_combine(cls, compressor: Compressor) -> Combine | None:
        """The exchange's ``combine`` for an algorithm that averages the accepted payloads of
        ``compressor`` its own way (None: the exchange's aggregator over decoded updates)."""
        return None

    # --- the training loop's view -------------------------------------------------------------
    @abstractmethod
    def step(self, tokens: int) -> StepOutcome:
        """Called after ``loss.backward()`` with the number of tokens in the batch."""

    def at_boundary(self, outcome: StepOutcome) -> bool:
        """Whether the loop should checkpoint/evaluate now (every H steps, or after each round
        of a time budget)."""
        return self.schedule.at_boundary(self.inner_steps_done, outcome.synced)

    def finished(self) -> bool:
        """Whether the run's budget (``steps``, or a time budget's rounds) is spent; never,
        without one."""
        return self.schedule.finished(self.inner_steps_done, self.rounds_counted())

    def rounds_counted(self) -> int:
        """Rounds behind this replica: committed ones, and those it skipped since (no group
        took it); its next group heals it to the committed count. A time budget counts them."""
        return self.outer_step + self.rounds_skipped_since_commit

    def last_round_due(self) -> bool:
        """Whether the round about to run is the run's last (its budget is spent once the round
        is done): a backend of groups smaller than the swarm forms it with every peer."""
        return self.schedule.last_round_due(self.inner_steps_done, self.rounds_counted())

    def next_round_is_last(self) -> bool:
        """Whether the round after the one just done will be the run's last (see
        :meth:`last_round_due`), for a collective that looks for its group ahead of time."""
        return self.schedule.next_round_is_last(self.inner_steps_done, self.rounds_counted())

    def join(self, timeout: float | None = None) -> StepOutcome | None:
        """A newcomer's first round, before any inner step: heal from live peers now rather
        than after H wasted steps. ``timeout``: how long each of its rounds waits for a quorum
        until one commits (the members' rounds may be long; once in, a missing quorum means
        the run ended or broke, and the usual wait applies). Returns the joining round's
        outcome, or None for algorithms without a cheap zero-weight round (their newcomers
        heal in their first regular round)."""
        self._newcomer_wait = timeout
        self._joining_round = True
        try:
            return self.joining_round()
        finally:
            self._joining_round = False

    def joining_round(self) -> StepOutcome | None:
        """The algorithm's zero-weight round for :meth:`join`; none by default."""
        return None

    def finish(self) -> StepOutcome | None:
        """Flush work still in flight (streaming); default: nothing pending."""
        return None

    def ended_apart(self) -> str | None:
        """Why the replicas may have ended on different states, once the run is over: its last
        round committed in a smaller group than the widest this replica committed in. A replica
        left out of the last round (it reached the round after the others had finished) finds
        no peer left to heal from and commits its round alone, or with other late ones; nothing
        at the end of a run brings it the state the others committed. None when the last round
        had every replica this one had rounds with (or the run is not over)."""
        if not self.finished() or self.last_group is None \
                or self.last_group >= self.widest_group:
            return None
        if self.last_group == 1:
            who = ("this replica committed it alone: its peers had likely finished before it "
                   "reached the round, and it ends on a state of its own, not theirs")
        else:
            who = ("a replica left out of it (one that reached it after the others had "
                   "finished) ends on a state of its own")
        return (f"the run's last round (outer step {self.outer_step}) committed with "
                f"{self.last_group} of the {self.widest_group} replicas of this replica's "
                f"widest round: {who}. A join timeout (--join-timeout) above the slowest "
                "replica's lag keeps every replica in the last round")

    # --- state ---------------------------------------------------------------------------------
    @abstractmethod
    def shared_state(self) -> TensorState:
        """Committed state every replica agrees on; what a newcomer downloads."""

    @abstractmethod
    def load_shared_state(self, state: TensorState) -> None:
        """Adopt a live peer's committed state (healing)."""

    def fingerprint(self) -> str:
        """Hash of the committed state: equal on every replica after a committed round."""
        return state_digest(self.shared_state()).hex()[:16]

    def mix_group_states(self, info: RoundInfo) -> None:
        """Groups smaller than the swarm (Moshpit, :mod:`farlink.sync.moshpit`): stage the
        group's mean of the committed state this round updates (:meth:`mixable_state`), so
        the round's members hold one state once the update lands; the algorithm loads it with
        the update, so a round that fails changes nothing. Algorithms without
        :attr:`Capabilities.partial_groups` never run in such groups."""
        self._mixed_state = None
        if self.capabilities.partial_groups and self.mixing.applies(info):
            self._mixed_state = self.mixing.mix(self.mixable_state(), info)

    def mixable_state(self) -> TensorState:
        """The committed state this round's update is linear in (see :meth:`mix_group_states`);
        an algorithm with :attr:`Capabilities.partial_groups` names it."""
        raise NotImplementedError(f"{self.name} mixes no state in groups smaller than the swarm")

    @property
    def mixed_rounds(self) -> int:
        """Rounds whose group averaged differing committed states."""
        return self.mixing.mixed_rounds

    def export_state(self) -> TensorState:
        """Committed state for a healing peer, with its SHA-256 attached (checked on arrival)."""
        return with_digest(self.shared_state())

    def import_state(self, state: TensorState) -> None:
        """Adopt a transferred state only if it hashes to the digest the sender attached and every
        tensor has the shape this replica holds: a replica group heals rank r from rank r of another
        replica group, so a peer whose shards are cut otherwise (another --ranks-per-worker or
        --sharding) would hand over the wrong slice, or fail deep inside a copy."""
        state = verified(state)
        mine = {key: tuple(value.shape) for key, value in self.shared_state().items()}
        misfit = sorted(k for k, shape in mine.items()
                        if k in state and tuple(state[k].shape) != shape)
        if misfit:
            key = misfit[0]
            raise StateTransferError(
                f"a live peer's state does not fit this replica ({len(misfit)} tensors, e.g. "
                f"{key}: {tuple(state[key].shape)} there, {mine[key]} here): every worker of a "
                "run needs the same model, --ranks-per-worker and --sharding (rank r of each "
                "replica group holds the same shard)")
        self.load_shared_state(state)

    def state_dict(self) -> TensorState:
        """Shared state plus this worker's private state, for an exact resume."""
        return {**self.shared_state(), "counter.inner_steps": torch.tensor(self.inner_steps_done)}

    def checkpoint_parts(self) -> tuple[TensorState, Callable[[], TensorState]]:
        """:meth:`state_dict` in two parts, for a checkpoint written in the background: what
        can be read now, and a function that returns the rest, called by the writer's thread.
        The rest is what a round still in flight decides (an outer step off the critical path,
        :mod:`farlink.sync.delayed`): waiting for it there keeps the training loop from waiting
        for the WAN at every checkpoint. Here everything is read now."""
        return self.state_dict(), nothing_more

    def load_state_dict(self, state: TensorState) -> None:
        self.load_shared_state(state)
        self.inner_steps_done = int(state["counter.inner_steps"])

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor :meth:`state_dict` holds on this rank, and of those made only
        later, under a prefix: ``inner.I.`` and ``outer.I.`` for the states of an optimizer's
        parameter I (made at its first step), ``residual.NAME`` for a codec's residual of NAME
        (made at the first round): what this rank would hold of each. A replica group resumed with
        another number of ranks cuts its checkpoint to them (:mod:`farlink.parallel.reshard`)."""
        from farlink.parallel.sharding import local_shard

        shapes = {key: tuple(value.shape) for key, value in self.state_dict().items()}
        for prefix in ("inner", "outer"):
            opt = getattr(self, f"{prefix}_opt", None)
            for index, param in enumerate(_optimizer_params(opt) if opt is not None else []):
                shapes[f"{prefix}.{index}."] = tuple(local_shard(param).shape)
        for name, param in zip(self.names, self.params):
            shapes.setdefault(f"residual.{name}", tuple(param.shape))
        return shapes

    # --- helpers -------------------------------------------------------------------------------
    def round_outcome(self, committed: bool, seconds: float, info: RoundInfo | None) -> StepOutcome:
        """The outcome of a step that ran a round (see :meth:`run_round`)."""
        result = self.last_exchange
        return StepOutcome(
            synced=True,
            committed=committed,
            outer_step=self.outer_step,
            world_size=info.world_size if info else 1,
            comm_seconds=seconds,
            rejected=len(result.rejected) if result else 0,
            skipped=bool(info and info.skipped),
        )

    def replica_state(self) -> TensorState:
        """Parameters and counters, for algorithms whose replicas hold no separate global copy."""
        state = {f"param.{n}": p.detach().clone() for n, p in zip(self.names, self.params)}
        state["counter.outer_step"] = torch.tensor(self.outer_step)
        state["counter.inner_steps"] = torch.tensor(self.inner_steps_done)
        return state

    def load_replica_state(self, state: TensorState) -> None:
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(state[f"param.{n}"])
        self.outer_step = int(state["counter.outer_step"])
        self.inner_steps_done = int(state["counter.inner_steps"])

    def current_lr(self) -> float:
        """The inner lr of the next step: scheduled, or what the inner optimizer holds."""
        if not self.lr_schedule:
            return float(self.inner_opt.param_groups[0]["lr"])
        cfg = self.cfg
        step = self.schedule.lr_step(self.inner_steps_done, self.rounds_done())
        return lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)

    def rounds_done(self) -> float:
        """How far the run is in rounds, for a time budget's lr schedule: committed rounds."""
        return self.outer_step

    def traffic(self) -> dict[str, int]:
        """Bytes by level, for algorithms that tell levels apart (hierarchical); else none."""
        return {}

    def local_gradients(self) -> list[torch.Tensor | None]:
        """This rank's part of each parameter's gradient, matching :attr:`params`: under FSDP2
        the gradient lives on the sharded parameter, not on its local view, so it is read
        there (None: the parameter got no gradient)."""
        return [None if held.grad is None else self.shard_of(held.grad)
                for held in self.module_params]

    def clip_and_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.lr_schedule:
            lr = self.current_lr()
            for group in optimizer.param_groups:
                group["lr"] = lr
        if self.cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.module_params, self.cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def run_round(
        self, build: callable, apply: callable, weight: float, before: bool = True,
        tag: Callable[[], str | None] | None = None,
    ) -> tuple[bool, float, RoundInfo | None]:
        """One fault-tolerant round: quorum, exchange, commit; retried after a failure.
        ``before`` false: the caller already ran ``before_round`` (a delayed round does, in the
        training thread, before its own thread starts). ``tag()``: what this try of the round
        carries, announced in its quorum (``Collective.begin_round``); asked at every try, since
        a heal may change it between tries.

        ``build(info)`` returns the named tensors to send (called after the quorum, so a worker
        healed in this quorum sends its freshly loaded state's update); ``apply(result, info)`` runs
        only when every participant committed. Returns (committed, seconds blocked, round info).
        A worker healed in one try of the round counts as healed in its retries too (its
        ``info.healed`` stays set): it sends with zero weight, and ``build`` sees the heal.
        """
        if before and self.before_round is not None:
            self.before_round()
        start = time.perf_counter()
        if self._round_ended is not None:
            self._round_gap = start - self._round_ended
        network_before = self.collective.stats.comm_seconds
        info, committed, healed = None, False, False
        # the run's last round: a backend of small groups forms it with every live peer
        final = self.last_round_due()
        for attempt in range(self.cfg.round_retries + 1):
            asked = time.perf_counter()
            info = self.collective.begin_round(final=final, joining=self._joining_round,
                                               timeout=self._newcomer_wait,
                                               tag=tag() if tag is not None else None)
            self.quorum_seconds += time.perf_counter() - asked
            info, healed = healed_in_any_try(info, healed)
            self.last_round = info
            if info.skipped:  # no group for this worker this round: nothing to average
                self.collective.commit()  # closes the round; it commits nothing
                self.last_exchange = None
                self.skipped_rounds += 1
                self.rounds_skipped_since_commit += 1
                log.warning("round %d: no group formed for this worker in time; it skips "
                            "averaging and goes on with its local update", info.round_id)
                break
            tensors = build(info)
            self.mix_group_states(info)
            result = self.exchange.average(
                tensors, 0.0 if info.healed else weight, info.round_id
            )
            self.last_exchange = result
            ok = self.collective.commit()
            self.exchange.settle(result, info.round_id, ok)
            if ok:
                apply(result, info)
                self.outer_step = info.round_id + 1
                self.widest_group = max(self.widest_group, info.world_size)
                self.last_group = info.world_size
                self.rounds_skipped_since_commit = 0
                self._newcomer_wait = None  # in: the usual wait from now on
                committed = True
                break
            log.warning("round %d not committed (attempt %d)", info.round_id, attempt + 1)
            self.collective.stats.failed_rounds += 1
        self._round_ended = time.perf_counter()
        seconds = self._round_ended - start
        self.round_seconds += seconds
        self.network_seconds += self.collective.stats.comm_seconds - network_before
        if self._round_gap is not None and not self.finished():
            # the next round is due about as far off as this one was from the last: the
            # collective may form its group meanwhile (hivemind's matchmaking), as the run's
            # last round if it is (formed with every live peer, under a key of its own: a
            # search of the usual kind would pair a peer with one that then leaves for it)
            self.collective.expect_round(self._round_gap, final=self.next_round_is_last())
        return committed, seconds, info
