"""The composition root: the one module that reads a run's :class:`~farlink.config.RunConfig`
and builds the library's objects from it (model, collective(s), exchange, algorithm, ledger,
checkpoint writer).

Library constructors take built objects (a :class:`~farlink.comm.base.Collective`, an
:class:`~farlink.sync.exchange.Exchange`, an algorithm's own ``Options``), as torchft's
``DiLoCo(manager, ...)`` and hivemind's ``Optimizer(dht=...)`` do; only this module, and the
application around it (``farlink train``, ``join``, ``swarm``, the benches), knows which flag
builds which object. :class:`farlink.Optimizer`'s keyword form
(``farlink.Optimizer(model, opt, algorithm="diloco", backend="torchft", ...)``) is a thin path
into :func:`compose`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from farlink.codecs import Compressor, make_compressor
from farlink.comm.base import Collective, LinkModel
from farlink.comm.inprocess import DrivenGroup, InProcessGroup
from farlink.config import RunConfig
from farlink.links import get_profile
from farlink.parallel.sharding import ReplicaGroup, model_is_sharded
from farlink.parallel.stage_sync import Stage, StageMember
from farlink.robust import hostile
from farlink.robust.aggregators import make_aggregator
from farlink.robust.attacks import make_attack
from farlink.robust.auth import make_authenticator, run_authenticator, run_secret
from farlink.robust.ledger import ContributionLedger
from farlink.robust.score import LossScorer
from farlink.robust.weights import CLAIM_FACTOR, TIMED_CLAIM_FACTOR, round_token_bound
from farlink.state.background import Background
from farlink.sync import ALGORITHMS, SyncAlgorithm, algorithm_class
from farlink.sync.base import OuterOptimizerFactory
from farlink.sync.exchange import Combine, Exchange, Tamper
from farlink.train.network import needs_network
from farlink.train.tiers import Tiers, build_tiers, two_levels

#: how long past its boundary a peer in Moshpit groups looks for a group before it skips the
#: round's averaging: two of hivemind's matchmaking windows (3 s each by default)
MOSHPIT_SKIP_AFTER = 6.0


def moshpit_options(cfg: RunConfig) -> dict[str, Any]:
    """Groups smaller than the swarm (``group_size``) leave a peer out whenever the live peers
    do not divide into them (3 peers in groups of 2): that peer skips the round after
    :data:`MOSHPIT_SKIP_AFTER` instead of waiting the quorum timeout for a group that cannot
    form, and the run's last round is one group of the whole swarm, so the run ends on one
    model (see :class:`~farlink.comm.hivemind_backend.HivemindCollective`)."""
    return {"skip_after": MOSHPIT_SKIP_AFTER,
            "final_group_size": max(cfg.workers, cfg.min_replicas, cfg.group_size)}


def advertised_host(cfg: RunConfig) -> str:
    """The address peers reach this worker at: inside an emulated WAN namespace, the
    namespace's own address (the launcher sets ``FARLINK_EMULATED_HOST``), else ``host``."""
    return os.environ.get("FARLINK_EMULATED_HOST") or cfg.host


