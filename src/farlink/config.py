"""The run configuration: one pydantic model, every field a CLI flag and a TOML key.

``RunConfig`` composes every algorithm's own options model (``farlink.sync``: each algorithm's
file declares its knobs) with the fields of the job around it (model, data, backend, trust,
bookkeeping). Rules that depend on the algorithm ask its capabilities, never its name.

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

from pydantic import (ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from farlink.errors import ConfigError as ConfigError  # where callers find it
from farlink.links import LinkError, get_profile, profile_names
from farlink.model.config import PRESETS
from farlink.sync import ALGORITHMS, algorithm_class, algorithm_options
from farlink.tomlfile import read_toml

HF_MODEL_PREFIX = "hf:"
_LINK_NAMES = ", ".join(profile_names())  # farlink/links.toml


LATEST_RUN = Path("runs/latest")  # the default run dir: a link to the newest run under runs/


class RunConfig(*algorithm_options()):
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
    codec: str = Field("none", description="none, fp16, bf16, int8, int4, topk[:f], ...[+ef]")
    aggregator: str = Field("mean", description="mean, median, trimmed_mean, centered_clip, ...")
    slowdown: str = Field("", description="emulated device speeds, per-worker slowdown factors "
                          "such as '1,1,2,4' (worker i sleeps (f-1) x its step time)")
    pace_seconds: float | None = Field(
        None, gt=0, description="emulated device speed, paced: every inner step of worker i is "
        "padded to slowdown_i x this many seconds (speeds stay exact while processes share "
        "cores; it must exceed the real step time)")

    # network heterogeneity: an emulated topology, and islands for hierarchical_diloco
    topology: str = Field(
        "", description="emulated network: worker groups such as '0,1|2,3'; links inside a "
        "group are --intra-link, between groups --inter-link (in-process emulation on loopback)")
    intra_link: str = Field("datacenter", description=f"link profile inside a topology group "
                            f"({_LINK_NAMES})")
    inter_link: str = Field("intercontinental", description=f"link profile between groups "
                            f"({_LINK_NAMES})")

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
    emulate_link: str | None = Field(
        None, description=f"in-process WAN emulation: a link profile ({_LINK_NAMES}) delays "
        "every collective by its hop latency + bytes/bandwidth")
    host: str = Field("127.0.0.1", description="address this worker advertises")
    round_timeout: float = Field(30.0, gt=0, description="floor of a collective's timeout (s)")
    join_timeout: float = Field(30.0, gt=0, description="Lighthouse: wait for stragglers (s)")
    heartbeat_timeout: float = Field(5.0, gt=0, description="Lighthouse: a silent peer is dead (s)")
    quorum_timeout: float = Field(120.0, gt=0, description="wait for a quorum (s)")
    auth: str = Field("none", description="none, secret (HMAC with the run secret) or ed25519")
    secret: str | None = Field(
        None, exclude=True, repr=False, description="run secret: every update is MACed with it "
        "(never saved; FARLINK_SECRET or --secret-file keep it out of `ps` too)")
    secret_file: Path | None = Field(
        None, exclude=True, description="file holding the run secret, readable by its owner "
        "only (chmod 600); never saved")
    key_file: Path | None = Field(None, description="ed25519: this peer's private key file")
    allowed_keys: Path | None = Field(None, description="ed25519: file/dir of members' keys")
    screen_ratio: float = Field(
        10.0, ge=0, description="reject an update whose norm exceeds this x the round's median "
        "(0 turns the screen off)")
    attack: str = Field("none", description="emulated attack of the --attackers: sign_flip, "
                        "scale:100, noise:STD, nan, free_rider[:stale]; or a hostile member's "
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

    ranks_per_worker: int = Field(
        1, ge=1, description="processes that train one worker's replica together (a site, "
        "started by torchrun): the model is sharded over them with FSDP2 (Gloo on CPU, NCCL on "
        "CUDA), each takes batch_size / K rows, and each syncs only its own shard across workers")

    sharding: Literal["fsdp", "ddp"] = Field(
        "fsdp", description="inside a site of several ranks: fsdp (each rank holds 1/K of the "
        "model, FSDP2) or ddp (each rank holds the whole replica, gradients averaged over the "
        "site; each rank syncs a 1/K slice across sites)")

    # pipelines (SWARM): the model cut into stages, each stage served by its own peer processes
    pipeline_stages: int = Field(
        1, ge=1, description="cut the model into S stages of contiguous blocks, each served by "
        "its own peer processes, micro-batches wired through them (1: every worker holds the "
        "whole model)")
    peers_per_stage: int | None = Field(
        None, ge=1, description="peers serving each pipeline stage, one per pipeline replica "
        "(default: workers / pipeline_stages; given alone, workers becomes stages x peers)")
    pipeline_micro_batches: int = Field(
        4, ge=1, description="micro-batches a pipeline splits each step's batch_size sequences "
        "into (1F1B: stages work on different micro-batches at once)")
    activation_codec: str = Field(
        "fp32", description="codec of the activations and their gradients between pipeline "
        "stages: fp32, fp16, int8, int4, topk:F")
    stage_peer_timeout: float = Field(
        120.0, gt=0, le=86400, allow_inf_nan=False, description="seconds a pipeline trainer "
        "waits for a stage peer's answer before that peer counts as failed and its stage's "
        "other peers take its work")

    # bookkeeping
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
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm {self.algorithm!r} unknown; choose from {', '.join(ALGORITHMS)}"
            )
        algorithm = algorithm_class(self.algorithm)
        caps = algorithm.capabilities
        from farlink.codecs import make_compressor
        from farlink.robust import hostile
        from farlink.robust.aggregators import make_aggregator
        from farlink.robust.attacks import make_attack

        make_compressor(self.codec)  # raises ValueError naming the valid codecs
        make_aggregator(self.aggregator)
        if hostile.parse(self.attack) is None:  # a protocol attack (a hostile member) or not
            make_attack(self.attack)
        elif (why := hostile.not_applicable(self.attack, self.backend)) is not None:
            raise ValueError(f"attack {self.attack!r} does not apply to the {self.backend} "
                             f"backend: {why}")
        self._check_attackers()
        if 0 < self.screen_ratio <= 1:
            raise ValueError(f"screen_ratio={self.screen_ratio:g} would reject honest updates; "
                             "use a value above 1, or 0 to turn the screen off")
        if self.auth not in ("none", "secret", "ed25519"):
            raise ValueError(f"auth {self.auth!r} unknown; choose none, secret or ed25519")
        if self.secret and self.secret_file:
            raise ValueError("give the run secret once: --secret or --secret-file, not both")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in run_dir, --overwrite moves it aside "
                             "to start afresh: give one of them")
        self._check_rounds(algorithm_class(self.algorithm))
        if self.min_replicas > self.workers and self.lighthouse is None:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds workers={self.workers}")
        if self.warmup_steps >= self.steps and self.steps > 1:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be below steps={self.steps}")
        if self.emulate_link is not None:
            get_profile(self.emulate_link)  # a LinkError (a ValueError) names the choices
        if self.slowdown:
            try:
                factors = [float(f) for f in self.slowdown.split(",")]
            except ValueError:
                raise ValueError(f"slowdown {self.slowdown!r} is not a comma list of numbers")
            if any(f < 1 for f in factors):
                raise ValueError("slowdown factors must be >= 1 (1 = full speed)")
        if self.round_seconds is not None and not caps.time_budget:
            timed = [n for n in ALGORITHMS if algorithm_class(n).capabilities.time_budget]
            raise ValueError(f"round_seconds (time-budgeted rounds) applies to "
                             f"{'/'.join(timed)}, not {self.algorithm}")
        if self.group_size is not None and not caps.partial_groups:
            mixing = [n for n in ALGORITHMS if algorithm_class(n).capabilities.partial_groups]
            raise ValueError(
                f"group_size (Moshpit groups smaller than the swarm) runs {'/'.join(mixing)}: "
                f"{self.algorithm}'s groups would commit the same round with different states "
                "and never join them again. Drop --group-size (every round one group of all)")
        if self.backend not in caps.backends:
            raise ValueError(f"{self.algorithm} runs on the {' or '.join(caps.backends)} "
                             f"backend, not {self.backend}")
        self._check_network(caps.islands)
        self._check_sites(caps.sharded)
        self._check_pipeline(caps.stage_averaging)
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

    def _check_sites(self, sharded: bool) -> None:
        """Several ranks per worker: an elementwise algorithm on torchft or hivemind, a batch
        they split, one GPU per rank; islands forced or measured, not from the emulated WAN."""
        k = self.ranks_per_worker
        if k == 1:
            return
        if algorithm_class(self.algorithm).capabilities.islands and self.topology:
            raise ValueError(
                f"{self.algorithm} on sites of ranks_per_worker={k} cannot take its islands "
                f"from the emulated WAN (--topology): sites do not run inside it yet. Give the "
                f"islands with --islands (e.g. '0,1|2') and drop --topology, or use "
                f"ranks_per_worker=1")
        if not sharded:
            able = [n for n in ALGORITHMS if algorithm_class(n).capabilities.sharded]
            raise ValueError(f"ranks_per_worker={k} shards the model (FSDP2) inside each "
                             f"worker; {self.algorithm} cannot run on shards. Use one of "
                             f"{', '.join(able)}, or ranks_per_worker=1")
        if self.backend not in ("torchft", "hivemind"):
            raise ValueError(f"ranks_per_worker={k} runs on the torchft backend (a replica "
                             f"group of {k} ranks) or on hivemind (the site one member of "
                             f"each averaging group), not {self.backend}")
        if self.sharding == "ddp" and algorithm_class(self.algorithm).capabilities.fragments:
            raise ValueError(f"{self.algorithm} applies a fragment's update steps after its "
                             "round, which a DDP site's slices do not follow yet: use "
                             "--sharding fsdp, or diloco, local_sgd or sparseloco")
        if self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device} with ranks_per_worker={k} puts all {k} ranks "
                             "of a site on one GPU (NCCL refuses that): give --device cuda (or "
                             "auto), which puts rank r on cuda:LOCAL_RANK, and choose the GPUs "
                             "with CUDA_VISIBLE_DEVICES")
        if self.batch_size % k:
            raise ValueError(f"batch_size={self.batch_size} does not split over "
                             f"ranks_per_worker={k}: give a multiple of {k}")
        if self.topology:
            raise ValueError("ranks_per_worker > 1 does not run inside the emulated WAN "
                             "(--topology) yet; use --emulate-link for an in-process link")

    @property
    def pipeline_peers_per_stage(self) -> int:
        """Peers of each stage (= pipeline replicas) of a pipelined run."""
        return self.peers_per_stage or self.workers // self.pipeline_stages

    def _check_pipeline(self, stage_averaging: bool) -> None:
        """A pipelined run: a shape that divides, an outer step that can average a stage's
        peers, and nothing that needs a worker process holding the whole model."""
        stages = self.pipeline_stages
        if stages == 1:
            if self.peers_per_stage is not None:
                raise ValueError("peers_per_stage applies to pipelines: give --pipeline-stages "
                                 "S (2 or more) too, or drop --peers-per-stage")
            return
        from farlink.parallel.wire import codec_for

        try:
            codec_for(self.activation_codec)
        except ValueError as exc:
            raise ValueError(f"activation_codec: {exc}") from None
        if self.peers_per_stage is None and self.workers % stages:
            raise ValueError(f"workers={self.workers} does not split into {stages} pipeline "
                             f"stages: give a multiple of {stages}, or --peers-per-stage P "
                             f"(then workers = {stages} x P)")
        if self.peers_per_stage is not None and self.workers != stages * self.peers_per_stage:
            raise ValueError(f"workers={self.workers} but {stages} stages x peers_per_stage="
                             f"{self.peers_per_stage} is {stages * self.peers_per_stage}: give "
                             "one of --workers and --peers-per-stage")
        if not stage_averaging:
            able = [n for n in ALGORITHMS if algorithm_class(n).capabilities.stage_averaging]
            raise ValueError(f"pipeline_stages={stages}: the peers of a stage average with the "
                             f"run's outer step every inner_steps, which {self.algorithm} does "
                             f"not provide yet; use {' or '.join(able)}")
        if self.pipeline_micro_batches > self.batch_size or \
                self.batch_size % self.pipeline_micro_batches:
            raise ValueError(f"batch_size={self.batch_size} does not split into "
                             f"pipeline_micro_batches={self.pipeline_micro_batches} equal "
                             "micro-batches: give a batch_size that is a multiple of it")
        refused = {
            "ranks_per_worker": (self.ranks_per_worker > 1, "a stage peer is one process; "
                                 "use ranks_per_worker=1"),
            "grad_accum": (self.grad_accum > 1, "a pipeline accumulates over its micro-batches; "
                           "raise batch_size and pipeline_micro_batches instead"),
            "codec": (self.codec != "none", "a stage's peers are averaged in fp32 by the "
                      "pipeline trainer; compress activations with --activation-codec"),
            "auth": (self.auth != "none", "stage peers listen on loopback for the trainer "
                     "that started them and do not authenticate it yet; use --auth none"),
            "attackers": (bool(self.attackers), "robust aggregation of stage peers is not "
                          "implemented"),
            "topology": (bool(self.topology) or self.emulate_link is not None,
                         "emulated links of stage peers are set by farlink bench pipeline and "
                         "the namespace emulator, not by --topology / --emulate-link yet"),
            "hf_model": (self.hf_model_dir is not None, "stages cut farlink's GPT presets"),
            "precision": (self.precision != "fp32", "stage peers compute in fp32"),
            "device": (self.device.startswith("cuda"), "stage peers compute on the CPU"),
            "pace_seconds": (self.pace_seconds is not None, "give --slowdown factors (one per "
                             "stage peer) instead"),
            "round_seconds": (self.round_seconds is not None, "a pipeline's stage averages "
                              "every inner_steps steps"),
            "lighthouse": (self.lighthouse is not None, "joining a pipeline is not supported; "
                           "farlink train starts every stage peer itself"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"pipeline_stages={stages} does not run with this {name} yet: "
                                 f"{why}")

    def _check_network(self, islands: bool) -> None:
        """Topology, islands and the hierarchical schedule (see farlink.comm.islands)."""
        from farlink.comm.islands import parse_islands
        for name in ("topology", "islands"):
            if getattr(self, name):
                parse_islands(getattr(self, name), self.workers, name)  # ValueError says why
        for name in ("intra_link", "inter_link"):
            try:
                get_profile(getattr(self, name))
            except LinkError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if self.topology and self.emulate_link is not None:
            raise ValueError("give either topology (per-pair links) or emulate_link (one link "
                             "for every collective), not both")
        if not islands and (self.islands or self.island_seconds is not None
                            or self.overlap_global):
            tiered = [n for n in ALGORITHMS if algorithm_class(n).capabilities.islands]
            raise ValueError("islands, island_seconds and overlap_global apply to "
                             f"{', '.join(tiered)} only")

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
        values = values.get("train", values)
        values = {k: v for k, v in values.items() if k not in set(ignore)}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return RunConfig.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None


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
