"""The feature matrix: which features run together, and for each pair that does not, why and
what to do instead.

Every cross-component refusal of a run's configuration is a row of :data:`RULES`, and the only
place one is raised is :func:`check` (``RunConfig``'s validation, ``farlink train``'s launch
check and ``farlink swarm`` call it), so a row cannot say one thing while the code does
another: ``farlink matrix`` prints the same table, and tests/test_matrix.py builds every
refused row's configuration and asserts that validating it raises the row's reason.

Three kinds of rule:

* :class:`Pair`: two features that do not run together, whatever the algorithm;
* :class:`Needs`: a feature that needs a capability of the algorithm
  (:class:`~farlink.sync.Capabilities`). It is expanded to one row per algorithm, supported or
  refused as the algorithm's capability says, so an algorithm that gains the capability flips
  its rows without an edit here;
* :class:`Unread`: an option of other algorithms (a field of their ``Options`` that the chosen
  algorithm's lacks) given a value: refused, not ignored.

A rule's ``scope`` says where it applies: ``None`` for every run configuration, or a command
that starts processes (``train``: ``farlink train``/``join``; ``namespaces``: a run inside the
namespace emulator; ``swarm``: ``farlink swarm``), whose caller names it in :func:`check`.

Value checks of one component (a codec that parses, a batch that splits into micro-batches,
indices in range) are not rows: they are not pairs of features, and stay with the config.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from farlink.robust import hostile
from farlink.robust.hostile import NOT_ON_TORCHFT
from farlink.sync import ALGORITHMS, Capabilities, algorithm_class, algorithm_options

Config = Any  # a RunConfig (importing it here would be circular: it validates with this module)
SCOPES = ("train", "namespaces", "swarm")
BACKENDS = ("torchft", "hivemind", "inprocess")


@dataclass(frozen=True)
class Feature:
    """One feature a run may use: its name in the table, whether a config uses it, and flat
    config values that turn it on (to build the row's example)."""

    label: str
    used: Callable[[Config], bool]
    example: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """One line of the printed matrix."""

    first: str
    second: str
    supported: bool
    reason: str  # the refusal's message (what the user reads), "" when supported
    example: dict[str, Any]  # flat config values that combine the two features
    scope: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"first": self.first, "second": self.second, "supported": self.supported,
                "reason": self.reason, "scope": self.scope,
                "example": {k: str(v) for k, v in self.example.items()}}


@dataclass(frozen=True)
class Pair:
    """``first`` and ``second`` do not run together; ``why(cfg)`` says why and what to do."""

    first: Feature
    second: Feature
    why: Callable[[Config], str]
    scope: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # values the example needs besides

    def refuses(self, cfg: Config) -> bool:
        return self.first.used(cfg) and self.second.used(cfg)

    def rows(self, config: type) -> list[Row]:
        example = {**self.first.example, **self.second.example, **self.extra}
        return [Row(self.first.label, self.second.label, False,
                    self.why(config.model_construct(**example)), example, self.scope)]


@dataclass(frozen=True)
class Needs:
    """``feature`` runs only with an algorithm whose capabilities ``able(caps)`` holds."""

    feature: Feature
    able: Callable[[Capabilities], bool]
    why: Callable[[Config], str]
    scope: str | None = None

    def refuses(self, cfg: Config) -> bool:
        return self.feature.used(cfg) and not self.able(_caps(cfg.algorithm))

    def rows(self, config: type) -> list[Row]:
        rows = []
        for name in ALGORITHMS:
            example = {"algorithm": name, **self.feature.example}
            supported = self.able(_caps(name))
            rows.append(Row(f"algorithm={name}", self.feature.label, supported,
                            "" if supported else self.why(config.model_construct(**example)),
                            example, self.scope))
        return rows