def build_collective(cfg: RunConfig, replica_id: str, address: str, replica_group=None,
                     link: LinkModel | None = None, **hivemind: Any) -> Collective:
    """The run's backend for one replica: ``address`` is where it joins, the torchft Lighthouse's
    address or hivemind's initial peers (a comma list of multiaddrs; empty: this peer starts the
    DHT), as :func:`join_address` names them. ``replica_group``: a started
    :class:`~farlink.parallel.sharding.ReplicaGroup` of several ranks, whose ranks form one replica
    group (torchft) or one member of each averaging group (hivemind; every rank runs its own peer,
    :mod:`farlink.comm.hivemind_replica_group`). ``hivemind``: HivemindCollective options that
    override the ones derived from ``cfg`` (a volunteer's run id, identity file, client mode).
    ``link``: the emulated link a network plan gives this collective; ``--emulate-link`` (one link
    for every collective) takes its place when set."""
    if cfg.emulate_link is not None:
        link = LinkModel.of_profile(get_profile(cfg.emulate_link))
    several_ranks = replica_group is not None and replica_group.size > 1
    if several_ranks and cfg.backend not in ("torchft", "hivemind"):
        raise ValueError(f"a replica group of {replica_group.size} ranks per replica runs on the "
                         f"torchft or hivemind backend, not {cfg.backend!r}")
    admission = run_authenticator(cfg, replica_id)  # None without --auth: nothing to prove
    if cfg.backend == "torchft":
        from farlink.comm.torchft_backend import TorchftCollective

        if not address:
            raise ValueError("the torchft backend needs a Lighthouse address (lighthouse=..., "
                             "or TORCHFT_LIGHTHOUSE); start one with "
                             "farlink.train.lighthouse.Lighthouse or torchft_lighthouse")
        return TorchftCollective(
            replica_id=replica_id,
            lighthouse_addr=address,
            host=advertised_host(cfg),
            min_replicas=cfg.min_replicas,
            round_timeout=cfg.round_timeout,
            quorum_timeout=cfg.quorum_timeout,
            join_timeout=cfg.join_timeout,
            admission=admission,
            emulated_link=link,
            **({} if replica_group is None or replica_group.size == 1 else dict(
                group_rank=replica_group.rank, group_world_size=replica_group.size,
                store_addr=replica_group.store_host, store_port=replica_group.store_port)),
        )
    if cfg.backend == "hivemind":
        from farlink.comm.hivemind_backend import HivemindCollective
        from farlink.comm.hivemind_net import tcp_maddr

        peers = [p for p in address.split(",") if p] if address else []
        options: dict[str, Any] = dict(
            run_id=f"farlink-{cfg.run_dir.name}",
            initial_peers=peers,
            host_maddrs=[tcp_maddr(advertised_host(cfg), 0)],
            min_group_size=cfg.min_replicas,
            # a full group starts its round at once; without a size hivemind's leader waits out
            # the whole matchmaking window every round (about 3 s instead of 0.3 s on loopback)
            target_group_size=cfg.group_size or max(cfg.workers, cfg.min_replicas),
            **(moshpit_options(cfg) if cfg.group_size else {}),
            round_timeout=cfg.quorum_timeout,
            allreduce_timeout=cfg.round_timeout,
            gather_timeout=cfg.round_timeout,
            admission=admission,
            emulated_link=link,
        )
        if replica_group is not None and replica_group.size > 1:
            from farlink.comm.hivemind_replica_group import HivemindReplicaGroupCollective

            return HivemindReplicaGroupCollective(
                replica_group, lambda: HivemindCollective(**{**options, **hivemind}))
        return HivemindCollective(**{**options, **hivemind})
    if cfg.backend == "inprocess":
        return InProcessGroup(1, link).member(0)  # peers as threads pass their own collective
    raise ValueError(f"unknown backend {cfg.backend!r}")


