"""The planner's cost model: how long an outer round takes, how busy the GPUs are, what it costs.

Why a model: the scales that matter (10B parameters, 14 nodes on three continents) cannot run on
one machine, but every farlink algorithm is a fixed schedule of inner steps and collectives, so
its round time follows from a few measurable quantities. The same function serves both uses:
:func:`predict_round` takes *measured* inputs from a small real run (inner-step seconds, payload
bytes, link rate) so predictions can be validated against the emulator, and :func:`plan` derives
those inputs from hardware and link tables for runs no one can afford to try first.

Compute. One inner step on one worker takes ``6 N T / (F * mfu * g)`` seconds: N parameters,
T tokens per worker per step, F the GPU's dense bf16 FLOP/s, g GPUs per worker (the 6N rule:
2N FLOPs per token forward, 4N backward).

Communication (see :mod:`farlink.plan.network` for the collectives). The payload S is the
codec's bytes per parameter times N (:mod:`farlink.plan.payload`). How it travels follows
farlink's exchange: dense codecs (fp32, fp16, bf16, int8, int4) are all-reduced, fp32 summed
on the wire and the others by the compressed all-reduce (:mod:`farlink.sync.allreduce`: encoded
shards to their owners and the re-encoded aggregates back, ``2 (n-1)/n`` payloads per worker
as a ring all-reduce sends, INTELLECT-1's int8 ring); sparse payloads (top-k, DeMo, SparseLoCo)
are gathered, because their union does not shrink, so each worker sends its payload n-1 times,
and then the digests of what it received (a second, small all-gather that checks no member sent
different bytes to different members).
``exchange="gather"`` models today's gathered path for any codec. Every sync on torchft first asks the Lighthouse for a quorum
(one round trip to it, ``coordinator_rtt_s``; by default the one-way path latency, i.e. a
Lighthouse half-way between workers) and then gathers every member's heal announcement (step and
state fingerprint: :func:`farlink.plan.network.heal_check`, ``2 (n-1)`` Gloo hops), and ``local_seconds`` adds the worker's own per-sync work
(encoding, decoding, validation, outer step), which a run measures and which is small on GPUs.
Per algorithm, as farlink runs it:

- ``ddp``: exchange of the gradients every step, blocking.              round = 1 step
- ``local_sgd`` / ``diloco``: exchange of the averaged parameters / pseudo-gradient every H
  steps, blocking (the outer optimizer step itself is negligible).        round = H steps
- ``streaming_diloco``: the parameters are split in P fragments; one fragment (S/P) is
  all-reduced every H/P steps, and its outer update is applied tau steps later, so the transfer
  overlaps tau inner steps: exposed = max(0, c_frag - tau * step). The link cannot carry more than
  one round's worth of fragments per round, so round = max(H*step + P*exposed, P*c_frag).
- ``demo``: all-gather of every worker's DCT top-k payload every step, blocking.

Variability (:mod:`farlink.plan.variability`). Synchronous rounds wait for the slowest worker:
compute per round is multiplied by E[max of n lognormal speed multipliers] (mean 1, log-sd
sigma). A link profile with a bandwidth range paces each collective at its slowest link. Jitter is
added to the per-hop latency, and packet loss caps throughput at one TCP flow's Mathis bound.
Churn (Poisson failures per worker-hour) removes the share of worker-time lost to partial rounds,
rejoins and retried exchanges.

Utilization = (mean worker's compute per round) / (round wall-clock) x churn survival. The
bandwidth that reaches a target utilization (95% by default) is found by bisection on the nominal
link rate (a bandwidth range keeps its min/max ratio), because stragglers, churn and overlap make
the inverse piecewise; for a plain blocking all-reduce it equals the closed form
``B = 8 * bytes_sent / (C*(1/u - 1) - latency_terms)``, which the tests check.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from farlink.plan.network import (
    BACKENDS,
    allreduce,
    compressed_allreduce,
    gathered_exchange,
    heal_check,
    tcp_throughput_bps,
)
from farlink.plan.payload import codec_cost
from farlink.links import LinkProfile, load_links
from farlink.plan.tables import GPU, PlanInputError, load_hardware, lookup
from farlink.plan.variability import churn_factor, slowest_link_factor, straggler_factor

def planned_algorithms() -> tuple[str, ...]:
    """The algorithms whose rounds this model predicts (each says so in its capabilities)."""
    from farlink.sync import ALGORITHMS, capabilities

    return tuple(a for a in ALGORITHMS if capabilities(a).planned)


def _capabilities(algorithm: str):  # noqa: ANN202 - farlink.sync.Capabilities, imported late
    """An algorithm's capabilities (imported late: they live with the algorithm, which needs
    torch; the tables and formulas here do not). PlanInputError for one the model lacks."""
    from farlink.sync import capabilities

    planned = planned_algorithms()
    if algorithm not in planned:
        raise PlanInputError(f"unknown algorithm {algorithm!r}; choose from {', '.join(planned)}")
    return capabilities(algorithm)

EXCHANGES = ("auto", "allreduce", "gather")
DENSE_CODECS = ("fp32", "none", "fp16", "bf16", "int8", "int4")
DEFAULT_OVERLAP_STEPS = 5  # Streaming DiLoCo overlaps a fragment's exchange with a few steps
ADAM_BYTES_PER_PARAM = 16  # bf16 weights + grads, fp32 master weights + two Adam moments
TARGET_UTILIZATION = 0.95


@dataclass(frozen=True)
class RoundPrediction:
    """One outer round of one algorithm: where the time goes and what goes on the wire."""

    algorithm: str
    n_workers: int
    steps_per_round: int
    syncs_per_round: int
    step_seconds: float
    compute_seconds: float  # the mean worker's inner compute in one round
    straggler_seconds: float  # extra wait for the slowest worker
    comm_seconds: float  # transfer time of all the round's collectives
    exposed_comm_seconds: float  # the part of it nobody computes through
    hidden_comm_seconds: float  # the part overlapped with inner steps (streaming only)
    round_seconds: float  # wall-clock of one round, before churn
    utilization: float  # compute / round wall-clock, times churn survival
    payload_bytes: float  # one worker's full-model sync payload after the codec
    bytes_sent_per_round: float  # what one worker sends in one round
    effective_bandwidth_bps: float
    straggler_factor: float
    link_factor: float
    churn_factor: float

    def to_dict(self) -> dict:
        return asdict(self)


def predict_round(
    algorithm: str,
    n_workers: int,
    step_seconds: float,
    bandwidth_bps: float,
    latency_s: float,
    *,
    n_params: float | None = None,
    payload_bytes: float | None = None,
    inner_steps: int = 1,
    codec: str = "fp32",
    fragments: int = 1,
    overlap_steps: int | None = None,
    backend: str = "torchft",
    bandwidth_min_bps: float | None = None,
    jitter_s: float = 0.0,
    loss: float = 0.0,
    straggler_sigma: float = 0.0,
    failures_per_hour: float = 0.0,
    rejoin_seconds: float = 0.0,
    seed: int = 0,
    exchange: str = "auto",
    coordinator_rtt_s: float | None = None,
    local_seconds: float = 0.0,
    shared_link: bool = False,
    partial_gathers: int = 0,
    outer_overlap: str = "none",
) -> RoundPrediction:
    """Predict one round from inputs a small real run can measure.

    ``payload_bytes`` is the measured size of one worker's full sync payload (what the codec
    produced for the whole model); without it, ``n_params`` and ``codec`` estimate it. For
    ``ddp``/``demo`` ``inner_steps`` is ignored (they sync every step). For ``demo`` the codec
    must be a ``dct_topk`` spec. ``exchange`` is ``auto`` (as farlink runs the codec: dense codecs
    all-reduced, sparse ones gathered), ``allreduce`` or ``gather``. ``shared_link``: every
    worker's traffic crosses one link of ``bandwidth_bps`` (a shared bottleneck), so each
    worker's collectives run at ``1/n`` of it (every worker sends the same bytes at once).
    ``partial_gathers``: the all-gathers a robust rule adds to the compressed all-reduce
    (:func:`farlink.sync.allreduce.partial_gathers`). ``outer_overlap``
    ``delayed``/``eager`` (an algorithm with a delayed outer step, :mod:`farlink.sync.delayed`):
    the round's exchange runs through the next round's compute (a fragment's through the next
    period's), so only what exceeds that compute is exposed.
    """
    algorithm = algorithm.strip().lower()
    caps = _capabilities(algorithm)
    if backend not in BACKENDS:
        raise PlanInputError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if not isinstance(n_workers, int) or n_workers < 1:
        raise PlanInputError(f"n_workers must be a positive integer, got {n_workers!r}")
    if not step_seconds > 0 or not math.isfinite(step_seconds):
        raise PlanInputError(f"step_seconds must be positive, got {step_seconds}")
    if inner_steps < 1 or fragments < 1:
        raise PlanInputError(f"inner_steps and fragments must be >= 1, got {inner_steps}, {fragments}")
    if straggler_sigma < 0 or failures_per_hour < 0 or rejoin_seconds < 0 or jitter_s < 0:
        raise PlanInputError("straggler sigma, failure rate, rejoin time and jitter must be >= 0")
    if exchange not in EXCHANGES:
        raise PlanInputError(f"unknown exchange {exchange!r}; choose from {', '.join(EXCHANGES)}")
    if local_seconds < 0 or (coordinator_rtt_s is not None and coordinator_rtt_s < 0):
        raise PlanInputError("local_seconds and coordinator_rtt_s must be >= 0")
    cost = codec_cost(codec)
    if caps.wire_codec and cost.name != caps.wire_codec and payload_bytes is None:
        raise PlanInputError(f"{algorithm} sends with {caps.wire_codec}; codec must be "
                             f"{caps.wire_codec}[:...], got {codec!r}")
    if payload_bytes is None:
        if n_params is None or n_params <= 0:
            raise PlanInputError("give n_params (with a codec) or a measured payload_bytes")
        payload_bytes = cost.payload_bytes(n_params)
    elif payload_bytes < 0:
        raise PlanInputError(f"payload_bytes must be >= 0, got {payload_bytes}")

    steps = 1 if caps.syncs_every_step else inner_steps
    hop_latency = latency_s + jitter_s
    ratio = None if bandwidth_min_bps is None else bandwidth_min_bps / bandwidth_bps
    link = slowest_link_factor(n_workers, ratio, seed)
    bandwidth = min(bandwidth_bps / link, tcp_throughput_bps(bandwidth_bps, 2 * hop_latency, loss))
    if shared_link:
        bandwidth /= n_workers
    sf = straggler_factor(n_workers, straggler_sigma, seed)
    compute = steps * step_seconds
    compute_wall = compute * sf
    gathered = exchange == "gather" or (
        exchange == "auto" and (caps.wire_codec is not None or cost.name not in DENSE_CODECS))
    quorum = 0.0
    if backend == "torchft" and n_workers > 1:
        quorum = hop_latency if coordinator_rtt_s is None else coordinator_rtt_s
        # the heal check after the quorum: every member's announcement, gathered (2(n-1) hops)
        quorum += heal_check(backend, n_workers, hop_latency).seconds

    def one_sync(size: float) -> tuple[float, float]:
        """Seconds and bytes sent of one blocking sync of ``size`` payload bytes."""
        # fp32 is summed on the wire; other dense codecs go by shards, whose schedule is priced
        # as it runs where it is validated (in-process emulation and torchft in namespaces,
        # docs/planner.md), and as the butterfly with the same bytes on hivemind
        if not gathered and backend != "hivemind" and cost.name not in ("fp32", "none"):
            c = compressed_allreduce(backend, size, n_workers, bandwidth, hop_latency,
                                     partial_gathers)
        else:
            move = gathered_exchange if gathered else allreduce
            c = move(backend, size, n_workers, bandwidth, hop_latency)
        return quorum + c.seconds + local_seconds, c.bytes_sent

    delayed = outer_overlap != "none"
    if delayed and not caps.delayed_outer:
        raise PlanInputError(f"{algorithm} has no delayed outer step (outer_overlap)")
    if caps.fragments:
        if delayed:  # each fragment's round overlaps a whole period
            overlap_steps = steps
        if fragments > steps:
            raise PlanInputError(f"{algorithm} needs fragments <= inner_steps ({fragments} > {steps})")
        tau = min(DEFAULT_OVERLAP_STEPS, steps // fragments) if overlap_steps is None else overlap_steps
        if tau < 0:
            raise PlanInputError(f"overlap_steps must be >= 0, got {tau}")
        frag_seconds, frag_sent = one_sync(payload_bytes / fragments)
        syncs = fragments
        comm = syncs * frag_seconds
        exposed = syncs * max(0.0, frag_seconds - tau * step_seconds * sf)
        round_s = max(compute_wall + exposed, comm)
        exposed = round_s - compute_wall  # includes waiting for a saturated link
        sent = syncs * frag_sent
    else:
        seconds, sent = one_sync(payload_bytes)
        syncs, comm = 1, seconds
        # delayed: the exchange runs through the next round's compute (one round in flight)
        exposed = max(0.0, seconds - compute_wall) if delayed else seconds
        round_s = compute_wall + exposed

    churn = churn_factor(n_workers, failures_per_hour, round_s, exposed, rejoin_seconds)
    return RoundPrediction(
        algorithm=algorithm,
        n_workers=n_workers,
        steps_per_round=steps,
        syncs_per_round=syncs,
        step_seconds=step_seconds,
        compute_seconds=compute,
        straggler_seconds=compute_wall - compute,
        comm_seconds=comm,
        exposed_comm_seconds=exposed,
        hidden_comm_seconds=max(0.0, comm - exposed),
        round_seconds=round_s,
        utilization=compute / round_s * churn if round_s > 0 else 1.0,
        payload_bytes=payload_bytes,
        bytes_sent_per_round=sent,
        effective_bandwidth_bps=bandwidth,
        straggler_factor=sf,
        link_factor=link,
        churn_factor=churn,
    )


def required_bandwidth(target: float = TARGET_UTILIZATION, *,
                       bandwidth_min_ratio: float | None = None, **round_inputs) -> float:
    """Nominal link rate (bit/s) at which :func:`predict_round` reaches ``target`` utilization.

    ``round_inputs`` are :func:`predict_round`'s arguments without the bandwidths. A link with a
    bandwidth range keeps its shape: ``bandwidth_min_ratio`` = min/max rate is held fixed while
    the nominal rate moves. Returns ``inf`` when no bandwidth suffices (latency, stragglers or
    churn alone cost too much).
    """
    if not 0 < target < 1:
        raise PlanInputError(f"target utilization must be in (0, 1), got {target}")
    ratio = bandwidth_min_ratio

    def utilization(bps: float) -> float:
        low = None if ratio is None else bps * ratio
        return predict_round(bandwidth_bps=bps, bandwidth_min_bps=low, **round_inputs).utilization

    lo, hi = 1e3, 1e16  # 1 kbit/s .. 10 Pbit/s, searched in log space
    if utilization(hi) < target:
        return math.inf
    if utilization(lo) >= target:
        return lo
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if utilization(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class Scenario:
    """A training run to plan: model, fleet, link, algorithm and budget."""

    n_params: float
    n_workers: int
    gpu: str = "h100"
    profile: str = "intercontinental"
    algorithm: str = "diloco"
    inner_steps: int = 100
    codec: str = "fp32"
    demo_codec: str = "dct_topk"
    fragments: int = 4
    overlap_steps: int | None = None
    gpus_per_worker: int | None = None  # None: the GPU table's default_per_worker
    batch_tokens: int = 2**20  # tokens per worker per inner step
    tokens: float | None = None  # training budget; None: 20 tokens per parameter (Chinchilla)
    mfu: float = 0.4
    backend: str = "torchft"
    straggler_sigma: float = 0.0
    failures_per_hour: float = 0.0  # per worker
    rejoin_seconds: float = 60.0
    seed: int = 0
    exchange: str = "auto"  # see predict_round

    def __post_init__(self) -> None:
        if not self.n_params > 0:
            raise PlanInputError(f"n_params must be positive, got {self.n_params}")
        if self.n_workers < 1:
            raise PlanInputError(f"n_workers must be >= 1, got {self.n_workers}")
        if not 0 < self.mfu <= 1:
            raise PlanInputError(f"mfu must be in (0, 1], got {self.mfu}")
        if self.batch_tokens < 1 or self.inner_steps < 1 or self.fragments < 1:
            raise PlanInputError("batch_tokens, inner_steps and fragments must be >= 1")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 1:
            raise PlanInputError(f"gpus_per_worker must be >= 1, got {self.gpus_per_worker}")
        if self.tokens is not None and not self.tokens > 0:
            raise PlanInputError(f"tokens must be positive, got {self.tokens}")

    @property
    def token_budget(self) -> float:
        return 20.0 * self.n_params if self.tokens is None else float(self.tokens)


@dataclass(frozen=True)
class PlanResult:
    """A full prediction: the round, plus bytes per token, the 95% bandwidth, time and money."""

    scenario: Scenario
    algorithm: str
    codec: str
    gpu: GPU
    link: LinkProfile
    gpus_per_worker: int
    round: RoundPrediction
    bytes_per_token: float  # bytes one worker sends per token it trains on
    bandwidth_for_target_bps: float
    target_utilization: float
    wall_clock_seconds: float
    gpu_hours: float
    cost_on_demand_usd: float
    cost_spot_usd: float
    memory_gib_per_gpu: float
    fits_memory: bool
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "algorithm": self.algorithm,
            "codec": self.codec,
            "scenario": asdict(self.scenario) | {"token_budget": self.scenario.token_budget},
            "gpu": self.gpu.model_dump() | {"name": self.scenario.gpu},
            "link": self.link.model_dump() | {"name": self.scenario.profile},
            "gpus_per_worker": self.gpus_per_worker,
            "round": self.round.to_dict(),
            "bytes_per_token": self.bytes_per_token,
            "bandwidth_for_target_bps": self.bandwidth_for_target_bps,
            "target_utilization": self.target_utilization,
            "wall_clock_seconds": self.wall_clock_seconds,
            "wall_clock_days": self.wall_clock_seconds / 86400,
            "gpu_hours": self.gpu_hours,
            "cost_on_demand_usd": self.cost_on_demand_usd,
            "cost_spot_usd": self.cost_spot_usd,
            "memory_gib_per_gpu": self.memory_gib_per_gpu,
            "fits_memory": self.fits_memory,
            "notes": list(self.notes),
        }


def step_seconds(n_params: float, batch_tokens: float, gpu: GPU, mfu: float, gpus: int) -> float:
    """One inner step on one worker: 6 N T / (F * mfu * g)."""
    return 6.0 * n_params * batch_tokens / (gpu.flops * mfu * gpus)


def plan(
    scenario: Scenario,
    hardware: dict[str, GPU] | None = None,
    links: dict[str, LinkProfile] | None = None,
    target: float = TARGET_UTILIZATION,
) -> PlanResult:
    """Predict ``scenario`` for its algorithm using the hardware and link tables."""
    hardware = load_hardware() if hardware is None else hardware
    links = load_links() if links is None else links
    gpu = lookup(hardware, scenario.gpu, "gpu")
    link = lookup(links, scenario.profile, "link profile")
    gpus = scenario.gpus_per_worker or gpu.default_per_worker
    algorithm = scenario.algorithm.strip().lower()
    wire = _capabilities(algorithm).wire_codec  # an algorithm that sends with its own codec
    codec = scenario.codec if wire is None else scenario.demo_codec if wire == "dct_topk" \
        else scenario.codec if codec_cost(scenario.codec).name == wire else wire
    step = step_seconds(scenario.n_params, scenario.batch_tokens, gpu, scenario.mfu, gpus)
    inputs = {
        "algorithm": algorithm,
        "n_workers": scenario.n_workers,
        "step_seconds": step,
        "latency_s": link.latency_s,
        "n_params": scenario.n_params,
        "inner_steps": scenario.inner_steps,
        "codec": codec,
        "fragments": scenario.fragments,
        "overlap_steps": scenario.overlap_steps,
        "backend": scenario.backend,
        "jitter_s": link.jitter_s,
        "loss": link.loss,
        "straggler_sigma": scenario.straggler_sigma,
        "failures_per_hour": scenario.failures_per_hour,
        "rejoin_seconds": scenario.rejoin_seconds,
        "seed": scenario.seed,
        "exchange": scenario.exchange,
        "shared_link": link.shared,
    }
    rnd = predict_round(bandwidth_bps=link.bandwidth_bps, bandwidth_min_bps=link.bandwidth_min_bps,
                        **inputs)
    ratio = None if link.bandwidth_min_bps is None else link.bandwidth_min_bps / link.bandwidth_bps
    needed = required_bandwidth(target, bandwidth_min_ratio=ratio, **inputs)

    tokens_per_round = scenario.n_workers * scenario.batch_tokens * rnd.steps_per_round
    rounds = scenario.token_budget / tokens_per_round
    wall = rounds * rnd.round_seconds / rnd.churn_factor if rnd.churn_factor > 0 else math.inf
    gpu_hours = wall / 3600 * scenario.n_workers * gpus
    memory = ADAM_BYTES_PER_PARAM * scenario.n_params / gpus / 2**30
    notes = []
    if memory > gpu.memory_gib:
        notes.append(
            f"model states need {memory:.1f} GiB per GPU (16 B/param sharded over {gpus}), "
            f"more than the {gpu.memory_gib:g} GiB a {scenario.gpu} has"
        )
    if rnd.churn_factor == 0:
        notes.append("failures arrive faster than rounds can finish: no progress")
    return PlanResult(
        scenario=scenario,
        algorithm=algorithm,
        codec=codec,
        gpu=gpu,
        link=link,
        gpus_per_worker=gpus,
        round=rnd,
        bytes_per_token=rnd.bytes_sent_per_round / (scenario.batch_tokens * rnd.steps_per_round),
        bandwidth_for_target_bps=needed,
        target_utilization=target,
        wall_clock_seconds=wall,
        gpu_hours=gpu_hours,
        cost_on_demand_usd=gpu_hours * gpu.on_demand_usd_per_hour,
        cost_spot_usd=gpu_hours * gpu.spot_usd_per_hour,
        memory_gib_per_gpu=memory,
        fits_memory=memory <= gpu.memory_gib,
        notes=notes,
    )


def plan_many(scenario: Scenario, algorithms: tuple[str, ...] | None = None,
              hardware: dict[str, GPU] | None = None,
              links: dict[str, LinkProfile] | None = None,
              target: float = TARGET_UTILIZATION) -> list[PlanResult]:
    """:func:`plan` for several algorithms on the same scenario (tables loaded once)."""
    from dataclasses import replace

    hardware = load_hardware() if hardware is None else hardware
    links = load_links() if links is None else links
    algorithms = planned_algorithms() if algorithms is None else algorithms
    return [plan(replace(scenario, algorithm=a), hardware, links, target) for a in algorithms]