@dataclass(frozen=True)
class Unread:
    """``field``, an option of some algorithms (their ``Options``), given a value by a run
    whose algorithm does not read it: refused, not ignored (the user meant something by it)."""

    field: str
    scope: str | None = None

    def refuses(self, cfg: Config) -> bool:
        return (getattr(cfg, self.field) != _default(cfg, self.field)
                and self.field not in _options(cfg.algorithm))

    def why(self, cfg: Config) -> str:
        readers = "/".join(n for n in ALGORITHMS if self.field in _options(n))
        flag = "--" + self.field.replace("_", "-")
        return (f"{self.field} is an option of {readers}; {cfg.algorithm} does not read it: drop "
                f"{flag}, or choose {readers}")

    def rows(self, config: type) -> list[Row]:
        others = [n for n in ALGORITHMS if self.field not in _options(n)]
        example = {"algorithm": others[0], self.field: _other_value(config, self.field)}
        return [Row(self.field, "algorithm=" + "/".join(others), False,
                    self.why(config.model_construct(**example)), example)]


def _options(name: str) -> dict[str, Any]:
    return algorithm_class(name).Options.model_fields


def _other_value(config: type, name: str) -> Any:
    """A value of option ``name`` other than its default (half of it; another choice of a
    ``Literal``), for a row's example."""
    info = config.model_fields[name]
    default = info.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, str):
        return next(c for c in typing.get_args(info.annotation) if c != default)
    return default // 2 if isinstance(default, int) else default / 2


def _unread_rules() -> list[Unread]:
    """An Unread rule for every option some algorithm does not read, except the ones a
    capability rule words better (round_seconds: a time budget; the islands options)."""
    worded = {"round_seconds", "islands", "island_seconds", "overlap_global", "outer_overlap"}
    names = dict.fromkeys(f for options in reversed(algorithm_options())
                          for f in options.model_fields)
    return [Unread(f) for f in names
            if f not in worded and not all(f in _options(n) for n in ALGORITHMS)]


def scorable(caps: Capabilities) -> bool:
    """Whether ``--score loss`` can judge the algorithm's updates: a whole pseudo-gradient
    against global parameters (not a fragment applied later, not a gradient or a DCT step)."""
    return caps.outer_optimizer and not caps.fragments


def _caps(name: str) -> Capabilities:
    return algorithm_class(name).capabilities


def able(test: Callable[[Capabilities], bool], sep: str = "/") -> str:
    """The algorithms whose capabilities pass ``test``, for a message ('diloco/local_sgd')."""
    return sep.join(n for n in ALGORITHMS if test(_caps(n)))


# --- features ---------------------------------------------------------------------------------
def _flag(name: str, example: Any, used: Callable[[Config], bool] | None = None,
          label: str | None = None) -> Feature:
    return Feature(label or name, used or (lambda c: getattr(c, name) != _default(c, name)),
                   {name: example})


def _default(cfg: Config, name: str) -> Any:
    """The default of field ``name`` of ``cfg``'s model (a run's config: flags left unset)."""
    return type(cfg).model_fields[name].default


def _command(label: str) -> Feature:
    """The command a scoped rule is checked by: always on where it is checked."""
    return Feature(label, lambda c: True)


def _backend(name: str) -> Feature:
    return Feature(f"backend={name}", lambda c: c.backend == name, {"backend": name})


ROUND_SECONDS = _flag("round_seconds", 5.0)
OUTER_OVERLAP = _flag("outer_overlap", "delayed")
GROUP_SIZE = _flag("group_size", 2)
ISLAND_OPTIONS = Feature("islands/island_seconds/overlap_global",
                         lambda c: bool(c.islands) or c.island_seconds is not None
                         or c.overlap_global, {"islands": "0,1|2,3"})
REPLICA_GROUPS = Feature("ranks_per_worker>1", lambda c: c.ranks_per_worker > 1,
                         {"ranks_per_worker": 2})
DDP_REPLICA_GROUPS = Feature("ranks_per_worker>1 with sharding=ddp",
                             lambda c: c.ranks_per_worker > 1 and c.sharding == "ddp",
                             {"ranks_per_worker": 2, "sharding": "ddp"})