def build_exchange(cfg: RunConfig, collective: Collective, sender: str, index: int, ledger=None,
                   claims: str = "run", *, compressor: Compressor | None = None,
                   combine: Combine | None = None, scorer: LossScorer | None = None,
                   path: str = "auto", tamper: Tamper | None = None):
    """Codec, aggregator, authentication, screen and (emulated) attack of one replica.

    ``compressor`` and ``combine``: what the algorithm sends with and averages with
    (:func:`wire`; default: the run's ``--codec`` and the aggregator); ``scorer``: the loss
    scorer of ``--score loss`` (:func:`build_scorer`); ``path``: the exchange's path;
    ``tamper``: an emulated attacker's rewrite of this replica's updates (default: the run's
    ``--attack`` on its ``--attackers``). All are given here because an exchange keeps what it
    is built with.

    ``claims``: how a peer's claimed token count is bounded (:mod:`farlink.robust.weights`).
    ``"run"``: the config says how many tokens a round holds (its batch, sequence length,
    grad_accum and inner steps, as ``farlink train`` runs them), and no claim counts for more
    than 1.5 x the round's median (8 x in a time-budgeted round, whose peers differ in speed);
    ``"relative"``: only the median bound (a model and batches
    of the caller's own, whose token counts the config does not know); ``"none"``: neither
    (island leaders, whose islands differ in size). The envelope's float32 bound always holds."""
    auth = make_authenticator(cfg.auth, secret=run_secret(cfg), key_file=cfg.key_file,
                              allowed_keys=cfg.allowed_keys, peer_id=sender)
    protocol = hostile.parse(cfg.attack) is not None  # a hostile member, not a bad update
    if cfg.is_attacker(index) and not protocol:
        if tamper is not None:
            raise TypeError(f"replica {index} is one of the run's attackers (attack="
                            f"{cfg.attack!r}): give either that or tamper=, not both")
        tamper = make_attack(cfg.attack, seed=index)
    exchange = Exchange(
        collective,
        compressor if compressor is not None else make_compressor(cfg.codec),
        sender=auth.peer_id if auth.name == "ed25519" else sender,
        aggregator=make_aggregator(cfg.aggregator),
        authenticator=auth,
        ledger=ledger,
        tamper=tamper,
        screen_ratio=cfg.screen_ratio or None,
        max_weight=round_token_bound(cfg.tokens_per_step, cfg.inner_steps,
                                     getattr(cfg, "round_seconds", None))
        if claims == "run" else None,
        claim_factor=None if claims == "none" else (
            TIMED_CLAIM_FACTOR if getattr(cfg, "round_seconds", None) else CLAIM_FACTOR),
        # a fixed-step round credits at most its own tokens (a timed one: the claim bound)
        round_allowance=None if claims != "run" else (
            float(cfg.tokens_per_step * cfg.inner_steps)
            if getattr(cfg, "round_seconds", None) is None
            else round_token_bound(cfg.tokens_per_step, cfg.inner_steps, cfg.round_seconds)),
        combine=combine,
        scorer=scorer,
        path=path,
    )
    if protocol and cfg.is_attacker(index):
        hostile.arm(cfg.attack, collective, exchange, cfg.codec, name=sender)
    return exchange


def wire(cls: type[SyncAlgorithm], options: Any, codec: str) -> dict[str, Any]:
    """The ``compressor`` and ``combine`` the exchange of a ``cls`` run is built with: asked of
    the algorithm class (its ``options``, the run's ``--codec``) before the exchange exists, so
    an algorithm that sends with its own codec (DeMo, SparseLoCo) never replaces the
    exchange's; a codec it cannot send is refused here, with its own message."""
    compressor = cls.wire_compressor(options, codec)
    return {"compressor": compressor, "combine": cls.wire_combine(compressor)}


def build_handoff(cls: type[SyncAlgorithm], exchange: Exchange) -> dict[str, Exchange]:
    """The hand-off exchange a ``cls`` algorithm declares (:attr:`SyncAlgorithm.handoff_codec`),
    as the keyword its constructor takes: over ``exchange``'s collective, with that codec and
    the plain mean, sending and authenticating as ``exchange`` does (so a hand-off is signed
    and verified when the run is). Empty for an algorithm without one."""
    if cls.handoff_codec is None:
        return {}
    return {"handoff_exchange": Exchange(exchange.collective, make_compressor(cls.handoff_codec),
                                         sender=exchange.sender,
                                         authenticator=exchange.authenticator)}


def build_scorer(cfg: RunConfig, model: nn.Module,
                 base: Callable[[], dict[str, torch.Tensor]], data) -> LossScorer:  # noqa: ANN001
    """The loss scorer of ``--score loss`` (:mod:`farlink.robust.score`): it applies each peer's
    update to ``base()`` (the algorithm's global parameters, by name) and measures ``model``'s
    loss on ``score_rows`` sequences of the peer's own shard (peer ``wI`` trained shard ``I``; a
    peer known by another name is judged on held-out text alone) and on as many from the end of
    the held-out text, which the run's evaluation (its start) does not read unless the held-out
    text is short."""
    from farlink.data import ShardSampler, heldout_batches

    rows, seq = cfg.score_rows, cfg.seq_len
    tail = data.heldout[-(rows * seq + 1):]
    heldout = heldout_batches(tail, seq, rows, 1)[0]

    def assigned(peer: str, round_id: int):  # noqa: ANN202 - a batch or None
        if not (peer.startswith("w") and peer[1:].isdigit()):
            return None
        sampler = ShardSampler(data.train, shard=int(peer[1:]) % cfg.workers,
                               num_shards=cfg.workers, seq_len=seq, batch_size=rows,
                               seed=cfg.seed * 1_000_003 + round_id)
        return sampler.next_batch()

    return LossScorer(model, base, assigned, heldout,
                      threshold=cfg.score_threshold, turns=cfg.score_turns)


