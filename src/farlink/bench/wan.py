"""``farlink bench wan --profile NAME``: DDP, DiLoCo, Streaming DiLoCo, SparseLoCo and DeMo on one
emulated wide-area link, same token budget, side by side.

Where the machine allows it (root, namespaces, tc, NFQUEUE), every variant runs with each worker in
its own network namespace behind the profile's shaped, delayed link and the Lighthouse in the
router namespace: real packets on a real (emulated) WAN. Elsewhere it falls back, with a message,
to in-process emulation (every collective is held for ``hops x latency + bytes / bandwidth`` on
top of the loopback transfer). The report names the emulation used. It reports per worker:
compute utilization (inner compute / all of the worker's wall-clock: setup, rounds, evaluation
and checkpoints count against it), bytes sent
per token, wall-clock, held-out loss, and the peak bytes a single round put on the wire
(Streaming DiLoCo's point: about 1/P of DiLoCo's).
"""

from __future__ import annotations

import time
from pathlib import Path

from farlink.bench.report import plot_curves, write_json
from farlink.bench.runner import run_variant
from farlink.links import LinkProfile
from farlink.train.metrics import read_metrics


def peak_round_bytes(run_dir: Path, in_background: bool = False) -> int:
    """Largest number of bytes one worker sent in a single round: what the sync step's record
    adds to the step's before it, or, for rounds sent ``in_background`` (an outer step off the
    critical path, whose bytes go out during the next phase's steps), what one sync record adds
    to the previous sync record."""
    records = [r for r in read_metrics(run_dir / "metrics" / "w0.jsonl")
               if r["kind"] in ("step", "sync")]
    peak, previous = 0, 0
    for r in records:
        if r["kind"] == "sync":
            peak = max(peak, r["bytes_sent"] - previous)
        if r["kind"] == "sync" or not in_background:
            previous = r["bytes_sent"]
    return peak


def run_load(run_dir: Path, started: float, load_start: list[float]) -> dict:
    """The machine's load average at the start and end of the run in ``run_dir`` (the machine
    may be shared, so its timings are read beside the load). Kept in the run's directory when the
    run trains now (its summary is newer than ``started``), so ``--reuse`` reports the load the
    run was measured under, not the load while it is read back."""
    import json
    import os

    path = run_dir / "bench_load.json"
    summary = run_dir / "summary.json"
    if not path.is_file() or (summary.is_file() and summary.stat().st_mtime >= started):
        path.write_text(json.dumps({"start": load_start,
                                    "end": [round(x, 2) for x in os.getloadavg()]}))
    return json.loads(path.read_text())