PIPELINE = Feature("pipeline_stages>1", lambda c: c.pipeline_stages > 1, {"pipeline_stages": 2})
ONE_STAGE = Feature("pipeline_stages=1", lambda c: c.pipeline_stages == 1, {})
TOPOLOGY = _flag("topology", "0,1|2,3")
EMULATE_LINK = _flag("emulate_link", "datacenter")
LIGHTHOUSE = _flag("lighthouse", "127.0.0.1:29510")
CUDA_INDEX = Feature("device=cuda:N", lambda c: c.device.startswith("cuda:"),
                     {"device": "cuda:0"})
CODEC = _flag("codec", "int8")
FIXED_ROUNDS = Feature("round_seconds unset", lambda c: c.round_seconds is None, {})
ISLAND_SECONDS = _flag("island_seconds", 2.0)
SCORE = _flag("score", "loss", label="score=loss")


def _pipeline_refuses(name: str, feature: Feature, why: str) -> Pair:
    """A pipeline's stage peers lack ``name``: one wording for all of them."""
    return Pair(PIPELINE, feature, lambda c: f"pipeline_stages={c.pipeline_stages} does not run "
                f"with this {name} yet: {why}")


def _sharding_ddp_why(cfg: Config) -> str:
    caps = _caps(cfg.algorithm)
    if caps.fragments:
        return (f"{cfg.algorithm} applies a fragment's update steps after its round, which a "
                "DDP replica group's slices do not follow yet: use --sharding fsdp, or "
                f"{able(_ddp_replica_groups, ', ')}")
    if caps.inner_optimizer:  # ddp: the gradient itself is what crosses replica groups
        return ("ddp across replica groups exchanges each rank's gradient shard: run the "
                "replica groups with --sharding fsdp (a DDP replica group holds whole gradients)")
    return (f"{cfg.algorithm} on replica groups of several ranks runs on FSDP2 shards: use "
            "--sharding fsdp")


def _ddp_replica_groups(caps: Capabilities) -> bool:
    """A DDP replica group's rank syncs a 1/K slice of whole parameters after its inner steps: an
    algorithm whose round follows its own local steps (not every step's gradient or momentum,
    not fragments applied later)."""
    return not caps.fragments and not caps.syncs_every_step


def _own_codec(caps: Capabilities) -> bool:
    return caps.wire_codec is None


def _codec_why(cfg: Config) -> str:
    wire = _caps(cfg.algorithm).wire_codec
    if wire is not None and cfg.codec.strip().lower().startswith(wire):  # its own, but +ef
        return (f"{cfg.algorithm} keeps its own error feedback in the momentum; drop '+ef' "
                f"from --codec {cfg.codec}")
    if cfg.algorithm == "demo":
        return (f"demo sends DCT top-k coefficients; use --codec none (then "
                f"--demo-chunk/--demo-topk) or dct_topk[:CHUNK:K[:fp16]], not {cfg.codec}")
    return (f"{cfg.algorithm} sends its own {_caps(cfg.algorithm).wire_codec} values with its "
            f"own error feedback; drop --codec {cfg.codec}")


def _codec_not_own(cfg: Config) -> bool:
    """A codec the algorithm cannot send with: any but none for an algorithm with its own wire
    codec (demo also takes its own family, dct_topk, without +ef)."""
    wire = _caps(cfg.algorithm).wire_codec
    spec = cfg.codec.strip().lower()
    if spec == "none":
        return False
    return wire is None or not (spec.startswith(wire) and not spec.endswith("+ef"))


def _attack_rule(name: str, why: str) -> Pair:
    attack = Feature(f"attack={name}", lambda c: c.attack.split(":")[0] == name,
                     {"attack": name})
    return Pair(attack, _backend("torchft"), lambda c: f"attack {c.attack!r} does not apply to "
                f"the torchft backend: {why}")


