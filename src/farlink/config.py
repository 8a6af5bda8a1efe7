"""The run configuration: one pydantic model, every field a CLI flag and a TOML key.

``RunConfig`` composes the components' own configs, each next to what it configures and checking
its own values: every algorithm's options (``farlink.sync``: each algorithm's file declares its
knobs), the exchange's (``ExchangeOptions``), trust's (``TrustOptions``), a replica group's
(``ReplicaGroupOptions``), a pipeline's (``PipelineOptions``), the emulation's
(``EmulationOptions``) and the run dir's (:class:`RunDirOptions`), with the fields of the job
around them (model, data, transport). Their fields stay flat (flags, TOML keys, ``cfg.codec``);
:data:`COMPONENTS` and :data:`SECTION_OF` give the tree (``[exchange]`` tables in a config file,
:meth:`RunConfig.tree`).

What does not run together is one table, :mod:`farlink.matrix` (``farlink matrix`` prints it):
validation raises every such refusal from there. Rules that depend on the algorithm ask its
capabilities, never its name; an option of another algorithm given a value is refused.

Precedence: built-in defaults < ``--config FILE.toml`` < explicit flags. Validation happens once,
here, so a bad value fails before any process starts, with the field's name in the message.

A few fields belong to one invocation, not to the run (``Field(exclude=True)``): ``--resume``,
``--overwrite``, ``--stop-at-step`` and the secret's sources. They are never saved in the run's
``config.toml``/``config.json``, so a saved config neither holds a secret nor makes a later
``--resume`` stop again where an earlier invocation was told to stop.
"""

from __future__ import annotations

import math
from pathlib import Path
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from farlink import matrix
from farlink.emulate.pairwise import EmulationOptions
from farlink.errors import ConfigError as ConfigError  # where callers find it
from farlink.model.config import PRESETS
from farlink.parallel.pipeline import PipelineOptions
from farlink.parallel.sharding import ReplicaGroupOptions
from farlink.robust.auth import TrustOptions
from farlink.sync import ALGORITHMS, algorithm_class, algorithm_options
from farlink.sync.exchange import ExchangeOptions
from farlink.tomlfile import read_toml

HF_MODEL_PREFIX = "hf:"


LATEST_RUN = Path("runs/latest")  # the default run dir: a link to the newest run under runs/