def global_params_of(algorithm: Callable[[], SyncAlgorithm]) -> Callable[[], dict]:
    """A scorer's ``base``: the global parameters, by name, of the algorithm ``algorithm()``
    returns, read when a round is scored.

    Why late: the algorithm makes its global parameters from the model when it is built, and it
    is built with its exchange, which is built with its scorer. A round is only scored by the
    built algorithm, so the scorer reads the parameters then; the exchange is built once,
    scorer included, and nothing is assigned to it afterwards (the alternatives: the root
    making the algorithm's global parameters, or every round handing them to the exchange,
    would change every algorithm's constructor or every exchange call)."""

    def base() -> dict[str, torch.Tensor]:
        built = algorithm()
        return dict(zip(built.names, built.global_params))

    return base


@dataclass
class Parts:
    """One replica of a run, built: what :class:`farlink.Optimizer` holds and drives."""

    config: RunConfig
    index: int
    model: nn.Module
    algorithm: SyncAlgorithm
    collective: Collective
    exchange: Exchange
    ledger: ContributionLedger
    checkpoint_writes: Background  # save(background=True)
    tiers: Tiers | None = None  # with islands: the island and global collectives
    # a started replica group of several ranks, or None for one rank
    replica_group: ReplicaGroup | None = None
    #: a replica group running DDP (each rank holds the whole replica): gradients are averaged over
    #: its ranks, each rank syncs a 1/K slice across replica groups, and the slices are shared after
    whole_replica_per_rank: bool = False
    trainable: list[torch.Tensor] = field(default_factory=list)

    @property
    def replica_id(self) -> str:
        return f"w{self.index}"


def run_config(cls: type[SyncAlgorithm], options: dict[str, Any],
               inner_optimizer: torch.optim.Optimizer | None,
               lr_schedule: bool | None) -> tuple[RunConfig, Any]:
    """The config of the keyword form (``farlink.Optimizer(model, opt, algorithm=..., ...)``)
    and the algorithm's options: those given, the algorithm's defaults for the rest (so it can
    tell them apart), and no length unless one is given (RunConfig's default is 500 steps)."""
    if options.get("backend") == "hivemind":
        if not {"workers", "min_replicas"} & set(options):
            raise ValueError(
                "on the hivemind backend say how many replicas a round waits for: "
                "workers=N (the N replicas you start; every round averages all of them) "
                "or min_replicas=M (elastic: a round commits with M or more)")
        # rounds of the replicas asked for, not of RunConfig's 4 launched workers, and
        # of all of them unless said otherwise (initial_peers given or not)
        options.setdefault("workers", options.get("min_replicas"))
        options.setdefault("min_replicas", options["workers"])
    if inner_optimizer is not None:
        options.setdefault("grad_clip", 0.0)  # the user's loop owns its gradients
        if not lr_schedule:  # ... and its lr: farlink's warmup does not apply
            options.setdefault("warmup_steps", 0)
    config = RunConfig.model_validate(options)
    algo_options = cls.Options.model_validate(
        {k: getattr(config, k) for k in cls.Options.model_fields if k in options})
    return config, algo_options


def build_replica_group(cfg: RunConfig, model: nn.Module, index: int,
                        replica_group=None):  # noqa: ANN001, ANN201
    """The started :class:`~farlink.parallel.sharding.ReplicaGroup` of several ranks this replica
    runs on (read from torchrun's environment for a sharded model), or None for one rank."""
    if replica_group is None and model_is_sharded(model):
        replica_group = ReplicaGroup.from_env(replica_index=index)
    if replica_group is not None and replica_group.size > 1 and not replica_group.store_port:
        replica_group.start(host=advertised_host(cfg))
    return replica_group if replica_group is not None and replica_group.size > 1 else None


