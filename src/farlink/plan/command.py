"""``farlink plan`` and ``farlink bench planner``: the planner from the command line.

Bad input (an unknown GPU, profile, codec or model size, a broken table file) ends with one
clear line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer

ALGORITHM_CHOICES = "ddp|local_sgd|diloco|streaming_diloco|demo|all"


def _fail(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


def _jsonable(value: object) -> object:
    """JSON has no infinity: an unreachable bandwidth or endless run becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def plan_command(
    model: Annotated[str, typer.Option(help="Parameter count (10B, 1.3b, 125M, 7e9) or a farlink preset (tiny, small, 125m, 350m, 1b, 10b).")],
    workers: Annotated[int, typer.Option(help="Data-parallel workers (islands).", min=1)],
    gpu: Annotated[str, typer.Option(help="GPU name from the hardware table.")] = "h100",
    profile: Annotated[str, typer.Option(help="Link profile from the links table.")] = "intercontinental",
    algorithm: Annotated[str, typer.Option(help=ALGORITHM_CHOICES)] = "all",
    inner_steps: Annotated[int, typer.Option(help="H: inner steps per outer round (local_sgd, diloco, streaming_diloco).", min=1)] = 100,
    codec: Annotated[str, typer.Option(help="Payload codec for all-reduces: fp32, fp16, bf16, int8, int4, topk[:FRACTION].")] = "fp32",
    demo_codec: Annotated[str, typer.Option(help="DeMo payload: dct_topk[:CHUNK:K].")] = "dct_topk",
    fragments: Annotated[int, typer.Option(help="P: Streaming DiLoCo fragments.", min=1)] = 4,
    overlap_steps: Annotated[int | None, typer.Option(help="tau: inner steps a fragment's exchange overlaps (default min(5, H/P)).", min=0)] = None,
    gpus_per_worker: Annotated[int | None, typer.Option(help="GPUs per worker (default from the hardware table).", min=1)] = None,
    tokens: Annotated[float | None, typer.Option(help="Token budget (default 20 tokens per parameter).")] = None,
    batch_tokens: Annotated[float, typer.Option(help="Tokens per worker per inner step.")] = 2**20,
    mfu: Annotated[float, typer.Option(help="Model FLOPs utilization of the inner steps.")] = 0.4,
    backend: Annotated[str, typer.Option(
        help="torchft (ring all-reduce), hivemind (butterfly) or inprocess (in-process "
             "emulation: peers as threads, one-way hops).")] = "torchft",
    exchange: Annotated[str, typer.Option(
        help="auto (as farlink runs the codec: dense codecs all-reduced, sparse gathered), "
             "allreduce or gather.")] = "auto",
    straggler_sigma: Annotated[float, typer.Option(help="Log-sd of per-worker speed (lognormal, mean 1).", min=0)] = 0.0,
    failures_per_hour: Annotated[float, typer.Option(help="Poisson failures per worker-hour.", min=0)] = 0.0,
    rejoin_seconds: Annotated[float, typer.Option(help="Seconds a failed worker needs to rejoin and heal.", min=0)] = 60.0,
    target: Annotated[float, typer.Option(help="Utilization the bandwidth requirement is solved for.")] = 0.95,
    hardware_file: Annotated[Path | None, typer.Option(help="Your own GPU table (TOML, same schema as the built-in).")] = None,
    links_file: Annotated[Path | None, typer.Option(help="Your own link table (TOML).")] = None,
    pipeline_stages: Annotated[int | None, typer.Option(help="Also model the workers as pipelines of this many stages (needs a model preset, for its width).", min=2)] = None,
    micro_batches: Annotated[int, typer.Option(help="Pipeline: micro-batches per step.", min=1)] = 8,
    activation_codec: Annotated[str, typer.Option(help="Pipeline: codec of activations and their gradients.")] = "fp32",
    link_matrix: Annotated[Path | None, typer.Option(help="Pipeline: a measured link matrix (JSON: bandwidth_mbit and rtt_ms, n x n, optional peers names; what measure_links writes): choose which peer serves which stage of which pipeline, and compare with random placements.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")] = False,
) -> None:
    """Predict round time, utilization, bytes per token, bandwidth need, wall-clock and cost."""
    from dataclasses import replace

    from farlink.plan.model import Scenario, plan, planned_algorithms
    from farlink.plan.sizes import parse_model_size
    from farlink.links import LinkError, load_links
    from farlink.plan.tables import PlanInputError, load_hardware
    from farlink.sync import capabilities

    try:
        hardware = load_hardware(hardware_file)
        links = load_links(links_file)
        n_params, model_label = parse_model_size(model)
        name = algorithm.strip().lower()
        algorithms = planned_algorithms()
        if name != "all" and name not in algorithms:
            raise PlanInputError(f"unknown algorithm {algorithm!r}; choose from "
                                 f"{'|'.join(algorithms)}|all")
        if batch_tokens < 1 or batch_tokens != int(batch_tokens):
            raise PlanInputError(f"batch-tokens must be a positive whole number, got {batch_tokens:g}")
        scenario = Scenario(
            n_params=n_params, n_workers=workers, gpu=gpu.strip().lower(),
            profile=profile.strip().lower(), inner_steps=inner_steps, codec=codec,
            demo_codec=demo_codec, fragments=fragments, overlap_steps=overlap_steps,
            gpus_per_worker=gpus_per_worker, batch_tokens=int(batch_tokens), tokens=tokens,
            mfu=mfu, backend=backend.strip().lower(), straggler_sigma=straggler_sigma,
            failures_per_hour=failures_per_hour, rejoin_seconds=rejoin_seconds,
            exchange=exchange.strip().lower(),
        )
        names = algorithms if name == "all" else (name,)
        if name == "all" and inner_steps < fragments:
            names = tuple(a for a in names if not capabilities(a).fragments)
        results = [plan(replace(scenario, algorithm=a), hardware, links, target) for a in names]
        pipeline = placement = None
        if link_matrix is not None and pipeline_stages is None:
            raise PlanInputError("--link-matrix places pipeline stages: give --pipeline-stages")
        if pipeline_stages is not None:
            pipeline = _pipeline_plan(model, n_params, pipeline_stages, workers, results[0],
                                      batch_tokens, micro_batches, activation_codec, mfu,
                                      inner_steps)
        if link_matrix is not None:
            placement = _placement(model, n_params, pipeline_stages, workers, results[0],
                                   link_matrix, batch_tokens, micro_batches, activation_codec,
                                   mfu, inner_steps)
    except (PlanInputError, LinkError) as exc:
        _fail(str(exc))
        return

    if as_json:
        payload = {"model": model_label, "results": [r.to_dict() for r in results]}
        if pipeline is not None:
            payload["pipeline"] = pipeline.to_dict()
        if placement is not None:
            payload["placement"] = placement
        typer.echo(json.dumps(_jsonable(payload), indent=2, allow_nan=False))
        return
    from rich.console import Console

    from farlink.plan.render import header, table

    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(header(results[0], model_label), highlight=False)
    console.print(table(results))
    for r in results:
        for note in r.notes:
            console.print(f"[yellow]note ({r.algorithm}):[/] {note}", highlight=False)
    if pipeline is not None:
        p = pipeline
        console.print(
            f"pipeline: {p.pipelines} x {p.stages} stages, {p.micro_batches} micro-batches, "
            f"activations {p.activation_codec}: step {p.step_s:.4g} s (stage compute "
            f"{p.stage_compute_s:.3g} s, boundary {p.boundary_s:.3g} s per micro-batch), "
            f"utilization {p.utilization:.1%}, {p.tokens_per_s:.4g} tokens/s, "
            f"{p.activation_bytes_per_token:.4g} activation bytes/token, "
            f"{p.memory_gib_per_gpu:.3g} GiB per GPU" + ("" if p.fits_memory else " (does not fit)"),
            highlight=False)
    if placement is not None:
        def pipelines(p: dict) -> str:
            return "; ".join(f"pipeline {k}: " + " -> ".join(
                f"stage {s} on {peer}" for s, peer in enumerate(row))
                for k, row in enumerate(p["pipelines"]))

        chosen, drawn = placement["chosen"], placement["random"]
        console.print(f"placement on {link_matrix} ({len(placement['peers'])} peers): "
                      f"{pipelines(chosen)}", highlight=False)
        console.print(f"  predicted step {chosen['predicted_step_s']:.4g} s (slowest boundary "
                      f"{chosen['slowest_link_s']:.3g} s); the median random placement "
                      f"of {placement['random_samples']} ({pipelines(drawn)}): "
                      f"{drawn['predicted_step_s']:.4g} s", highlight=False)


