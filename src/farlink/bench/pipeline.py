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

import os
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


def _finished_rows(path: Path, model: str, steps: int, batch_size: int, link: str) -> dict:
    """Rows of an earlier ``pipeline.json`` with the same settings, by label (``--reuse``: only
    the codecs it lacks are run). Each kept row says when it ran."""
    import json

    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if (earlier.get("model"), earlier.get("steps"), earlier.get("batch_size"),
            earlier.get("link")) != (model, steps, batch_size, link):
        return {}
    return {r["label"]: {"run_at": earlier["created"], **r} for r in earlier["rows"]}


def run(out: Path, model: str = "tiny", steps: int = 150, batch_size: int = 8,
        micro_batches: int = 4, codecs: tuple[str, ...] = ("int8", "int4"),
        link_name: str = "home", lr: float = 3e-3, warmup: int = 20, eval_every: int = 25,
        memory_cap_mb: float | None = None, reuse: bool = False, seq_len: int = 128) -> dict:
    from farlink.data import heldout_batches, prepare_data
    from farlink.links import get_profile
    from farlink.model import preset_config
    from farlink.parallel.stage_server import training_memory_bytes

    torch.set_num_threads(1)
    link = get_profile(link_name)
    warmup = min(warmup, steps // 5)
    eval_every = min(eval_every, steps)
    kept = _finished_rows(out / "pipeline.json", model, steps, batch_size, link_name) \
        if reuse else {}
    base = {"model": model, "seq_len": seq_len, "steps": steps, "algorithm": "ddp", "workers": 2,
            "batch_size": batch_size // 2, "lr": lr, "warmup_steps": warmup, "grad_clip": 0.0,
            "emulate_link": link_name, "eval_every": eval_every, "eval_batches": 4,
            "log_every": 1}
    dp = None if "data-parallel" in kept else run_variant("data-parallel", base, out,
                                                            reuse=reuse)
    cache = Path.home() / ".cache" / "farlink"
    data = prepare_data("kjv", 4096, cache)
    # the sequences data parallel trains on (a preset's own context may be longer): equal tokens
    config = preset_config(model, vocab_size=data.vocab_size, seq_len=seq_len)
    full_mib = training_memory_bytes(config.num_parameters()) / 2**20
    stage_mib = [training_memory_bytes(n) / 2**20 for n in _tied_stage_parameters(config, 2)]
    cap = memory_cap_mb if memory_cap_mb is not None else (max(stage_mib) + full_mib) / 2
    # the held-out windows data parallel's workers evaluate on, so final losses compare
    eval_batches = heldout_batches(data.heldout, config.seq_len, base["batch_size"],
                                   base["eval_batches"])
    rows = [kept.get("data-parallel") or {
        "label": "data-parallel", "codec": "fp32", "stages": 1, "tokens": dp["tokens"],
        "final_heldout_loss": dp["final_heldout_loss"],
        # evaluations count one worker's tokens; the batch is both workers'
        "curve": [(e["tokens"] * dp["workers"], e["loss"]) for e in dp["evals"]],
        "tokens_per_s": dp["tokens"] / dp["wall_s"] if dp["wall_s"] else None,
        "bytes_per_token": dp["bytes_per_token"], "memory_mib_per_peer": full_mib,
        "fits_memory_cap": full_mib <= cap}]
    for codec in ("fp32", *codecs):
        label = "pipeline" if codec == "fp32" else f"pipeline-{codec}"
        if label in kept:
            rows.append(kept[label])
            continue
        started, load = time.time(), os.getloadavg()
        row = run_pipeline(label, config, data, steps, batch_size, micro_batches, codec, link,
                           lr, warmup, eval_every, eval_batches, cap)
        row |= {"memory_mib_per_peer": max(stage_mib), "fits_memory_cap": max(stage_mib) <= cap,
                "wall_s": time.time() - started, "run_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "load_average_before": load, "load_average_after": os.getloadavg()}
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


def measured_stage_compute_s(config, micro_rows: int, stages: int = 2, seed: int = 0,
                             repeats: int = 5) -> float:
    """Seconds of one micro-batch's forward + backward through the slowest stage, timed here
    (the fastest of ``repeats``: on shared cores the other jobs only ever add time): the
    ``stage_compute_s`` the placement cost model needs. A floor: the stage peers share cores."""
    from farlink.parallel.stages import build_stage

    tokens = torch.randint(0, config.vocab_size, (micro_rows, config.seq_len))
    slowest = 0.0
    for s in range(stages):
        stage = build_stage(config, seed, s, stages)
        x = tokens if s == 0 else torch.randn(micro_rows, config.seq_len, config.d_model,
                                              requires_grad=True)
        timings = []
        for _ in range(repeats + 1):  # the first is a warm-up
            started = time.perf_counter()
            out = stage.loss(x, tokens) if s == stages - 1 else stage(x).sum()
            out.backward()
            timings.append(time.perf_counter() - started)
        slowest = max(slowest, min(timings[1:]))
    return slowest


def _plot_placements(path: Path, rows: list[dict], title: str) -> None:
    from farlink.bench.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for k, row in enumerate(rows):
        x, color = row["predicted_step_s"], f"C{k}"
        ax.scatter([x] * len(row["measured_step_s_trials"]), row["measured_step_s_trials"],
                   alpha=0.35, color=color)
        ax.scatter([x], [row["measured_step_s"]], marker="D", s=60, color=color,
                   label=f"{row['label']} {row['pipelines']}")
    top = max(max(r["measured_step_s_trials"] + [r["predicted_step_s"]]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], color="gray", linestyle="--", linewidth=1,
            label="measured = predicted")
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("measured step time (s): trials, median as a diamond")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_placement(out: Path, model: str = "tiny", trials: int = 3, steps: int = 2,
                  batch_size: int = 8, micro_batches: int = 4,
                  sites: tuple[tuple[int, ...], ...] = ((0, 2), (1, 3)),
                  intra: str = "datacenter", inter: str = "dsl", randoms: int = 3,
                  link_matrix: Path | None = None, seed: int = 0) -> dict:
    """Measured step time of the placement chosen from the link matrix against random ones.

    Four peers, two pipelines of two stages, micro-batch ``i`` wired to pipeline ``i % 2``.
    The matrix is two sites (``sites``: ``intra`` links inside a site, ``inter`` between) or a
    file (``link_matrix``, 4 peers, the form ``LinkMatrix.to_json`` writes). ``place()`` gets
    that matrix and a cost with the stage compute timed here; the random placements are drawn
    with site patterns (which site serves which stage of which pipeline) other than the
    chosen one's and each other's, so none is the chosen one relabelled.

    The same four stage processes serve every placement: a placement only decides which matrix
    peer each process stands for, and every activation and gradient message is held for the
    link between the peers that produce and take it, on a shared wire per ordered pair
    (:class:`~farlink.emulate.ShapedLink`: concurrent micro-batches on one link queue). Each
    trial runs every placement once, the chosen one first in odd trials and last in even ones;
    each run times ``steps`` steps after an untimed warm-up step; medians over trials.
    """
    import json
    import statistics

    from farlink.comm.linkprobe import LinkMatrix
    from farlink.data import ShardSampler, prepare_data
    from farlink.emulate.shaper import ShapedLink
    from farlink.links import LinkProfile, get_profile
    from farlink.model import preset_config
    from farlink.parallel.peers import start_pipeline, stop_pipeline
    from farlink.parallel.pipeline import PipelineTrainer
    from farlink.parallel.placement import (
        PipelineCost,
        distinct_random_placements,
        grouped_links,
        place,
        site_pattern,
        step_seconds,
    )

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    if link_matrix is not None:
        links = LinkMatrix.from_json(json.loads(Path(link_matrix).read_text()))
        site_of = None
        if len(links.bandwidth_mbit) != 4:
            raise ValueError(f"{link_matrix}: the placement bench runs 4 peers (2 pipelines x "
                             f"2 stages); the matrix has {len(links.bandwidth_mbit)}")
    else:
        fast, slow = get_profile(intra), get_profile(inter)
        links = grouped_links([list(s) for s in sites],
                              (fast.up_mbit, 2 * fast.hop_latency_ms),
                              (slow.up_mbit, 2 * slow.hop_latency_ms))
        site_of = {i: k for k, group in enumerate(sites) for i in group}
    data = prepare_data("kjv", 4096, Path.home() / ".cache" / "farlink")
    config = preset_config(model, vocab_size=data.vocab_size)
    rows_per_micro = batch_size // micro_batches
    compute_s = measured_stage_compute_s(config, rows_per_micro, seed=seed)
    cost = PipelineCost(activation_bytes=4 * rows_per_micro * config.seq_len * config.d_model,
                        stage_compute_s=compute_s,
                        micro_batches=micro_batches // 2)  # each pipeline takes half
    chosen = place(links, 2, cost)
    others = distinct_random_placements(links, 2, cost, chosen, randoms, seed, site_of)
    candidates = [("chosen", chosen)] + [(f"random-{k}", p) for k, p in enumerate(others)]
    measured: dict[str, list[float]] = {label: [] for label, _ in candidates}

    def shaped(i: int, j: int) -> ShapedLink:
        return ShapedLink(LinkProfile(name=f"{i}->{j}", bandwidth_mbit=links.bandwidth_mbit[i][j],
                                      latency_ms=links.rtt_ms[i][j] / 2))

    peers = start_pipeline(config, 2, peers_per_stage=2, seed=seed)
    try:
        processes = [[p.address for p in stage] for stage in peers]  # [stage][k]
        sampler = ShardSampler(data.train, 0, 1, config.seq_len, batch_size, seed)
        for trial in range(trials):
            order = candidates if trial % 2 == 0 else candidates[1:] + candidates[:1]
            for label, placement in order:
                # process k of stage s stands for matrix peer grid[k][s]
                identity = {processes[s][k]: placement.grid[k][s]
                            for k in range(len(placement.grid)) for s in range(2)}
                path_links = {(a, b): shaped(i, j) for a, i in identity.items()
                              for b, j in identity.items() if i != j}
                trainer = PipelineTrainer(processes, micro_batches=micro_batches,
                                          in_flight=micro_batches,
                                          pipelines=[[processes[s][k] for s in range(2)]
                                                     for k in range(len(placement.grid))],
                                          path_links=path_links)
                reports = [trainer.step(*sampler.next_batch()) for _ in range(steps + 1)]
                measured[label].append(statistics.median(r.seconds for r in reports[1:]))
    finally:
        stop_pipeline(peers)
    no_compute = PipelineCost(cost.activation_bytes, 0.0, cost.micro_batches)
    rows = []
    for label, placement in candidates:
        rows.append({
            "label": label, "pipelines": [list(r) for r in placement.grid],
            "site_pattern": [list(r) for r in site_pattern(placement.grid, site_of)],
            "predicted_step_s": placement.step_s,
            "predicted_link_step_s": step_seconds(links, placement.grid, no_compute)[0],
            "slowest_link_s": placement.slowest_link_s,
            "measured_step_s": statistics.median(measured[label]),
            "measured_step_s_trials": measured[label]})
    best_random = min((r["measured_step_s"] for r in rows[1:]), default=None)
    ratio = rows[0]["measured_step_s"] / best_random if best_random else None
    extra = {"model": model, "batch_size": batch_size, "micro_batches": micro_batches,
             "trials": trials, "timed_steps_per_trial": steps,
             "activation_bytes": cost.activation_bytes, "stage_compute_s": compute_s,
             "matrix": links.to_json(),
             **({"link_matrix_file": str(link_matrix)} if link_matrix is not None else
                {"sites": [list(s) for s in sites], "intra": intra, "inter": inter}),
             "chosen_vs_best_random": ratio,
             "trials_chosen_fastest": sum(
                 measured["chosen"][t] < min(v[t] for k, v in measured.items() if k != "chosen")
                 for t in range(trials)) if len(measured) > 1 else None,
             "emulation": "in-process: each relayed message held on a shared wire per ordered "
                          "pair of matrix peers (latency + queued bytes / bandwidth)",
             "load_average_before": load_before, "load_average_after": os.getloadavg(),
             "machine_note": "2 CPU cores shared with other jobs"}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "pipeline_placement.json", "pipeline placement", rows, extra)
    _plot_placements(out / "pipeline_placement.png", rows,
                     f"{model}: chosen vs random placements, {trials} trials "
                     f"(load {load_before[0]:.1f})")
    return {"rows": rows, **extra}