def variants(inner_steps: int, fragments: int,
             overlap_steps: int | None = None,
             outer_overlap: str = "none") -> list[tuple[str, dict]]:
    """The benchmark's runs. Streaming DiLoCo overlaps each fragment's exchange with
    ``overlap_steps`` inner steps (default: about half the steps between fragment syncs, less
    one); an exchange longer than that many steps shows as time blocked. With ``outer_overlap``
    (delayed or eager) DiLoCo int4 with error feedback runs with its outer step one round late,
    its whole exchange beside the next round's compute."""
    if overlap_steps is None:
        overlap_steps = max(1, inner_steps // (2 * fragments) - 1)
    off_path = [] if outer_overlap == "none" else [
        (f"diloco-H{inner_steps}-int4-{outer_overlap}",
         {"algorithm": "diloco", "codec": "int4+ef", "outer_overlap": outer_overlap})]
    return off_path + [
        ("ddp", {"algorithm": "ddp", "log_every": 1}),
        (f"diloco-H{inner_steps}", {"algorithm": "diloco"}),
        (f"diloco-H{inner_steps}-int8", {"algorithm": "diloco", "codec": "int8"}),
        (f"streaming-H{inner_steps}-P{fragments}-int4",
         {"algorithm": "streaming_diloco", "codec": "int4+ef", "fragments": fragments,
          "overlap_steps": overlap_steps}),
        (f"sparseloco-H{inner_steps}", {"algorithm": "sparseloco"}),
        ("demo", {"algorithm": "demo", "log_every": 1}),
    ]


def choose_emulation(requested: str) -> tuple[str, str]:
    """("netns" or "inprocess", why): namespaces when asked or when ``auto`` finds them usable."""
    if requested == "inprocess":
        return "inprocess", "requested"
    from farlink.emulate import detect_capabilities

    caps = detect_capabilities()
    if caps.full:
        return "netns", "namespaces, tc and NFQUEUE available"
    if requested == "netns":
        raise SystemExit(f"network namespace emulation unavailable: {caps.reason}")
    return "inprocess", caps.reason


def run(out: Path, profile: str, steps: int, inner_steps: int, workers: int, fragments: int,
        only: list[str] | None = None, emulation: str = "auto",
        bandwidth_mbit: float | None = None, reuse: bool = False,
        overlap_steps: int | None = None, outer_overlap: str = "none") -> dict:
    import os

    from rich.console import Console

    from farlink.links import get_profile, scaled

    link = scaled(profile, bandwidth_mbit) if bandwidth_mbit else get_profile(profile)
    mode, why = choose_emulation(emulation)
    if mode == "inprocess" and emulation == "auto":
        Console(stderr=True).print(f"[yellow]namespaces not usable ({why}); emulating the link "
                                   "in-process on loopback instead[/]")
    if mode == "inprocess" and bandwidth_mbit:
        raise SystemExit("--bandwidth-mbit applies to namespace emulation only")
    base = {"workers": workers, "steps": steps, "inner_steps": inner_steps, "eval_batches": 8,
            "emulate_link": profile if mode == "inprocess" else None}
    rows = []
    for label, overrides in variants(inner_steps, fragments, overlap_steps, outer_overlap):
        if only and not any(o in label for o in only):
            continue
        run_label = f"{link.name}-{label}"
        load_start = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared
        started = time.time()
        if mode == "netns":
            from farlink.emulate import Topology

            with Topology(workers, link) as network:
                row = run_variant(run_label, base, out, reuse=reuse, network=network, **overrides)
        else:
            row = run_variant(run_label, base, out, reuse=reuse, **overrides)
        row["profile"] = link.name
        row["load_average_1_5_15_min"] = run_load(out / "runs" / run_label, started, load_start)
        row["outer_overlap"] = overrides.get("outer_overlap", "none")
        row["peak_round_bytes"] = peak_round_bytes(out / "runs" / run_label,
                                                   "outer_overlap" in overrides)
        row["utilization_per_worker"] = {w: round(v["compute_utilization"], 3)
                                         for w, v in row["per_worker"].items()}
        # process start to first step, as a share of the worker's whole wall-clock
        row["setup_share_per_worker"] = {w: round(v["setup_s"] / max(v["wall_s"], 1e-9), 4)
                                         for w, v in row["per_worker"].items()}
        row["time_per_worker"] = {w: {k: round(v.get(k, 0.0), 2) for k in (
            "wall_s", "compute_s", "comm_s", "eval_s", "checkpoint_s", "setup_s")}
            for w, v in row["per_worker"].items()}
        rows.append(row)
    described = (f"network namespaces: each worker behind a veth with tc tbf at "
                 f"{link.bandwidth_mbit:g} Mbit/s and {link.latency_ms:g} ms one-way delay "
                 "(NFQUEUE), Lighthouse in the router namespace, WAN-tuned TCP (buffers for the "
                 "bandwidth-delay product, no slow start after idle)" if mode == "netns" else
                 "in-process: collectives held for latency + bytes/bandwidth of the profile "
                 f"(network namespaces not used: {why})")
    validation = validate_planner(rows, link, out / "runs")
    from farlink.plan.validate import write_validation_report

    write_validation_report(validation["measured"], validation["predicted"], out,
                            ("round_seconds", "utilization"),
                            stem=f"planner_validation-{link.name}",
                            inputs={k: validation[k] for k in ("measured", "predicted", "method")})
    write_json(out / f"wan-{link.name}.json", "wan",
               [{k: v for k, v in r.items() if k != "per_worker"} for r in rows],
               {"profile": link.name, "emulation": described, "emulation_mode": mode,
                "planner_validation": validation})
    plot_curves(out / f"wan-{link.name}-loss_vs_wall.png",
                {r["label"]: [(e["wall_s"], e["loss"]) for e in r["evals"]] for r in rows},
                "wall-clock (s)", "held-out loss", f"{link.name} ({mode} emulation)")
    return {"rows": rows, "planner_validation": validation, "emulation": mode}


def validate_planner(rows: list[dict], link: LinkProfile, runs_dir: Path) -> dict:
    """The planner against each measured run's steady-state rounds (after the first, which pays
    process-group setup), from the run's own measured inputs: mean step time, straggler spread,
    per-sync local work and model size, plus the link profile the runs were emulated on (the same
    object the planner prices by name). Predicted vs measured round time and utilization,
    relative errors. A method the planner has no model of (``planned`` false in its
    capabilities, e.g. SparseLoCo's own exchange) keeps its measured rounds and is marked
    ``not_planned`` with the reason instead of failing the benchmark."""
    from farlink.bench.rounds import steady_rounds
    from farlink.model import preset_config
    from farlink.plan import PlanInputError, predict_round
    from farlink.plan.validate import compare
    from farlink.sync import capabilities

    n_params = preset_config("tiny").num_parameters()
    measured, predicted = [], []
    for r in rows:
        caps = capabilities(r["algorithm"])
        steps_per_round = 1 if caps.syncs_every_step else r["inner_steps"]
        syncs = r.get("fragments", 1) if caps.fragments else 1
        try:
            steady = steady_rounds(runs_dir / r["label"], steps_per_round, syncs)
        except ValueError as exc:
            measured.append({"name": r["label"], "label": r["label"], "skipped": str(exc)})
            predicted.append({"name": r["label"], "label": r["label"]})
            continue
        measured.append({"name": r["label"], "label": r["label"], **steady.to_dict(),
                         **({"load_average_1_5_15_min": r["load_average_1_5_15_min"]}
                            if "load_average_1_5_15_min" in r else {})})
        if not caps.planned:
            predicted.append({"name": r["label"], "label": r["label"], "not_planned":
                              f"the planner has no model of {r['algorithm']}'s exchange"})
            continue
        codec = r.get("wire_spec", r["codec"]).removesuffix("+ef")  # DeMo's, SparseLoCo's own
        codec = "fp32" if codec == "none" else codec
        try:
            pred = predict_round(
                r["algorithm"], r["workers"], steady.step_seconds, link.bandwidth_bps,
                link.latency_s, jitter_s=link.jitter_s, loss=link.loss, n_params=n_params,
                inner_steps=r["inner_steps"], codec=codec, fragments=r.get("fragments", 1),
                overlap_steps=r.get("overlap_steps"), straggler_sigma=steady.straggler_sigma,
                local_seconds=steady.local_seconds, outer_overlap=r.get("outer_overlap", "none"))
        except PlanInputError as exc:
            predicted.append({"name": r["label"], "label": r["label"], "not_planned": str(exc)})
            continue
        predicted.append({"name": r["label"], "label": r["label"],
                          "round_seconds": pred.round_seconds,
                          "utilization": pred.utilization,
                          "comm_seconds": pred.comm_seconds})
    result = compare(measured, predicted, ("round_seconds", "utilization"))
    return {"measured": measured, "predicted": predicted, "errors": result,
            "method": "steady-state rounds (the first round left out); planner fed the run's "
                      "mean step time, straggler spread and per-sync local seconds"}