# --- the table --------------------------------------------------------------------------------
RULES: list[Pair | Needs | Unread] = [
    # options of one kind given twice
    Pair(_flag("secret", "s3cret"), _flag("secret_file", "secret.txt"),
         lambda c: "give the run secret once: --secret or --secret-file, not both"),
    Pair(_flag("resume", True), _flag("overwrite", True),
         lambda c: "--resume continues the run in run_dir, --overwrite moves it aside to start "
         "afresh: give one of them"),
    Pair(TOPOLOGY, EMULATE_LINK,
         lambda c: "give either topology (per-pair links) or emulate_link (one link for every "
         "collective), not both"),
    # a hostile member's protocol attack needs the protocol it attacks
    *[_attack_rule(name, why) for name, why in NOT_ON_TORCHFT.items()],
    # what the algorithm can do
    Needs(ROUND_SECONDS, lambda caps: caps.time_budget,
          lambda c: f"round_seconds (time-budgeted rounds) applies to "
          f"{able(lambda caps: caps.time_budget)}, not {c.algorithm}"),
    Needs(OUTER_OVERLAP, lambda caps: caps.delayed_outer,
          lambda c: f"outer_overlap (the outer step one round late, its exchange overlapping "
          f"the next round's compute) applies to {able(lambda caps: caps.delayed_outer)}, not "
          f"{c.algorithm}"),
    Pair(Feature("outer_overlap=eager", lambda c: c.outer_overlap == "eager",
                 {"outer_overlap": "eager"}),
         Feature("a fragmented algorithm", lambda c: _caps(c.algorithm).fragments,
                 {"algorithm": "streaming_diloco"}),
         lambda c: f"{c.algorithm} keeps a fragment's local progress by mixing it into the "
         "delayed global fragment (mix_alpha), where eager would step with it: use "
         "outer_overlap=delayed (each fragment's update one period late)"),
    Pair(OUTER_OVERLAP, ROUND_SECONDS,
         lambda c: "outer_overlap does not run with round_seconds (time-budgeted rounds) yet: "
         "a time budget counts committed rounds, which land one round late with it; give "
         "inner_steps instead"),
    Needs(GROUP_SIZE, lambda caps: caps.partial_groups,
          lambda c: f"group_size (Moshpit groups smaller than the swarm) runs "
          f"{able(lambda caps: caps.partial_groups)}: {c.algorithm}'s groups would commit the "
          "same round with different states and never join them again. Drop --group-size "
          "(every round one group of all)"),
    *[Needs(_backend(backend), lambda caps, b=backend: b in caps.backends,
            lambda c: f"{c.algorithm} runs on the {' or '.join(_caps(c.algorithm).backends)} "
            f"backend, not {c.backend}") for backend in BACKENDS],
    Needs(_flag("codec", "int8", _codec_not_own, "codec (not the algorithm's own)"), _own_codec,
          _codec_why),
    Needs(_flag("inner", "muon"), lambda caps: caps.inner_optimizer,
          lambda c: f"{c.algorithm} steps with its own update rule, not an inner optimizer; "
          f"--inner {c.inner} applies to {able(lambda caps: caps.inner_optimizer)}"),
    Needs(ISLAND_OPTIONS, lambda caps: caps.islands,
          lambda c: "islands, island_seconds and overlap_global apply to "
          f"{able(lambda caps: caps.islands, ', ')} only"),
    Needs(LIGHTHOUSE, lambda caps: not caps.islands,
          lambda c: f"{c.algorithm} starts its own Lighthouses (global and one per island); "
          "drop --lighthouse"),
    Pair(ISLAND_SECONDS, FIXED_ROUNDS,
         lambda c: "island_seconds needs round_seconds (time-budgeted rounds)",
         extra={"algorithm": "hierarchical_diloco"}),
    # loss-scored contributions judge a whole pseudo-gradient against the global parameters
    Needs(SCORE, scorable,
          lambda c: f"--score loss applies a peer's pseudo-gradient to the global parameters "
          f"and measures the loss: {able(scorable)}, not {c.algorithm}; use --aggregator "
          "alone"),
    Pair(SCORE, REPLICA_GROUPS, lambda c: f"--score loss needs each peer's whole update; a "
         f"replica group of ranks_per_worker={c.ranks_per_worker} ranks exchanges shards: use "
         "--aggregator alone"),
    # the options of other algorithms
    *_unread_rules(),
    # replica groups: several ranks per replica
    Pair(REPLICA_GROUPS, TOPOLOGY, lambda c: (
        f"{c.algorithm} on replica groups of ranks_per_worker={c.ranks_per_worker} cannot take its "
        "islands from the emulated WAN (--topology): replica groups do not run inside it yet. "
        "Give the islands with --islands (e.g. '0,1|2') and drop --topology, or use "
        "ranks_per_worker=1"
        if _caps(c.algorithm).islands else "ranks_per_worker > 1 does not run inside the "
        "emulated WAN (--topology) yet; use --emulate-link for an in-process link")),
    Needs(REPLICA_GROUPS, lambda caps: caps.sharded,
          lambda c: f"ranks_per_worker={c.ranks_per_worker} shards the model (FSDP2) inside "
          f"each worker; {c.algorithm} cannot run on shards. Use one of "
          f"{able(lambda caps: caps.sharded, ', ')}, or ranks_per_worker=1"),
    Pair(REPLICA_GROUPS, _backend("inprocess"),
         lambda c: f"ranks_per_worker={c.ranks_per_worker} runs on the torchft backend (a "
         f"replica group of {c.ranks_per_worker} ranks) or on hivemind (the"
         " replica group one member of "
         f"each averaging group), not {c.backend}"),
    Needs(DDP_REPLICA_GROUPS, _ddp_replica_groups, _sharding_ddp_why),
    Pair(REPLICA_GROUPS, CUDA_INDEX,
         lambda c: f"device={c.device} with ranks_per_worker={c.ranks_per_worker} puts all "
         f"{c.ranks_per_worker} ranks of a replica group on one GPU (NCCL refuses that): give "
         "--device cuda (or auto), which puts rank r on cuda:LOCAL_RANK, and choose the GPUs with "
         "CUDA_VISIBLE_DEVICES"),
    # pipelines: the peers of a stage are the members of a collective in the trainer
    Pair(_flag("peers_per_stage", 2), ONE_STAGE,
         lambda c: "peers_per_stage applies to pipelines: give --pipeline-stages S (2 or more) "
         "too, or drop --peers-per-stage"),
    Needs(PIPELINE, lambda caps: caps.stage_averaging,
          lambda c: f"pipeline_stages={c.pipeline_stages}: the peers of a stage average with "
          f"the run's outer step every inner_steps, which {c.algorithm} does not provide yet; "
          f"use {able(lambda caps: caps.stage_averaging, ' or ')}"),
    _pipeline_refuses("ranks_per_worker", REPLICA_GROUPS, "a stage peer is one process; use "
                      "ranks_per_worker=1"),
    _pipeline_refuses("codec", CODEC, "a stage's peers are averaged inside the pipeline "
                      "trainer, which fetches and returns their weights in fp32, so a codec "
                      "would change the average but no byte on the wire; compress activations "
                      "with --activation-codec"),
    _pipeline_refuses("auth", _flag("auth", "secret"), "the trainer and its stage peers prove "
                      "the launcher's per-run token whatever --auth says, and a stage's "
                      "averaging runs inside the trainer's process, where signatures would "
                      "guard nothing; use --auth none"),
    _pipeline_refuses("attack", Feature("a protocol attack",
                                        lambda c: hostile.parse(c.attack) is not None,
                                        {"attack": "round_inflation", "attackers": "1"}),
                      "a stage's members are threads of the pipeline trainer, with no "
                      "transport of their own for a hostile member to abuse; emulate an "
                      "update attack (sign_flip, scale:X, ...) instead"),
    _pipeline_refuses("topology", TOPOLOGY, "a pipeline's replicas are not grouped in "
                      "islands; emulate one link for every stage peer with --emulate-link, or "
                      "links per peer with farlink bench pipeline and the namespace emulator"),
    _pipeline_refuses("hf_model", Feature("model=hf:DIR", lambda c: c.hf_model_dir is not None,
                                          {"model": "hf:model-dir"}),
                      "stages cut farlink's GPT presets"),
    _pipeline_refuses("outer_overlap", OUTER_OVERLAP, "a stage's peers average in rounds "
                      "the pipeline trainer runs and waits for between its steps; use "
                      "outer_overlap=none"),
    _pipeline_refuses("precision", _flag("precision", "bf16"), "stage peers compute in fp32"),
    _pipeline_refuses("device", Feature("device=cuda", lambda c: c.device.startswith("cuda"),
                                        {"device": "cuda"}), "stage peers compute on the CPU"),
    _pipeline_refuses("pace_seconds", _flag("pace_seconds", 0.5), "give --slowdown factors "
                      "(one per stage peer) instead"),
    _pipeline_refuses("lighthouse", LIGHTHOUSE, "joining a pipeline is not supported; farlink "
                      "train starts every stage peer itself"),
    # commands that start processes
    Pair(_command("farlink train"), _backend("inprocess"),
         lambda c: "backend inprocess is for library use (peers as threads of one process, "
         "farlink.Optimizer); farlink train starts processes: use --backend torchft or "
         "hivemind", scope="train"),
    Pair(_command("emulated namespaces"),
         Feature("backend other than torchft", lambda c: c.backend != "torchft",
                 {"backend": "hivemind"}),
         lambda c: "runs inside emulated namespaces use the torchft backend", scope="namespaces"),
    Pair(_command("emulated namespaces"), _flag("auth", "secret"),
         lambda c: "runs inside emulated namespaces have no membership gate in front of the "
         "router's Lighthouse; use --auth none there", scope="namespaces"),
    Pair(_command("emulated namespaces"),
         Feature("topology or an islands algorithm",
                 lambda c: bool(c.topology) or _caps(c.algorithm).islands,
                 {"topology": "0,1|2,3"}),
         lambda c: "--topology and hierarchical_diloco use in-process link emulation; they "
         "cannot run inside emulated namespaces", scope="namespaces"),
    Pair(_command("farlink swarm"),
         Feature("backend other than hivemind", lambda c: c.backend != "hivemind",
                 {"backend": "torchft"}),
         lambda c: f"a swarm trains on the hivemind backend; drop --backend {c.backend} (or "
         "backend in the config file)", scope="swarm"),
    Pair(_command("farlink swarm"),
         Feature("model=hf:DIR", lambda c: c.hf_model_dir is not None, {"model": "hf:model-dir"}),
         lambda c: f"a swarm serves preset models only (--model {c.model} is a directory on "
         "this machine); pick a preset", scope="swarm", extra={"backend": "hivemind"}),
    Pair(_command("farlink swarm"), REPLICA_GROUPS,
         lambda c: f"a swarm's volunteers are one process each; ranks_per_worker="
         f"{c.ranks_per_worker} is for replica groups that `farlink train` / `farlink join` start "
         "with torchrun (on the torchft or hivemind backend). Drop it", scope="swarm",
         extra={"backend": "hivemind"}),
]


def check(cfg: Config, scopes: Iterable[str] = ()) -> None:
    """Raise ValueError with the reason of the first refused pair ``cfg`` combines: rules of
    every configuration, and those of the commands in ``scopes``."""
    scopes = set(scopes)
    for rule in RULES:
        if (rule.scope is None or rule.scope in scopes) and rule.refuses(cfg):
            raise ValueError(rule.why(cfg))


def rows(config: type) -> list[Row]:
    """The whole matrix, one row per pair (capability rules: per algorithm); ``config`` is the
    run's config model (``RunConfig``), whose defaults the examples start from."""
    return [row for rule in RULES for row in rule.rows(config)]