def build_collectives(cfg: RunConfig, cls: type[SyncAlgorithm], index: int, address: str,
                      replica_group, collective: Collective | None,  # noqa: ANN001
                      global_lighthouse: str | None, global_collective: Collective | None):  # noqa: ANN201
    """This replica's collective and, with islands, its :class:`~farlink.train.tiers.Tiers`
    (island and global collectives): planned by the launcher's network, or formed by the caller
    (its island's collective or Lighthouse, and for the island's leader the global one).
    ``address``: where this replica joins (:func:`join_address`)."""
    replica_id = f"w{index}"
    tiered = cls.capabilities.islands
    formed = global_lighthouse is not None or global_collective is not None
    if formed and not tiered:
        names = [n for n in ALGORITHMS if algorithm_class(n).capabilities.islands]
        raise ValueError(f"global_lighthouse/global_collective link island leaders in "
                         f"{', '.join(names)}; {cls.name} has one level: drop them")
    host = advertised_host(cfg)
    tiers = (build_tiers(cfg, index, address, build_collective, replica_group, host)
             if collective is None and not formed and needs_network(cfg) else None)
    if tiers is None and tiered:
        if collective is not None:
            island = collective
            if global_collective is None and global_lighthouse is not None:
                global_collective = build_collective(cfg, replica_id, global_lighthouse,
                                                     replica_group=replica_group)
        else:
            island, built = two_levels(
                cfg, replica_id, address,
                global_lighthouse if global_collective is None else None,
                build_collective, replica_group, host)
            global_collective = global_collective or built
        tiers = Tiers(island, global_collective)
    if tiers is not None:
        return tiers.collective, tiers
    return (collective or build_collective(cfg, replica_id, address, replica_group=replica_group),
            None)


def join_address(cfg: RunConfig, lighthouse: str | None,
                 peers: str | Sequence[str] | None) -> str:
    """Where a replica joins its run, one word per backend: torchft's Lighthouse
    (``lighthouse=``) or hivemind's initial peers (``peers=``: multiaddrs, a list or a comma
    list; none for the first peer, which starts the DHT). Defaults: the config's
    ``lighthouse``/``initial_peers``, then ``TORCHFT_LIGHTHOUSE``."""
    if peers is not None:
        if cfg.backend != "hivemind":
            raise ValueError(f"peers= are hivemind's initial peers; the {cfg.backend} backend "
                             f"joins through lighthouse=... (a torchft Lighthouse address)")
        if lighthouse is not None:
            raise TypeError("give hivemind's initial peers as peers=, not also lighthouse=")
        return peers if isinstance(peers, str) else ",".join(peers)
    if lighthouse is not None:
        if cfg.backend == "hivemind":
            raise ValueError("lighthouse= is torchft's Lighthouse address; on the hivemind "
                             "backend give the initial peers as peers=[...] (multiaddrs, a list "
                             "or a comma list)")
        return lighthouse
    return cfg.lighthouse or cfg.initial_peers or os.environ.get("TORCHFT_LIGHTHOUSE", "")


