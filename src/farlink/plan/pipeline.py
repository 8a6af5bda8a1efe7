"""The planner for pipelines: a model cut into S stages on S peers, P such pipelines side by side.

Per peer the model states shrink to ``16 N / S`` bytes (what lets a model too big for one GPU
train at all); in exchange every micro-batch crosses ``S - 1`` stage boundaries forward (its
activations, ``tokens x d_model`` values through the activation codec) and back (their
gradients, the same size). The step time is the placement cost model of
:mod:`farlink.parallel.placement` on a matrix where every pair has the profile's link: a 1F1B
pipeline fills in ``S`` stage computes plus ``2 (S - 1)`` transfers, then delivers one
micro-batch per bottleneck (the slower of a stage's compute and a boundary transfer). Peers of one
stage average their ``N / S`` parameters over a ring every ``inner_steps`` steps (local SGD or
DiLoCo within a stage).

Given a link matrix (:func:`load_link_matrix`), :func:`place_on_matrix` chooses which peer serves
which stage of which pipeline with :func:`farlink.parallel.placement.place` and sets its
predicted step time beside random placements' on the same matrix and cost.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from farlink.plan.model import ADAM_BYTES_PER_PARAM, step_seconds
from farlink.plan.payload import codec_cost
from farlink.links import LinkProfile
from farlink.plan.tables import GPU, PlanInputError


@dataclass(frozen=True)
class PipelinePlan:
    stages: int
    pipelines: int
    micro_batches: int
    activation_codec: str
    stage_compute_s: float  # one micro-batch through one stage, forward + backward
    boundary_s: float  # one micro-batch's activations (or gradients) over one boundary
    step_s: float  # one step of every pipeline, stage averaging included
    utilization: float  # a peer's compute / step wall-clock
    tokens_per_s: float  # all pipelines together
    activation_bytes_per_token: float  # sent over the boundaries, both directions, per token
    memory_gib_per_gpu: float
    fits_memory: bool

    def to_dict(self) -> dict:
        return asdict(self)


def _costs(n_params: float, d_model: int, stages: int, gpu: GPU, batch_tokens: int,
           micro_batches: int, activation_codec: str, mfu: float, gpus_per_worker: int,
           inner_steps: int):
    """(seconds of one micro-batch through one stage, the placement cost of a step)."""
    from farlink.parallel.placement import PipelineCost

    if stages < 2:
        raise PlanInputError(f"--pipeline-stages must be >= 2, got {stages}")
    if micro_batches < 1 or batch_tokens < micro_batches:
        raise PlanInputError("need 1 <= micro-batches <= batch-tokens")
    micro_tokens = batch_tokens / micro_batches
    compute = step_seconds(n_params / stages, micro_tokens, gpu, mfu, gpus_per_worker)
    act_bytes = codec_cost(activation_codec).payload_bytes(micro_tokens * d_model)
    return compute, PipelineCost(act_bytes, compute, micro_batches,
                                 stage_bytes=4 * n_params / stages, average_every=inner_steps)


def load_link_matrix(path: Path):
    """(peer names, :class:`~farlink.comm.linkprobe.LinkMatrix`) from a JSON file: the form
    ``LinkMatrix.to_json`` writes (what ``measure_links`` measures), ``bandwidth_mbit`` and
    ``rtt_ms`` as n x n lists (row i: links from peer i; null: unmeasured), ``latency_ms`` (one
    way) accepted for ``rtt_ms``, and optional ``peers`` names (default ``0..n-1``)."""
    from farlink.comm.linkprobe import LinkMatrix

    try:
        data = json.loads(Path(path).read_text())
        matrix = LinkMatrix.from_json(data)
    except OSError as exc:
        raise PlanInputError(f"cannot read the link matrix {path}: {exc.strerror}") from exc
    except ValueError as exc:  # JSON syntax and matrix shape alike
        raise PlanInputError(f"link matrix {path}: {exc}") from exc
    n = len(matrix.bandwidth_mbit)
    peers = [str(p) for p in data.get("peers", range(n))]
    if len(peers) != n:
        raise PlanInputError(f"link matrix {path}: {len(peers)} peer names for {n} rows")
    return peers, matrix


def place_on_matrix(n_params: float, d_model: int, stages: int, gpu: GPU, links, peers,
                    batch_tokens: int, micro_batches: int = 8, activation_codec: str = "fp32",
                    mfu: float = 0.4, gpus_per_worker: int = 1, inner_steps: int = 100,
                    random_samples: int = 200, seed: int = 0) -> dict:
    """The placement chosen on ``links`` (peer names per pipeline and stage) and its predicted
    step time, beside the median of ``random_samples`` random placements (and the placement
    at that median, so the two can be read side by side)."""
    from farlink.parallel.placement import place, random_placements

    n = len(links.bandwidth_mbit)
    if n % stages:
        raise PlanInputError(f"the link matrix has {n} peers: they do not form pipelines of "
                             f"{stages} stages; give a stage count that divides {n}")
    _, cost = _costs(n_params, d_model, stages, gpu, batch_tokens, micro_batches,
                     activation_codec, mfu, gpus_per_worker, inner_steps)
    chosen = place(links, stages, cost, seed=seed)
    randoms = sorted(random_placements(links, stages, cost, random_samples, seed),
                     key=lambda p: p.step_s)

    def named(placement) -> dict:
        return {"pipelines": [[peers[i] for i in row] for row in placement.grid],
                "predicted_step_s": placement.step_s,
                "slowest_link_s": placement.slowest_link_s}

    return {"peers": peers, "stages": stages, "micro_batches": micro_batches,
            "stage_compute_s": cost.stage_compute_s, "activation_bytes": cost.activation_bytes,
            "chosen": named(chosen), "random": named(randoms[len(randoms) // 2]),
            "random_median_step_s": statistics.median(p.step_s for p in randoms),
            "random_samples": random_samples}


def plan_pipeline(n_params: float, d_model: int, stages: int, workers: int, gpu: GPU,
                  link: LinkProfile, batch_tokens: int, micro_batches: int = 8,
                  activation_codec: str = "fp32", mfu: float = 0.4, gpus_per_worker: int = 1,
                  inner_steps: int = 100) -> PipelinePlan:
    """Predict a step of ``workers // stages`` pipelines of ``stages`` peers each."""
    from farlink.comm.linkprobe import LinkMatrix
    from farlink.parallel.placement import step_seconds as placed_step

    compute, cost = _costs(n_params, d_model, stages, gpu, batch_tokens, micro_batches,
                           activation_codec, mfu, gpus_per_worker, inner_steps)
    if workers % stages:
        raise PlanInputError(f"{workers} workers do not form pipelines of {stages} stages; "
                             f"use a multiple of {stages} workers")
    pipelines = workers // stages
    micro_tokens = batch_tokens / micro_batches
    act_bytes = cost.activation_bytes
    matrix = LinkMatrix([[link.bandwidth_mbit] * workers for _ in range(workers)],
                        [[2 * link.latency_ms] * workers for _ in range(workers)])
    grid = [list(range(p * stages, (p + 1) * stages)) for p in range(pipelines)]
    step, boundary, _ = placed_step(matrix, grid, cost)
    memory = ADAM_BYTES_PER_PARAM * n_params / stages / gpus_per_worker / 2**30
    return PipelinePlan(
        stages=stages, pipelines=pipelines, micro_batches=micro_batches,
        activation_codec=activation_codec, stage_compute_s=compute, boundary_s=boundary,
        step_s=step, utilization=micro_batches * compute / step,
        tokens_per_s=pipelines * batch_tokens / step,
        activation_bytes_per_token=2 * (stages - 1) * act_bytes / micro_tokens,
        memory_gib_per_gpu=memory, fits_memory=memory <= gpu.memory_gib)
