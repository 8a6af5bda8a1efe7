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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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


def plan_pipeline(n_params: float, d_model: int, stages: int, workers: int, gpu: GPU,
                  link: LinkProfile, batch_tokens: int, micro_batches: int = 8,
                  activation_codec: str = "fp32", mfu: float = 0.4, gpus_per_worker: int = 1,
                  inner_steps: int = 100) -> PipelinePlan:
    """Predict a step of ``workers // stages`` pipelines of ``stages`` peers each."""
    from farlink.comm.linkprobe import LinkMatrix
    from farlink.parallel.placement import PipelineCost, step_seconds as placed_step

    if stages < 2:
        raise PlanInputError(f"--pipeline-stages must be >= 2, got {stages}")
    if workers % stages:
        raise PlanInputError(f"{workers} workers do not form pipelines of {stages} stages; "
                             f"use a multiple of {stages} workers")
    if micro_batches < 1 or batch_tokens < micro_batches:
        raise PlanInputError("need 1 <= micro-batches <= batch-tokens")
    pipelines = workers // stages
    micro_tokens = batch_tokens / micro_batches
    compute = step_seconds(n_params / stages, micro_tokens, gpu, mfu, gpus_per_worker)
    act_bytes = codec_cost(activation_codec).payload_bytes(micro_tokens * d_model)
    matrix = LinkMatrix([[link.bandwidth_mbit] * workers for _ in range(workers)],
                        [[2 * link.latency_ms] * workers for _ in range(workers)])
    grid = [list(range(p * stages, (p + 1) * stages)) for p in range(pipelines)]
    cost = PipelineCost(act_bytes, compute, micro_batches,
                        stage_bytes=4 * n_params / stages, average_every=inner_steps)
    step, boundary, _ = placed_step(matrix, grid, cost)
    memory = ADAM_BYTES_PER_PARAM * n_params / stages / gpus_per_worker / 2**30
    return PipelinePlan(
        stages=stages, pipelines=pipelines, micro_batches=micro_batches,
        activation_codec=activation_codec, stage_compute_s=compute, boundary_s=boundary,
        step_s=step, utilization=micro_batches * compute / step,
        tokens_per_s=pipelines * batch_tokens / step,
        activation_bytes_per_token=2 * (stages - 1) * act_bytes / micro_tokens,
        memory_gib_per_gpu=memory, fits_memory=memory <= gpu.memory_gib)