def compose(
    model: nn.Module,
    inner_optimizer: torch.optim.Optimizer | None = None,
    *,
    config: RunConfig | None = None,
    lighthouse: str | None = None,
    peers: str | Sequence[str] | None = None,
    index: int = 0,
    outer_optimizer: OuterOptimizerFactory | None = None,
    lr_schedule: bool | None = None,
    collective: Collective | None = None,
    replica_group=None,  # noqa: ANN001
    global_lighthouse: str | None = None,
    global_collective: Collective | None = None,
    scorer: LossScorer | None = None,
    score_data=None,  # noqa: ANN001
    tamper: Tamper | None = None,
    **options: Any,
) -> Parts:
    """One replica of a run around ``model`` (the arguments of :class:`farlink.Optimizer`): the
    run's config (``config``, or its fields as keyword ``options``), then its replica group,
    collective(s), exchange(s), ledger, algorithm and checkpoint writer.

    ``scorer``: a built :class:`~farlink.robust.score.LossScorer` for the exchange; or
    ``score_data`` (the run's prepared corpus, :func:`farlink.data.prepare_data`): with
    ``--score loss``, the scorer :func:`build_scorer` makes from it over the algorithm's
    global parameters (``farlink train``'s workers, the in-process bench).

    ``tamper``: an emulated attacker's rewrite of this replica's updates, ``(update, round_id)
    -> update`` (:mod:`farlink.robust.attacks` has the field's), given to its exchange (the
    island's, with islands); the config's ``attack`` on its ``attackers`` builds one the same
    way."""
    config_given = config is not None  # farlink train's whole config: its batches are ours
    if config is not None and options:
        raise TypeError("give either config=RunConfig(...) or its fields as keywords, not both")
    cls = algorithm_class(config.algorithm if config is not None
                          else options.get("algorithm", "diloco"))
    if config is None:
        cfg, algo_options = run_config(cls, options, inner_optimizer, lr_schedule)
    else:
        cfg = algo_options = config
    replica_group = build_replica_group(cfg, model, index, replica_group)
    address = join_address(cfg, lighthouse, peers)
    if collective is not None and cfg.emulate_link is not None and collective.emulated_link is None:
        raise ValueError(
            f"emulate_link={cfg.emulate_link!r} holds the collectives farlink builds; the "
            "collective you passed has no emulated link: build it with one "
            "(InProcessGroup(n, link=LinkModel.of_profile(get_profile(name))), "
            "TorchftCollective(..., emulated_link=...)) or leave emulate_link out")
    collective, tiers = build_collectives(cfg, cls, index, address, replica_group, collective,
                                          global_lighthouse, global_collective)
    replica_id = f"w{index}"
    ledger = ContributionLedger()  # whose updates were accepted, rejected, and why
    if scorer is not None and score_data is not None:
        raise TypeError("give either scorer=LossScorer(...) or score_data=, not both")
    if scorer is None and score_data is not None and cfg.score == "loss":
        scorer = build_scorer(cfg, model, global_params_of(lambda: algorithm), score_data)
    exchange = build_exchange(cfg, collective, replica_id, index, ledger,
                              claims="run" if config_given else "relative",
                              scorer=scorer, tamper=tamper,
                              **wire(cls, algo_options, cfg.codec))
    whole_replica_per_rank = replica_group is not None and not model_is_sharded(model)
    extra: dict[str, Any] = {}
    if whole_replica_per_rank:
        extra["part_of"] = replica_group.part_of
    if replica_group is not None:
        extra["agree"] = replica_group.agree_any
    if tiers is not None and tiers.upper is not None:
        extra["global_exchange"] = build_exchange(cfg, tiers.upper, replica_id, index, ledger,
                                                  claims="none")
    extra.update(build_handoff(cls, exchange))
    checkpoint_writes = Background("checkpoint")  # save(background=True)
    algorithm = cls(model, algo_options, collective, exchange, inner_optimizer=inner_optimizer,
                    outer_optimizer=outer_optimizer, lr_schedule=lr_schedule,
                    before_round=checkpoint_writes.wait, **extra)
    return Parts(config=cfg, index=index, model=model, algorithm=algorithm,
                 collective=collective, exchange=exchange, ledger=ledger,
                 checkpoint_writes=checkpoint_writes, tiers=tiers, replica_group=replica_group,
                 whole_replica_per_rank=whole_replica_per_rank,
                 trainable=[p for p in model.parameters() if p.requires_grad])


def build_stage_members(cfg: RunConfig, stage: int, peers: list[str],
                        module: Callable[[], nn.Module]) -> Stage:
    """The members of one pipeline stage's rounds (:mod:`farlink.parallel.stage_sync`): for
    each of its ``peers`` (peer p of stage s is worker ``s x P + p``, as ``--slowdown`` and
    ``--attackers`` count), the run's algorithm around ``module()`` (a copy of the stage's
    module at the run's initial weights) with its own exchange: the run's codec, aggregator,
    authentication, screen and emulated attack, as every replica of a run has. With
    ``emulate_link``, the members' collectives take as long as that link would."""
    link = (LinkModel.of_profile(get_profile(cfg.emulate_link))
            if cfg.emulate_link is not None else None)
    group = DrivenGroup(len(peers), link)
    ledger = ContributionLedger()
    cls = algorithm_class(cfg.algorithm)
    members = []
    for p, peer in enumerate(peers):
        collective = group.member(p)
        exchange = build_exchange(cfg, collective, f"s{stage}p{p}", stage * len(peers) + p,
                                  ledger, **wire(cls, cfg, cfg.codec))
        # no inner steps here (the peer takes them): the inner optimizer is never stepped
        members.append(StageMember(peer, cls(module(), cfg, collective, exchange,
                                             lr_schedule=False, **build_handoff(cls, exchange))))
    return Stage(group, members)
