"""``farlink bench pipeline``: data parallel vs a 2-stage pipeline vs compressed activations.

The same preset, data, batch (sequences per step), learning rate and warmup, with every peer
behind the same emulated link (in-process: each message is held for latency + bytes /
bandwidth of the named profile, ``home`` by default):

- ``data-parallel``: farlink's DDP, two workers each holding the whole model (no gradient
  clipping, like the pipeline), the reference where the model fits;
- ``pipeline``: the model in two stages on two peers, micro-batches through the pipeline
  trainer with fp32 activations;
- ``pipeline-<codec>``: the same with activations and their gradients compressed.

A per-peer memory cap (training state: 16 bytes per parameter) is checked before anything
runs: the cap is set, by default, between a stage's need and the whole model's, so the pipeline
fits where data parallel does not (data parallel still runs, uncapped, as the loss reference;
its row says it exceeds the cap). Tokens/s counts training wall-clock only (evaluations
excluded); bytes per token are the frames of activations and their gradients per trained token,
and the tied embedding's gradient exchange is reported on its own.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from farlink.bench.report import plot_curves, write_json
from farlink.bench.runner import run_variant


def _tied_stage_parameters(config, stages: int) -> list[int]:
    from farlink.parallel.stages import build_stage

    return [sum(p.numel() for p in build_stage(config, 0, s, stages).parameters())
            for s in range(stages)]


def run_pipeline(label: str, config, data, steps: int, batch_size: int, micro_batches: int,
                 codec: str, link, lr: float, warmup: int, eval_every: int, eval_batches,
                 memory_cap_mb: float, seed: int = 0) -> dict:
    from farlink.data import ShardSampler
    from farlink.parallel.peers import start_pipeline, stop_pipeline
    from farlink.parallel.pipeline import PipelineTrainer

    mbit, one_way_ms = link.bandwidth_mbit, link.hop_latency_ms  # as --emulate-link holds DP
    peers = start_pipeline(config, 2, seed=seed, lr=lr, link_mbit=mbit, link_ms=one_way_ms,
                           memory_cap_mb=memory_cap_mb)
    try:
        from farlink.comm.base import LinkModel

        addresses = [[p.address for p in stage] for stage in peers]
        trainer = PipelineTrainer(addresses, micro_batches=micro_batches, activation_codec=codec,
                                  lr=lr, warmup_steps=warmup, total_steps=steps,
                                  links={a: LinkModel.of(mbit, one_way_ms)
                                         for stage in addresses for a in stage})
        sampler = ShardSampler(data.train, 0, 1, config.seq_len, batch_size, seed)
        curve = [(0, trainer.evaluate(eval_batches))]
        train_s, tokens, losses = 0.0, 0, []
        for step in range(1, steps + 1):
            report = trainer.step(*sampler.next_batch())
            train_s += report.seconds
            tokens += report.tokens
            losses.append(report.loss)
            if step % eval_every == 0 or step == steps:
                curve.append((tokens, trainer.evaluate(eval_batches)))
        moved = trainer.bytes.get("activations", 0) + trainer.bytes.get("gradients", 0)
        return {
            "label": label, "codec": codec, "stages": 2, "micro_batches": micro_batches,
            "tokens": tokens, "final_heldout_loss": curve[-1][1], "curve": curve,
            "tokens_per_s": tokens / train_s, "train_s": train_s,
            "activation_bytes_per_token": moved / tokens,
            "tied_bytes_per_token": trainer.bytes.get("tied", 0) / tokens,
            "bytes_by_kind": dict(trainer.bytes), "final_train_loss": losses[-1],
        }
    finally:
        stop_pipeline(peers)


def run(out: Path, model: str = "tiny", steps: int = 150, batch_size: int = 8,
        micro_batches: int = 4, codecs: tuple[str, ...] = ("int8", "int4"),
        link_name: str = "home", lr: float = 3e-3, warmup: int = 20, eval_every: int = 25,
        memory_cap_mb: float | None = None, reuse: bool = False) -> dict:
    from farlink.data import heldout_batches, prepare_data
    from farlink.model import preset_config
    from farlink.parallel.stage_server import training_memory_bytes
    from farlink.links import get_profile

    torch.set_num_threads(1)
    link = get_profile(link_name)
    warmup = min(warmup, steps // 5)
    eval_every = min(eval_every, steps)
    base = {"model": model, "steps": steps, "algorithm": "ddp", "workers": 2,
            "batch_size": batch_size // 2, "lr": lr, "warmup_steps": warmup, "grad_clip": 0.0,
            "emulate_link": link_name, "eval_every": eval_every, "eval_batches": 4,
            "log_every": 1}
    dp = run_variant("data-parallel", base, out, reuse=reuse)
    cache = Path.home() / ".cache" / "farlink"
    data = prepare_data("kjv", 4096, cache)
    config = preset_config(model, vocab_size=data.vocab_size)
    full_mib = training_memory_bytes(config.num_parameters()) / 2**20
    stage_mib = [training_memory_bytes(n) / 2**20 for n in _tied_stage_parameters(config, 2)]
    cap = memory_cap_mb if memory_cap_mb is not None else (max(stage_mib) + full_mib) / 2
    # the held-out windows data parallel's workers evaluate on, so final losses compare
    eval_batches = heldout_batches(data.heldout, config.seq_len, base["batch_size"],
                                   base["eval_batches"])
    rows = [{"label": "data-parallel", "codec": "fp32", "stages": 1, "tokens": dp["tokens"],
             "final_heldout_loss": dp["final_heldout_loss"],
             # evaluations count one worker's tokens; the batch is both workers'
             "curve": [(e["tokens"] * dp["workers"], e["loss"]) for e in dp["evals"]],
             "tokens_per_s": dp["tokens"] / dp["wall_s"] if dp["wall_s"] else None,
             "bytes_per_token": dp["bytes_per_token"], "memory_mib_per_peer": full_mib,
             "fits_memory_cap": full_mib <= cap}]
    for codec in ("fp32", *codecs):
        label = "pipeline" if codec == "fp32" else f"pipeline-{codec}"
        started = time.time()
        row = run_pipeline(label, config, data, steps, batch_size, micro_batches, codec, link,
                           lr, warmup, eval_every, eval_batches, cap)
        row |= {"memory_mib_per_peer": max(stage_mib), "fits_memory_cap": max(stage_mib) <= cap,
                "wall_s": time.time() - started}
        rows.append(row)
    reference = rows[1]
    for row in rows[2:]:
        row["activation_bytes_reduction"] = (reference["activation_bytes_per_token"]
                                             / row["activation_bytes_per_token"])
        row["heldout_loss_vs_fp32"] = (row["final_heldout_loss"]
                                       / reference["final_heldout_loss"] - 1)
        row["meets_targets"] = (row["activation_bytes_reduction"] >= 4
                                and abs(row["heldout_loss_vs_fp32"]) <= 0.01)
    extra = {"model": model, "steps": steps, "batch_size": batch_size, "link": link_name,
             "emulation": "in-process (each message held for latency + bytes / bandwidth)",
             "memory_cap_mib": cap, "machine_note": "2 CPU cores shared with other jobs: "
             "tokens/s are relative, not absolute"}
    write_json(out / "pipeline.json", "pipeline", rows, extra)
    plot_curves(out / "pipeline_loss_vs_tokens.png",
                {r["label"]: [tuple(p) for p in r["curve"] if p[1] is not None] for r in rows},
                "tokens", "held-out loss",
                f"{model}: data parallel vs 2-stage pipeline, {link_name} links")
    return {"rows": rows, **extra}


def run_placement(out: Path, model: str = "tiny", steps: int = 8, batch_size: int = 8,
                  micro_batches: int = 4, sites: tuple[tuple[int, ...], ...] = ((0, 2), (1, 3)),
                  intra: str = "datacenter", inter: str = "home", randoms: int = 3,
                  seed: int = 0) -> dict:
    """Measured step time of the placement chosen from the link matrix against random ones.

    Four peers in two sites (``intra`` links inside a site, ``inter`` between); two pipelines
    of two stages, micro-batches wired to pipeline ``i % 2``. Every activation and gradient
    message is held for the matrix link between the peer that produced it and the one that
    takes it (in-process emulation; the tied-embedding exchange is not held). The first step
    is a warm-up and not timed.
    """
    from farlink.comm.base import LinkModel
    from farlink.data import ShardSampler, prepare_data
    from farlink.model import preset_config
    from farlink.parallel.peers import start_stage_peer, stop_pipeline
    from farlink.parallel.pipeline import PipelineTrainer
    from farlink.parallel.placement import (
        PipelineCost,
        evaluate,
        grouped_links,
        place,
        random_placements,
    )
    from farlink.links import get_profile

    torch.set_num_threads(1)
    fast, slow = get_profile(intra), get_profile(inter)
    groups = [list(s) for s in sites]
    links = grouped_links(groups, (fast.bandwidth_mbit, 2 * fast.hop_latency_ms),
                          (slow.bandwidth_mbit, 2 * slow.hop_latency_ms))
    data = prepare_data("kjv", 4096, Path.home() / ".cache" / "farlink")
    config = preset_config(model, vocab_size=data.vocab_size)
    rows_per_micro = batch_size // micro_batches
    cost = PipelineCost(activation_bytes=4 * rows_per_micro * config.seq_len * config.d_model,
                        micro_batches=micro_batches // 2)  # each pipeline takes half
    chosen = place(links, 2, cost)
    candidates = [("chosen", chosen)] + [
        (f"random-{k}", p) for k, p in enumerate(random_placements(links, 2, cost, randoms,
                                                                    seed=seed))]
    rows = []
    for label, placement in candidates:
        peers = [[start_stage_peer(config, s, 2, seed=seed) for s in range(2)]
                 for _ in placement.grid]
        try:
            identity = {peers[p][s].address: placement.grid[p][s]
                        for p in range(len(peers)) for s in range(2)}
            path_links = {(a, b): LinkModel.of(links.bandwidth_mbit[i][j],
                                               links.rtt_ms[i][j] / 2)
                          for a, i in identity.items() for b, j in identity.items() if i != j}
            pipelines = [[p.address for p in row] for row in peers]
            trainer = PipelineTrainer([[row[s] for row in pipelines] for s in range(2)],
                                      micro_batches=micro_batches, in_flight=micro_batches,
                                      pipelines=pipelines, path_links=path_links)
            sampler = ShardSampler(data.train, 0, 1, config.seq_len, batch_size, seed)
            reports = [trainer.step(*sampler.next_batch()) for _ in range(steps)]
        finally:
            stop_pipeline(peers)
        timed = reports[1:]
        rows.append({"label": label, "pipelines": [list(r) for r in placement.grid],
                     "predicted_link_step_s": evaluate(links, [i for r in placement.grid
                                                               for i in r], 2, cost).step_s,
                     "slowest_link_s": placement.slowest_link_s,
                     "measured_step_s": sum(r.seconds for r in timed) / len(timed)})
    best_random = min(r["measured_step_s"] for r in rows[1:])
    extra = {"sites": groups, "intra": intra, "inter": inter, "model": model,
             "chosen_vs_best_random": rows[0]["measured_step_s"] / best_random,
             "emulation": "in-process, per-pair links held at the relaying trainer",
             "machine_note": "2 CPU cores shared with other jobs"}
    write_json(out / "pipeline_placement.json", "pipeline placement", rows, extra)
    return {"rows": rows, **extra}