def _preset(model: str, stages: int):
    from farlink.plan.tables import PlanInputError

    try:
        from farlink.model.config import PRESETS
    except ImportError:
        PRESETS = {}
    config = PRESETS.get(model.strip().lower())
    if config is None:
        raise PlanInputError(f"--pipeline-stages needs the model's width: give a preset "
                             f"({', '.join(PRESETS)}) as --model, not {model!r}")
    if stages > config.n_layer:
        raise PlanInputError(f"{stages} stages for {config.n_layer} blocks: use at most "
                             f"{config.n_layer} pipeline stages")
    return config


def _placement(model: str, n_params: float, stages: int, workers: int, result,
               path: Path, batch_tokens: float, micro_batches: int, codec: str, mfu: float,
               inner_steps: int) -> dict:
    """The placement chosen on a measured matrix (:func:`farlink.plan.pipeline.place_on_matrix`)."""
    from farlink.plan.pipeline import load_link_matrix, place_on_matrix
    from farlink.plan.tables import PlanInputError

    config = _preset(model, stages)
    peers, links = load_link_matrix(path)
    if len(peers) != workers:
        raise PlanInputError(f"the link matrix {path} has {len(peers)} peers but --workers is "
                             f"{workers}: pass --workers {len(peers)}")
    return place_on_matrix(n_params, config.d_model, stages, result.gpu, links, peers,
                           int(batch_tokens), micro_batches, codec, mfu,
                           result.gpus_per_worker, inner_steps)