class RunDirOptions(BaseModel):
    """Where a run keeps what it writes and how often; ``--resume``, ``--overwrite`` and
    ``--stop-at-step`` belong to one invocation and are never saved."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run_dir: Path = Field(LATEST_RUN, description="metrics, checkpoints, final model (default: "
                          "a new runs/<time> dir, linked as runs/latest)")
    cache_dir: Path = Field(Path.home() / ".cache" / "farlink", description="tokenizer/data cache")
    eval_every: int = Field(1, ge=1, description="evaluate every N outer steps")
    eval_batches: int = Field(16, ge=1, description="held-out batches per evaluation")
    checkpoint_every: int = Field(1, ge=1, description="checkpoint every N outer steps")
    stop_at_step: int | None = Field(
        None, ge=1, exclude=True,
        description="stop cleanly after this inner step, as a preemption would (this "
        "invocation only)")
    resume: bool = Field(False, exclude=True, description="continue from the run dir's checkpoints")
    overwrite: bool = Field(
        False, exclude=True, description="start afresh in a run dir that holds a run: the old "
        "one is moved aside to DIR.old-<time>, never deleted")
    log_every: int = Field(10, ge=1, description="inner steps between metric lines")
    log_to: str = Field("", description="also send the metrics to tensorboard, wandb or both "
                        "(comma-separated; farlink[metrics]): RUN_DIR/tensorboard/wK, a W&B "
                        "run per worker (WANDB_MODE=offline keeps it in RUN_DIR/wandb)")

    @field_validator("log_to")
    @classmethod
    def _known_sinks(cls, value: str) -> str:
        from farlink.loggers import parse_spec

        return ",".join(parse_spec(value))


#: The components a run's config composes, each a config that lives next to what it configures
#: and checks its own values: the section a field is in, in TOML (``[exchange] codec = ...``)
#: and in :meth:`RunConfig.tree`. Fields of none of them (the model, the data, the transport)
#: are the run's own, at the top.
COMPONENTS: dict[str, tuple[type[BaseModel], ...]] = {
    "sync": algorithm_options(),
    "exchange": (ExchangeOptions,),
    "trust": (TrustOptions,),
    "replica_group": (ReplicaGroupOptions,),
    "pipeline": (PipelineOptions,),
    "emulation": (EmulationOptions,),
    "rundir": (RunDirOptions,),
}
#: flat field name -> its component's section (generated: the flat flags and TOML keys alias
#: the tree's leaves)
SECTION_OF: dict[str, str] = {name: section for section, models in COMPONENTS.items()
                              for model in models for name in model.model_fields}
#: a section's earlier name -> its name now: config files written before a rename still load
RENAMED_SECTIONS: dict[str, str] = {"site": "replica_group"}


class RunConfig(RunDirOptions, EmulationOptions, PipelineOptions, ReplicaGroupOptions, TrustOptions,
                ExchangeOptions, *algorithm_options()):
    """The run's configuration: the components' configs composed (their fields flat, as flags
    and TOML keys; :meth:`tree` and :meth:`component` give them back by component) and the
    fields of the job around them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # what to train
    model: str = Field("tiny", description=f"model preset ({', '.join(PRESETS)}), or "
                       f"{HF_MODEL_PREFIX}DIR: a local transformers model directory (its "
                       "config.json; its weights too if it has them)")
    tokenizer: str | None = Field(
        None, description="a tokenizer.json or Hugging Face tokenizer directory to use instead "
        "of training a BPE (default: the hf:DIR model's own tokenizer.json if it has one)")
    corpus: str = Field("kjv", description="'kjv' (shipped), a .txt file/dir, or hf:PATH#column")
    vocab_size: int = Field(4096, ge=260, description="BPE vocabulary size (a given tokenizer "
                            "brings its own)")
    seq_len: int = Field(128, ge=8, description="tokens per sequence")
    batch_size: int = Field(8, ge=1, description="sequences per micro-batch per worker (an "
                            "inner step takes --grad-accum of them)")
    grad_accum: int = Field(1, ge=1, description="micro-batches per inner step: their gradients "
                            "add up, so an inner step sees grad_accum x batch_size sequences "
                            "whatever fits in the device's memory")
    steps: int = Field(500, ge=1, description="inner steps per worker (the token budget)")
    seed: int = Field(0, description="seed for init and data order")

    # how to synchronize (each algorithm's own knobs come from its options model)
    algorithm: str = Field("diloco", description=", ".join(ALGORITHMS))

    # where and with whom
    workers: int = Field(4, ge=1, description="local worker processes to launch")
    backend: Literal["torchft", "hivemind", "inprocess"] = Field(
        "torchft", description="torchft (organizational), hivemind (community, DHT), or "
        "inprocess (peers as threads of one process: a single worker, or library use)")
    initial_peers: str = Field("", description="hivemind: comma list of multiaddrs to join")
    group_size: int | None = Field(
        None, ge=2, description="hivemind: Moshpit group size per round (default: --workers, everyone; a "
        "full group starts its round without waiting out the matchmaking window)")
    min_replicas: int = Field(
        1, ge=1, description="fewest peers a round may commit with (a hivemind swarm that "
        "farlink train starts itself: all --workers unless given)")
    lighthouse: str | None = Field(None, description="join this Lighthouse instead of starting one")
    host: str = Field("127.0.0.1", description="address this worker advertises")
    round_timeout: float = Field(30.0, gt=0, description="floor of a collective's timeout (s)")
    join_timeout: float = Field(30.0, gt=0, description="Lighthouse: wait for stragglers (s)")
    heartbeat_timeout: float = Field(5.0, gt=0, description="Lighthouse: a silent peer is dead (s)")
    quorum_timeout: float = Field(120.0, gt=0, description="wait for a quorum (s)")
    attack: str = Field("none", description="emulated attack of the --attackers: sign_flip, "
                        "scale:100, noise:STD, nan, free_rider[:stale], alie:Z, ipm:EPS, "
                        "copycat, inflate:K; or a hostile member's "
                        "protocol attack: round_inflation[:nan], weight_inflation[:X], "
                        "slot_forging, equivocation, bad_metadata, always_no "
                        "(farlink.robust.hostile)")
    attackers: str = Field("", description="comma list of worker indices that attack (emulation)")
    threads: int = Field(1, ge=1, description="torch threads per worker")
    device: str = Field(
        "auto", description="where a worker computes: auto (CUDA when present, else CPU), cpu, "
        "cuda (worker i on GPU i mod the GPUs present) or cuda:N")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="fp32, or bf16: forward and backward under bf16 autocast (weights, "
        "optimizer states and pseudo-gradients stay fp32)")

    @field_validator("*", mode="before")
    @classmethod
    def _finite(cls, value: Any, info: ValidationInfo) -> Any:
        """Every float option is a finite number: ``inf`` passes a ``gt=0`` bound, is saved
        as ``null`` and then fails every worker that reads the run's config back. Checked
        before the bounds, so that the message names the flag whatever the bound."""
        if isinstance(value, float) and not math.isfinite(value):
            flag = "--" + (info.field_name or "").replace("_", "-")
            raise ValueError(f"{value} is not a finite number; give {flag} a finite value")
        return value

    @model_validator(mode="before")
    @classmethod
    def _local_swarm_averages_everyone(cls, values: Any) -> Any:
        """A hivemind swarm that ``farlink train`` starts itself knows all its peers, so its
        rounds wait for all of them. With a group of one allowed, each peer reaches matchmaking
        at its own moment, finds itself alone and "averages" with itself: N independent models.
        A torchft Lighthouse instead waits ``join_timeout`` for every peer that heartbeats, so
        there ``min_replicas`` 1 only keeps the run elastic. Replicas started through the API
        (``farlink.Optimizer``) give ``workers`` (or ``min_replicas``) themselves: the number of
        replicas they start, not the default of 4 launched workers."""
        if not isinstance(values, dict) or values.get("min_replicas") is not None:
            return values
        local = not values.get("initial_peers") and values.get("lighthouse") is None
        if values.get("backend") == "hivemind" and local:
            values = {**values,
                      "min_replicas": values.get("workers", cls.model_fields["workers"].default)}
        return values

    @model_validator(mode="before")
    @classmethod
    def _open_members_are_judged(cls, values: Any) -> Any:
        """A run whose members are not all trusted (``members = "open"``: ``farlink swarm``'s
        default) aggregates with a robust rule and scores every contribution by its loss drop,
        unless it names its rule or scoring itself (scoring where the algorithm's updates can be
        scored, :func:`farlink.matrix.scorable`, on one rank per worker); trusted replicas keep
        the plain mean."""
        if isinstance(values, dict) and values.get("members") == "open":
            from farlink.robust.auth import OPEN_DEFAULTS

            name = values.get("algorithm") or cls.model_fields["algorithm"].default
            ranks = values.get("ranks_per_worker") or 1
            defaults = dict(OPEN_DEFAULTS)
            if (name not in ALGORITHMS or int(ranks) > 1
                    or not matrix.scorable(algorithm_class(name).capabilities)):
                defaults["score"] = "none"  # the robust rule alone
            values = {**values, **{k: v for k, v in defaults.items() if values.get(k) is None}}
        return values

    @model_validator(mode="before")
    @classmethod
    def _workers_of_pipelines(cls, values: Any) -> Any:
        """``--pipeline-stages S --peers-per-stage P`` without ``--workers`` means S x P peers:
        the user said how many peers each stage has, so the total is not asked again."""
        if (isinstance(values, dict) and values.get("peers_per_stage") is not None
                and values.get("workers") is None):
            stages = values.get("pipeline_stages") or 1
            values = {**values, "workers": int(stages) * int(values["peers_per_stage"])}
        return values

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        """Each value on its own first (each component checked its own), then the pairs of
        features that do not run together (one table, :mod:`farlink.matrix`), then the sizes
        that must fit each other."""
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm {self.algorithm!r} unknown; choose from {', '.join(ALGORITHMS)}"
            )
        algorithm = algorithm_class(self.algorithm)
        from farlink.robust import hostile
        from farlink.robust.attacks import make_attack

        if hostile.parse(self.attack) is None:  # a protocol attack (a hostile member) or not
            make_attack(self.attack)
        self._check_attackers()
        self._check_network()
        matrix.check(self)
        self._check_rounds(algorithm)
        if self.min_replicas > self.workers and self.lighthouse is None:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds workers={self.workers}")
        if self.warmup_steps >= self.steps and self.steps > 1:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be below steps={self.steps}")
        if self.ranks_per_worker > 1 and self.batch_size % self.ranks_per_worker:
            raise ValueError(f"batch_size={self.batch_size} does not split over "
                             f"ranks_per_worker={self.ranks_per_worker}: give a multiple of "
                             f"{self.ranks_per_worker}")
        self._check_pipeline()
        algorithm.check_run(self)
        return self

    @model_validator(mode="after")
    def _check_inputs(self, info: ValidationInfo) -> RunConfig:
        """A preset, or a transformers directory; a given tokenizer exists; the extras the run
        needs (``hf`` for hf:DIR, ``community`` for hivemind) are installed. A stored run config
        (``context={"stored": True}``: read back to report on a run) is not checked against
        this machine's files and packages; only a run about to start is."""
        from farlink.extras import require

        directory = self.hf_model_dir
        if directory is None and self.model not in PRESETS:
            raise ValueError(f"model {self.model!r} unknown; choose a preset "
                             f"({', '.join(PRESETS)}) or {HF_MODEL_PREFIX}DIR")
        if (info.context or {}).get("stored"):
            return self
        if directory is not None:
            if not (directory / "config.json").is_file():
                raise ValueError(f"model {self.model!r}: {directory} has no config.json; give a "
                                 "directory written by a transformers model's save_pretrained()")
            require("transformers", f"--model {self.model}")
        from farlink.train.compute import check_device

        check_device(self.device)  # ValueError naming what this machine has instead
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise ValueError(f"tokenizer {self.tokenizer!r} does not exist; give a "
                             "tokenizer.json file or a Hugging Face tokenizer directory")
        if self.backend == "hivemind":
            require("hivemind", "--backend hivemind (community mode)")
        return self

    def tree(self) -> dict[str, Any]:
        """The settings as a tree: the run's own fields at the top, each component's in its
        section (``{"exchange": {"codec": ...}, ...}``), as ``[exchange]`` tables in TOML."""
        values = self.model_dump()
        tree: dict[str, Any] = {n: v for n, v in values.items() if n not in SECTION_OF}
        for section in COMPONENTS:
            tree[section] = {n: v for n, v in values.items() if SECTION_OF.get(n) == section}
        return tree

    def component(self, section: str) -> BaseModel:
        """One component's config, on its own (``cfg.component("exchange")`` is the
        :class:`~farlink.sync.exchange.ExchangeOptions` an Exchange is built from); ``sync``
        gives the chosen algorithm's ``Options``."""
        if section == "sync":
            model = algorithm_class(self.algorithm).Options
        else:
            (model,) = COMPONENTS[section]
        return model.model_validate({n: getattr(self, n) for n in model.model_fields})

    @property
    def hf_model_dir(self) -> Path | None:
        """The transformers model directory of ``--model hf:DIR``, or None for a preset."""
        if self.model.startswith(HF_MODEL_PREFIX):
            return Path(self.model[len(HF_MODEL_PREFIX):])
        return None

    @property
    def given_tokenizer(self) -> Path | None:
        """The tokenizer a run uses instead of training a BPE: ``--tokenizer``, else the
        ``hf:DIR`` model's own ``tokenizer.json`` (its weights were trained with those ids)."""
        if self.tokenizer is not None:
            return Path(self.tokenizer)
        directory = self.hf_model_dir
        if directory is not None and (directory / "tokenizer.json").is_file():
            return directory
        return None

    def _check_rounds(self, algorithm: type) -> None:
        """An algorithm that syncs every H inner steps needs at least one round: with
        steps < inner_steps no worker ever syncs and each ends on its own model."""
        if algorithm.capabilities.syncs_every_step or self.round_seconds is not None:
            return  # ddp/demo sync each step; a time budget always runs its rounds
        if self.steps < self.inner_steps:
            raise ValueError(f"steps={self.steps} is below inner_steps={self.inner_steps}: "
                             f"{self.algorithm} would never sync (0 outer rounds); give "
                             f"--steps of at least --inner-steps, or a smaller --inner-steps")

    @property
    def pipeline_peers_per_stage(self) -> int:
        """Peers of each stage (= pipeline replicas) of a pipelined run."""
        return self.peers_per_stage or self.workers // self.pipeline_stages

    def _check_pipeline(self) -> None:
        """A pipelined run: a shape that divides (what does not run with pipelines is in
        :mod:`farlink.matrix`; the activation codec checks itself)."""
        stages = self.pipeline_stages
        if stages == 1:
            return
        if self.peers_per_stage is None and self.workers % stages:
            raise ValueError(f"workers={self.workers} does not split into {stages} pipeline "
                             f"stages: give a multiple of {stages}, or --peers-per-stage P "
                             f"(then workers = {stages} x P)")
        if self.peers_per_stage is not None and self.workers != stages * self.peers_per_stage:
            raise ValueError(f"workers={self.workers} but {stages} stages x peers_per_stage="
                             f"{self.peers_per_stage} is {stages * self.peers_per_stage}: give "
                             "one of --workers and --peers-per-stage")
        if self.pipeline_micro_batches > self.batch_size or \
                self.batch_size % self.pipeline_micro_batches:
            raise ValueError(f"batch_size={self.batch_size} does not split into "
                             f"pipeline_micro_batches={self.pipeline_micro_batches} equal "
                             "micro-batches: give a batch_size that is a multiple of it")

    def _check_network(self) -> None:
        """Topology and islands name every worker once (see farlink.comm.islands)."""
        from farlink.comm.islands import parse_islands
        for name in ("topology", "islands"):
            if getattr(self, name):
                parse_islands(getattr(self, name), self.workers, name)  # ValueError says why

    def _check_attackers(self) -> None:
        """Attackers are indices of the run's workers; one that names no worker would leave
        the emulated attack out and the run would look robust against an attack never made.
        A run whose workers join elsewhere (a Lighthouse, a swarm) may use any index."""
        indices = [a.strip() for a in self.attackers.split(",") if a.strip()]
        if bad := [a for a in indices if not a.isdigit()]:
            raise ValueError(f"--attackers {self.attackers}: {', '.join(bad)} is not a worker "
                             "index; give a comma list of indices such as '0,2'")
        launched = self.lighthouse is None and not self.initial_peers
        if launched and (outside := [a for a in indices if int(a) >= self.workers]):
            raise ValueError(f"--attackers {self.attackers}: {', '.join(outside)} is not one of "
                             f"the {self.workers} workers (indices 0 to {self.workers - 1}): "
                             f"give indices below {self.workers}, or raise --workers")

    def is_attacker(self, index: int) -> bool:
        return str(index) in {a.strip() for a in self.attackers.split(",") if a.strip()}

    def slowdown_of(self, index: int) -> float:
        """Emulated slowdown of worker ``index`` (cycled when fewer factors than workers)."""
        if not self.slowdown:
            return 1.0
        factors = [float(f) for f in self.slowdown.split(",")]
        return factors[index % len(factors)]

    @property
    def tokens_per_step(self) -> int:
        """Tokens one worker trains on per inner step: grad_accum x batch_size x seq_len."""
        return self.grad_accum * self.batch_size * self.seq_len

    @property
    def sync_every(self) -> int:
        """Inner steps per outer round (1 for algorithms that sync every step)."""
        return 1 if algorithm_class(self.algorithm).capabilities.syncs_every_step \
            else self.inner_steps


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None,
                ignore: Iterable[str] = ()) -> RunConfig:
    """Defaults < TOML file < overrides (flags left unset are ``None`` and ignored); keys of
    the file named in ``ignore`` are dropped."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        values.update(read_toml(path, ConfigError, "config file "))
        values = flatten(values.get("train", values), path)
        values = {k: v for k, v in values.items() if k not in set(ignore)}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return RunConfig.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None


def flatten(values: dict[str, Any], path: Path | str = "config") -> dict[str, Any]:
    """A config file's keys as flat fields: flat keys as they are (every config.toml a run
    wrote), a component's section (``[exchange]``, ``[train.exchange]``) as its fields, a section
    under its earlier name (:data:`RENAMED_SECTIONS`) as the one it became. A key in the wrong
    section, or given both flat and in its section, is refused."""
    flat = {k: v for k, v in values.items() if not isinstance(v, dict)}
    for section, table in values.items():
        if not isinstance(table, dict):
            continue
        section = RENAMED_SECTIONS.get(section, section)
        if section not in COMPONENTS:
            raise ConfigError(f"config file {path}: [{section}] is not a section; the sections "
                              f"are {', '.join(COMPONENTS)} (or give the keys flat)")
        for key, value in table.items():
            if SECTION_OF.get(key) != section:
                where = (f"it belongs in [{SECTION_OF[key]}]" if key in SECTION_OF
                         else "it is a top-level key" if key in RunConfig.model_fields
                         else "no such setting")
                raise ConfigError(f"config file {path}: [{section}] has no key {key!r}: {where}")
            if key in flat:
                raise ConfigError(f"config file {path}: {key} is given twice, flat and in "
                                  f"[{section}]; give it once")
            flat[key] = value
    return flat


def load_stored_config(run_dir: Path) -> RunConfig:
    """A run directory's ``config.json`` as the run wrote it, for reading the run's results:
    the paths in it belong to where the run started, so they are not checked here."""
    path = Path(run_dir) / "config.json"
    return RunConfig.model_validate_json(path.read_text(), context={"stored": True})


def to_toml_dict(cfg: RunConfig) -> dict[str, Any]:
    """The run's saved settings (invocation-only fields and the secret left out)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.model_dump().items()
            if v is not None}


INVOCATION_FIELDS = frozenset(n for n, f in RunConfig.model_fields.items() if f.exclude)