def _pipeline_plan(model: str, n_params: float, stages: int, workers: int, result,
                   batch_tokens: float, micro_batches: int, codec: str, mfu: float,
                   inner_steps: int):
    """The pipeline alternative on the same GPUs and link (:mod:`farlink.plan.pipeline`)."""
    from farlink.plan.pipeline import plan_pipeline

    config = _preset(model, stages)
    return plan_pipeline(n_params, config.d_model, stages, workers, result.gpu, result.link,
                         int(batch_tokens), micro_batches, codec, mfu, result.gpus_per_worker,
                         inner_steps)


def bench_planner_command(
    out: Annotated[Path, typer.Option(help="Directory for planner_checks.json and .png.")] = Path("bench-out/planner"),
) -> None:
    """Planner predictions against published figures (INTELLECT-1, DiLoCo): JSON + PNG."""
    from farlink.plan.published import write_published_report

    paths = write_published_report(out)
    checks = json.loads(paths["json"].read_text())["checks"]
    for c in checks:
        verdict = "pass" if c["passed"] else "FAIL"
        typer.echo(f"{verdict}  {c['name']}: predicted {c['predicted']:.4g}, reported "
                   f"{c['reported_low']:.4g}..{c['reported_high']:.4g}")
    typer.echo(f"wrote {paths['json']} and {paths['png']}")
    if not all(c["passed"] for c in checks):
        raise typer.Exit(1)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    app.command("plan")(plan_command)
    bench_app.command("planner")(bench_planner_command)
