"""``farlink bench ...`` subcommands that drive training runs."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):  # per-worker figures: one compact column
        return " / ".join(_cell(v) for v in value.values())
    return str(value)


def print_rows(rows: list[dict], columns: list[str], title: str) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*(_cell(r.get(c)) for c in columns))
    Console().print(table)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.callback()
    def needs_plots() -> None:
        """Every benchmark ends in PNGs: without the plots extra, say so before running any."""
        from farlink.extras import require

        require("matplotlib", "farlink bench (its PNG plots)")

    @bench_app.command("algorithms")
    def algorithms(
        out: Path = typer.Option(Path("bench/algorithms"), help="output directory"),
        steps: int = typer.Option(600, help="inner steps per worker (the token budget)"),
        inner_steps: int = typer.Option(100, help="H for the local-update algorithms"),
        workers: int = typer.Option(4, help="worker processes"),
        only: list[str] | None = typer.Option(
            None, help="run only labels containing this (=LABEL: exactly this label)"),
        reuse: bool = typer.Option(False, help="read back finished runs of the same config"),
    ) -> None:
        """Every algorithm and codec for the same token budget: loss vs tokens and vs bytes."""
        from farlink.bench.algorithms import run

        result = run(out, steps, inner_steps, workers, only, reuse)
        print_rows(result["rows"], ["label", "final_heldout_loss", "loss_vs_ddp",
                                    "bytes_per_worker", "bytes_reduction_vs_ddp",
                                    "compute_utilization", "wall_s"], "farlink bench algorithms")

    @bench_app.command("scale")
    def scale(
        out: Path = typer.Option(Path("docs/results"), help="output directory"),
        peers: list[int] = typer.Option([4, 8, 16, 32], help="peer counts (threads)"),
        codec: list[str] = typer.Option(["fp32", "int8+ef", "int4+ef", "sparseloco"],
                                        help="fp32, int8+ef, int4+ef, sparseloco"),
        rule: list[str] = typer.Option(["mean", "centered_clip+auth"],
                                       help="mean, centered_clip+auth"),
        steps: int = typer.Option(20, help="inner steps per peer (the token budget)"),
        inner_steps: int = typer.Option(10, help="inner steps per round"),
        baseline_peers: list[int] = typer.Option(
            [4, 16], help="peer counts also run on today's gathered path"),
        link_mbit: float = typer.Option(100.0, help="emulated upload per peer, Mbit/s"),
        link_ms: float = typer.Option(10.0, help="emulated one-way latency, ms"),
        name: str = typer.Option("scale", help="the output files' name (NAME.json, NAME.png)"),
    ) -> None:
        """Bytes per peer per round, round time, utilization and loss from 4 to 32 peers."""
        from farlink.bench.scale import CODECS, RULES, run as run_scale
        from farlink.comm.base import LinkModel

        for option, known in (("codec", CODECS), ("rule", RULES)):
            unknown = set(codec if option == "codec" else rule) - set(known)
            if unknown:
                raise typer.BadParameter(f"unknown {option} {sorted(unknown)}; choose from "
                                         f"{', '.join(known)}")
        result = run_scale(out, peers, codec, rule, steps, inner_steps, baseline_peers,
                           LinkModel.of(link_mbit, link_ms), name=name)
        print_rows(result["rows"], ["codec", "rule", "peers", "path",
                                    "bytes_per_peer_per_round", "ratio_to_ideal",
                                    "bytes_vs_gathered", "round_s", "utilization",
                                    "heldout_loss", "loss_vs_gathered"], "farlink bench scale")

    @bench_app.command("scale-netns")
    def scale_netns(
        out: Path = typer.Option(Path("docs/results"), help="output directory"),
        runs_dir: Path = typer.Option(Path("bench/scale-netns-shared"), help="the runs"),
        peers: list[int] = typer.Option([4, 8], help="peer counts (processes)"),
        codec: list[str] = typer.Option(["fp32", "int8+ef", "int4+ef", "sparseloco"],
                                        help="fp32, int8+ef, int4+ef, sparseloco"),
        rule: list[str] = typer.Option(["mean", "centered_clip"], help="mean, centered_clip "
                                       "(dense codecs only; no --auth inside namespaces)"),
        link: str = typer.Option("datacenter", help="every worker's own link (profile)"),
        link_mbit: float = typer.Option(50.0, help="its rate, Mbit/s"),
        shared: str = typer.Option("shared-20mbit", help="the bottleneck every upload crosses"),
        unshared: list[str] = typer.Option(["fp32", "int8+ef"], help="codecs also run (with "
                                           "mean) on their own links alone"),
        short_rounds: int = typer.Option(1, help="rounds of the shorter run"),
        long_rounds: int = typer.Option(3, help="rounds of the longer run"),
        inner_steps: int = typer.Option(5, help="inner steps per round"),
        name: str = typer.Option("scale_netns", help="NAME.json, NAME.png"),
    ) -> None:
        """Kernel-counted bytes per peer per round, round time, utilization and loss with the
        peers as processes in network namespaces behind a shared bottleneck (root)."""
        from farlink.bench.scale import CODECS
        from farlink.bench.scale_netns import RULES, run as run_netns
        from farlink.links import scaled

        for option, given, known in (("codec", codec + unshared, CODECS), ("rule", rule, RULES)):
            unknown = set(given) - set(known)
            if unknown:
                raise typer.BadParameter(f"unknown {option} {sorted(unknown)}; choose from "
                                         f"{', '.join(known)}")
        if not 0 < short_rounds < long_rounds:
            raise typer.BadParameter("need 0 < --short-rounds < --long-rounds")
        result = run_netns(out, runs_dir, peers, codec, rule, (short_rounds, long_rounds),
                           scaled(link, link_mbit), shared, unshared, inner_steps, name)
        print_rows(result["rows"], ["codec", "rule", "peers", "shared", "path",
                                    "kernel_bytes_per_peer_per_round",
                                    "counted_bytes_per_peer_per_round", "kernel_vs_counted",
                                    "counted_vs_ideal", "exchange_s", "round_s", "utilization",
                                    "heldout_loss"], "farlink bench scale-netns")
        print(result["uptime"])

    @bench_app.command("scale-planner")
    def scale_planner(
        out: Path = typer.Option(Path("docs/results"), help="output directory"),
        peers: list[int] = typer.Option([4, 8], help="peer counts (threads)"),
        codec: list[str] = typer.Option(["int8+ef", "int4+ef", "fp16"], help="dense codecs"),
        rule: list[str] = typer.Option(["mean", "centered_clip+auth"],
                                       help="mean, centered_clip+auth"),
        profile: str = typer.Option("shared-20mbit", help="link profile (a shared one: every "
                                    "peer's bytes cross it)"),
        rounds: int = typer.Option(6, help="rounds per variant (the first is not counted)"),
        name: str = typer.Option("planner_validation-scale", help="NAME.json, NAME.png"),
        netns: bool = typer.Option(False, help="instead: torchft workers as processes in "
                                   "network namespaces (root), bytes by the kernel's counters"),
        netns_profile: str = typer.Option("cross-region", help="--netns: link profile"),
        netns_mbit: float = typer.Option(50.0, help="--netns: its rate, Mbit/s"),
        runs_dir: Path = typer.Option(Path("bench/scale-netns"), help="--netns: the runs"),
    ) -> None:
        """The planner's compressed all-reduce against emulation: round time, bytes."""
        from farlink.bench.scale_planner import RULES, run as run_validation

        if netns:
            import json

            from farlink.bench.scale_planner import measure_netns, netns_report

            found = [measure_netns(n, (2, 4), netns_profile, netns_mbit, runs_dir)
                     for n in peers]
            (out / f"{name}-netns-raw.json").write_text(json.dumps(found, indent=1))
            result = netns_report(found, out, f"{name}-netns")
            for key, stats in result["metrics"].items():
                print(f"{key}: median |error| {100 * stats['median_abs_relative_error']:.2f}%")
            return

        unknown = set(rule) - set(RULES)
        if unknown:
            raise typer.BadParameter(f"unknown rule {sorted(unknown)}; choose from "
                                     f"{', '.join(RULES)}")
        result = run_validation(out, peers, codec, rule, profile, rounds, name)
        for key, stats in result["metrics"].items():
            print(f"{key}: median |error| {100 * stats['median_abs_relative_error']:.2f}%, "
                  f"max {100 * stats['max_abs_relative_error']:.2f}% over {stats['n']} runs")

    @bench_app.command("probe")
    def probe(
        out: Path = typer.Option(Path("bench/algorithms"), help="output directory"),
        steps: int = typer.Option(150, help="inner steps per worker (the token budget)"),
        inner_steps: int = typer.Option(15, help="H for the local-update algorithms"),
        workers: int = typer.Option(4, help="workers (threads of one process)"),
        only: list[str] | None = typer.Option(None, help="run only these labels"),
        warmup_steps: int = typer.Option(10, help="inner lr warmup"),
        outer_lr: float | None = typer.Option(None, help="outer lr of the selected variants"),
        tag: str = typer.Option("", help="appended to the selected variants' labels"),
    ) -> None:
        """Frontier candidates with the workers as threads of one process (cheap sweeps)."""
        from farlink.bench.algorithms import probe as run_probe

        extra = {"warmup_steps": warmup_steps, "eval_batches": 8}
        if outer_lr is not None:
            extra["outer_lr"] = outer_lr
        result = run_probe(out, steps, inner_steps, workers, only, extra, tag)
        print_rows(result["rows"], ["label", "final_heldout_loss", "loss_vs_ddp",
                                    "bytes_per_token", "bytes_per_token_reduction_vs_ddp"],
                   "farlink bench probe")

    @bench_app.command("frontier")
    def frontier(
        out: Path = typer.Option(Path("bench/frontier"), help="output directory"),
        steps: int = typer.Option(400, help="inner steps per worker of each final run"),
        sweep_steps: int = typer.Option(150, help="inner steps per worker of each sweep run"),
        inner_steps: int = typer.Option(10, help="H for the local-update methods"),
        workers: int = typer.Option(4, help="workers (threads of one process)"),
        model: str = typer.Option("nano", help="model preset"),
        batch_size: int = typer.Option(8, help="sequences per step per worker"),
        seq_len: int = typer.Option(64, help="tokens per sequence"),
        warmup_steps: int = typer.Option(20, help="inner lr warmup"),
        eval_batches: int = typer.Option(32, help="held-out batches per evaluation"),
        sparseloco_topk: list[int] = typer.Option(
            [64, 32], help="SparseLoCo densities to place (entries kept per 4096)"),
        longer_h: list[int] = typer.Option(
            [], help="also SparseLoCo and DiLoCo int4 with Muon inside at this H (repeatable): "
                     "fewer rounds, fewer bytes, at the lrs swept at --inner-steps"),
        only: list[str] | None = typer.Option(None, help="run only these method labels"),
        reuse: bool = typer.Option(False, help="read back finished runs of the same config"),
        ablations: bool = typer.Option(
            False, help="then DiLoCo at H/2 and 2H, plain averaging and one worker alone, to "
                        "explain DiLoCo's gap to DDP"),
        seeds: int = typer.Option(1, min=1, help="seeds of every final run (mean and range)"),
        profile: list[str] | None = typer.Option(
            None, help="link profiles to price time-to-loss on (datacenter, cross-region, "
                       "intercontinental, home): measured curves and compute, planned links"),
    ) -> None:
        """Loss vs bytes per token for every method, each at lrs picked by a small sweep."""
        from farlink.bench.frontier import ablations as ablation_runs
        from farlink.bench.frontier import methods, run

        base = {"model": model, "workers": workers, "steps": steps, "batch_size": batch_size,
                "seq_len": seq_len, "warmup_steps": warmup_steps, "eval_batches": eval_batches}
        result = run(out, base, sweep_steps, inner_steps,
                     method_list=methods(sparseloco_topk, longer_h), only=only, reuse=reuse,
                     seeds=seeds, profiles=tuple(profile or ()),
                     ablation_list=ablation_runs(inner_steps) if ablations else None)
        print_rows(result["rows"], ["label", "lrs_from_sweep", "final_heldout_loss",
                                    "loss_vs_ddp", "bytes_per_token",
                                    "bytes_per_token_reduction_vs_ddp", "pareto"],
                   "farlink bench frontier")
        if result["ablations"]:
            print_rows(result["ablations"], ["label", "final_heldout_loss", "loss_vs_ddp"],
                       "ablations (not on the frontier)")
        for name, target in result["targets"].items():
            print(f"{name}: {'met' if target['met'] else 'NOT met'} ({target['goal']})")
        if "time_to_loss" in result:
            from farlink.bench.time_to_loss import summary

            print("\n".join(summary(result["time_to_loss"])))

    @bench_app.command("time-to-loss")
    def time_to_loss_priced(
        source: list[Path] = typer.Option(
            [Path("docs/results/frontier-seeds.json"), Path("docs/results/frontier-targets.json")],
            "--from", help="frontier result JSONs whose rows (loss curves) to price"),
        price_at: str = typer.Option("125m,1b", help="model sizes to price at, comma-separated"),
        out: Path = typer.Option(Path("docs/results"), help="output directory"),
        name: str = typer.Option("frontier-time-to-loss", help="file name stem"),
        profile: list[str] | None = typer.Option(None, help="link profiles (default: all four)"),
        gpu: str = typer.Option("h100", help="GPU of the planner's compute model"),
        gpus_per_worker: int | None = typer.Option(None, help="default: the GPU table's"),
        mfu: float = typer.Option(0.4, help="model FLOP utilization"),
        batch_tokens: int = typer.Option(2**20, help="tokens per worker per inner step"),
    ) -> None:
        """Time to each frontier target at a larger model, priced by the planner from the
        measured loss curves (no run is repeated; assumes the steps to each target carry
        over)."""
        from farlink.bench.time_to_loss import PROFILES, summary, write_priced

        results = write_priced(out, name, source, [s.strip() for s in price_at.split(",")],
                               tuple(profile or PROFILES), gpu=gpu,
                               gpus_per_worker=gpus_per_worker, mfu=mfu,
                               batch_tokens=batch_tokens)
        for size, result in results.items():
            print(f"-- {size}: {result['priced_at']['compute_s_per_step']:.3f} s per inner "
                  f"step planned; {result['assumes']}")
            print("\n".join(summary(result)))

    @bench_app.command("gpu")
    def gpu(
        out: Path = typer.Option(Path("bench/gpu"), help="output directory"),
        batch_size: int = typer.Option(16, help="sequences of 1024 tokens per step (125m)"),
        steps: int = typer.Option(20, help="timed inner steps of the step measurement"),
        worker_steps: int = typer.Option(30, "--worker-steps", "--site-steps",
                                         help="inner steps of each farlink train run"),
        loss_steps: int = typer.Option(100, help="inner steps of the CPU/GPU loss comparison"),
        peak_tflops: float | None = typer.Option(
            None, help="the GPU's dense bf16 peak, for a model farlink does not know"),
    ) -> None:
        """Tokens/s and MFU of the 125m preset in bf16 on one GPU (1 and 2 workers), and
        DiLoCo's loss on the GPU (bf16) against the CPU (fp32). Needs a CUDA device."""
        from farlink.bench.gpu import NoGpu, run

        try:
            result = run(out, batch_size, steps, worker_steps, loss_steps,
                         peak_tflops=peak_tflops)
        except NoGpu as exc:
            typer.secho(f"error: {exc}", fg="red", err=True)
            raise typer.Exit(2) from None
        print_rows(result["rows"], ["label", "tokens_per_s", "mfu", "n_params"],
                   f"farlink bench gpu: {result['gpu']}")
        loss = result["loss"]
        Console().print(f"DiLoCo held-out loss: CPU fp32 {loss['cpu_fp32']:.4f}, GPU bf16 "
                        f"{loss['gpu_bf16']:.4f} (gap {loss['relative_gap']:.2%})")

    @bench_app.command("overhead")
    def overhead(
        out: Path = typer.Option(Path("bench/overhead"), help="output directory"),
        steps: int = typer.Option(300, help="steps per measurement"),
        repeats: int = typer.Option(3, help="alternating repeats"),
        model: str = typer.Option("tiny", help="model preset"),
    ) -> None:
        """Tokens/s of one farlink worker vs a plain PyTorch loop (framework overhead)."""
        from farlink.bench.overhead import run

        result = run(out, steps, repeats, model)
        print_rows(result["rows"], ["repeat", "plain_tokens_per_s", "farlink_tokens_per_s",
                                    "overhead"], "farlink bench overhead")
        Console().print(f"median overhead: {result['median_overhead']:.2%}")

    @bench_app.command("sites", hidden=True)  # its earlier name, for scripts
    @bench_app.command("replica-groups")
    def replica_groups(
        out: Path = typer.Option(Path("bench/replica_groups"), help="output directory"),
        steps: int = typer.Option(100, help="inner steps per measurement (the first 10 warm up)"),
        model: str = typer.Option("tiny", help="model preset"),
        ranks: int = typer.Option(2, help="ranks of the replica group (--ranks-per-worker)"),
        batch_size: int = typer.Option(8, help="rows per rank (a replica group of K ranks: "
                                       "K x this)"),
        repeats: int = typer.Option(1, help="alternating repeats (medians are reported)"),
    ) -> None:
        """Tokens/s per rank of a replica group of K ranks (fsdp, ddp) vs one rank vs plain
        torch."""
        from farlink.bench.replica_groups import run

        result = run(out, steps, model, ranks, batch_size, repeats)
        print_rows(result["rows"], ["repeat", "config", "replica_group_tokens_per_s",
                                    "tokens_per_s_per_rank", "per_rank_vs_one_rank",
                                    "load_before", "load_after"], "farlink bench replica-groups")
        Console().print(f"median overhead of farlink (1 rank) vs plain torch: "
                        f"{result['median_overhead_vs_plain']:.1%}; median per-rank tokens/s "
                        f"vs one rank: {result['median_per_rank_vs_one_rank']}")

    @bench_app.command("churn")
    def churn(
        out: Path = typer.Option(Path("bench/churn"), help="output directory"),
        rates: list[float] | None = typer.Option(
            None, help="kills per 100 outer steps (default 0, 1, 4; hivemind: one rate, 4)"),
        steps: int | None = typer.Option(
            None, help="inner steps per worker (default 2000; --long: 6000; hivemind: 100)"),
        inner_steps: int | None = typer.Option(None, help="H (default 20; --long: 10; "
                                               "hivemind: 2)"),
        workers: int | None = typer.Option(
            None, help="worker processes (default 4; hivemind: volunteers at the start, 3)"),
        long: bool = typer.Option(
            False, "--long", help="instead of kill rates: a schedule of SIGKILLs aimed at every "
            "moment (inner step, round, checkpoint write, heal), Lighthouse kills and damaged "
            "checkpoints"),
        kills: int = typer.Option(100, help="--long: worker SIGKILLs"),
        lighthouse_kills: int = typer.Option(2, help="--long: Lighthouse SIGKILLs"),
        corruptions: int = typer.Option(3, help="--long: checkpoints damaged on disk"),
        seed: int = typer.Option(0, help="--long and hivemind: schedule and victims"),
        backend: str = typer.Option(
            "torchft", help="torchft: workers of one job killed and restarted; hivemind: a "
            "volunteer swarm (farlink swarm start / join, a run dir each), volunteers SIGKILLed "
            "and newcomers taking their shards over"),
        model: str = typer.Option("nano", help="hivemind: the model preset"),
    ) -> None:
        """Loss vs tokens with workers SIGKILLed and restarted; audits lost committed progress."""
        from farlink.bench.churn import run, run_long

        if backend == "hivemind":
            from farlink.bench import churn_swarm

            if rates is not None and len(rates) != 1:
                typer.secho("error: --backend hivemind runs one departure rate; give --rates "
                            "once", fg="red", err=True)
                raise typer.Exit(2)
            inner = inner_steps or 2
            result = churn_swarm.run(out, rounds=(steps or 100) // inner, inner_steps=inner,
                                     volunteers=workers or 3, rate=rates[0] if rates else 4.0,
                                     model=model, seed=seed)
            print_rows(result["rows"], ["departures_per_100_rounds", "rounds", "sigkills",
                                        "arrivals", "consistent", "same_final_state",
                                        "lost_committed_tokens", "committed_tokens"],
                       "farlink bench churn --backend hivemind")
            return
        if backend != "torchft":
            typer.secho(f"error: backend {backend!r} unknown; choose torchft or hivemind",
                        fg="red", err=True)
            raise typer.Exit(2)
        rates, workers = rates or [0.0, 1.0, 4.0], workers or 4
        if long:
            result = run_long(out, kills, lighthouse_kills, corruptions, steps or 6000,
                              inner_steps or 10, workers, seed)
            columns = ["worker_sigkills", "lighthouse_sigkills", "corrupted_checkpoints",
                       "corrupt_checkpoints_refused", "outer_steps", "consistent",
                       "lost_committed_tokens", "wall_s"]
            print_rows([result], columns, "farlink bench churn --long")
            print(f"SIGKILLs by moment: {result['sigkills_by_moment']}")
            if not result["targets_met"]:
                print(f"the run ended before every fault was injected ({result['targets']}); "
                      "raise --steps")
            return
        result = run(out, rates, steps or 2000, inner_steps or 20, workers)
        print_rows(result["rows"], ["kills_per_100_outer_steps", "kills", "outer_steps",
                                    "consistent", "lost_committed_tokens", "final_heldout_loss"],
                   "farlink bench churn")

    @bench_app.command("hetero")
    def hetero(
        out: Path = typer.Option(Path("bench/hetero"), help="output directory"),
        scenario: str = typer.Option(
            "devices", help="devices: fixed H vs time-budgeted rounds; islands: the same workers "
            "in islands joined by a slow link, adding hierarchical DiLoCo"),
        slowdown: str = typer.Option("1,1,2,4", help="per-worker slowdown factors"),
        steps: int | None = typer.Option(
            None, help="inner steps per worker for the fixed-H run (default: devices 300, "
            "islands 100)"),
        inner_steps: int | None = typer.Option(None, help="H (default: devices 30, islands 20)"),
        topology: str = typer.Option("0,1|2,3", help="islands scenario: emulated groups"),
        intra_link: str = typer.Option("datacenter", help="islands scenario: link in a group"),
        inter_link: str = typer.Option("intercontinental",
                                       help="islands scenario: link between groups"),
        island_rounds: int = typer.Option(
            1, min=1, help="islands scenario: island averaging rounds per global round"),
        pace_seconds: float = typer.Option(
            1.0, min=0.0, help="pad every step to slowdown x this many seconds, so emulated "
            "speeds hold while workers share cores (0: sleep (slowdown - 1) x each real step "
            "instead, which a busy machine distorts)"),
        reuse: bool = typer.Option(False, help="read back finished runs of the same config"),
    ) -> None:
        """Workers of different speeds: fixed H vs time-budgeted rounds (vs hierarchical)."""
        from farlink.bench import hetero as bench

        if scenario == "devices":
            result = bench.run(out, slowdown, steps or 300, inner_steps or 30,
                               pace_seconds or None, reuse)
        elif scenario == "islands":
            result = bench.run_islands(out, slowdown, steps or 100, inner_steps or 20, topology,
                                       intra_link, inter_link, island_rounds,
                                       pace_seconds or None, reuse)
        else:
            typer.secho(f"error: scenario {scenario!r} unknown; choose devices or islands",
                        fg="red", err=True)
            raise typer.Exit(2)
        print_rows(result["rows"], ["label", "final_heldout_loss", "wall_s",
                                    "utilization_per_worker", "wall_to_fixed_final_loss",
                                    "speedup_to_target", "inter_island_bytes", "meets_targets"],
                   f"farlink bench hetero --scenario {scenario}")

    @bench_app.command("attack")
    def attack(
        out: Path = typer.Option(Path("bench/attack"), help="output directory"),
        attacks: list[str] | None = typer.Option(
            None, help="emulated attacks (default: farlink.bench.attack.ATTACKS)"),
        setups: list[str] = typer.Option(["4:1", "8:2"], help="WORKERS:MALICIOUS"),
        rules: list[str] | None = typer.Option(
            None, help="aggregation rules, and loss (mean + --score loss) and open (an open "
            "run's default) (default: farlink.bench.attack.RULES)"),
        in_process: bool = typer.Option(False, help="workers as threads of this process "
                                         "(records ratings, credits and the scoring cost)"),
        model: str = typer.Option("tiny", help="model preset"),
        parallel: int = typer.Option(1, help="--in-process: variants run at once"),
        steps: int | None = typer.Option(None, help="inner steps per worker (default 200; "
                                         "--protocol: 12)"),
        inner_steps: int | None = typer.Option(None, help="H (default 20; --protocol: 3)"),
        reuse: bool = typer.Option(False, help="read back finished runs of the same config"),
        protocol: bool = typer.Option(False, help="run the hostile-member matrix instead: "
                                      "protocol attacks on each --backend, with a verdict each"),
        protocol_attacks: list[str] | None = typer.Option(
            None, help="--protocol: attacks (default: every one of farlink.robust.hostile)"),
        backend: str = typer.Option("torchft,hivemind", help="--protocol: comma list"),
        rule: str = typer.Option("mean", help="--protocol: the aggregation rule (mean shows "
                                 "what an inflated weight or a forged update does)"),
        workers: int = typer.Option(3, help="--protocol: workers per run (the last attacks)"),
    ) -> None:
        """Loss for clean, attacked + plain mean, and attacked + each robust rule; with
        --protocol, a hostile member's protocol attacks on each backend, each refused, bounded
        or FAILED."""
        if protocol:
            from farlink.bench.attack import PROTOCOL_ATTACKS, run_protocol

            backends = [b.strip() for b in backend.split(",") if b.strip()]
            result = run_protocol(out, protocol_attacks or PROTOCOL_ATTACKS, backends, workers,
                                  1, steps or 12, inner_steps or 3, rule, reuse)
            print_rows(result["rows"], ["attack", "backend", "heldout_loss", "loss_vs_clean",
                                        "consistent", "nonfinite_files", "attacker_named",
                                        "returncodes", "verdict"],
                       "farlink bench attack --protocol")
            return
        from farlink.bench.attack import ATTACKS, RULES, run

        parsed = [tuple(int(x) for x in s.split(":")) for s in setups]
        result = run(out, attacks or ATTACKS, parsed, steps or 200, inner_steps or 20,
                     rules or RULES, reuse, in_process, model, parallel)
        print_rows(result["rows"], ["label", "final_heldout_loss", "loss_vs_clean",
                                    "attacker_credited", "rounds_to_separate", "score_share",
                                    "score_share_counted"],
                   "farlink bench attack")

    @bench_app.command("wan")
    def wan(
        profile: str = typer.Option("intercontinental", help="link profile"),
        out: Path = typer.Option(Path("bench/wan"), help="output directory"),
        steps: int = typer.Option(200, help="inner steps per worker"),
        inner_steps: int = typer.Option(50, help="H"),
        workers: int = typer.Option(4, help="worker processes"),
        fragments: int = typer.Option(4, help="Streaming DiLoCo fragments"),
        only: list[str] | None = typer.Option(None, help="run only labels containing this"),
        emulation: str = typer.Option(
            "auto", help="netns (namespaces, tc, NFQUEUE delay), inprocess, or auto: netns "
            "where permitted, else in-process with a message"),
        bandwidth_mbit: float | None = typer.Option(
            None, help="netns: the profile's delay at this rate (the user-space delayer tops out "
            "near 150 Mbit/s)"),
        reuse: bool = typer.Option(False, help="read back finished runs of the same config"),
        overlap_steps: int | None = typer.Option(
            None, help="Streaming DiLoCo: inner steps each fragment's exchange overlaps "
            "(default about H / (2 x fragments) - 1)"),
        outer_overlap: str = typer.Option(
            "none", help="delayed or eager: also run DiLoCo int4+ef with its outer step one round "
            "late (its exchange beside the next round's compute)"),
    ) -> None:
        """DDP vs DiLoCo vs Streaming DiLoCo vs SparseLoCo vs DeMo on an emulated WAN link."""
        from farlink.bench.wan import run

        if emulation not in ("auto", "netns", "inprocess"):
            raise typer.BadParameter("choose auto, netns or inprocess", param_hint="--emulation")
        if outer_overlap not in ("none", "delayed", "eager"):
            raise typer.BadParameter("choose none, delayed or eager", param_hint="--outer-overlap")
        result = run(out, profile, steps, inner_steps, workers, fragments, only, emulation,
                     bandwidth_mbit, reuse, overlap_steps, outer_overlap)
        print_rows(result["rows"], ["label", "final_heldout_loss", "bytes_per_token",
                                    "peak_round_bytes", "compute_utilization", "wall_s"],
                   f"farlink bench wan --profile {profile}")
        errors = result["planner_validation"]["errors"]["metrics"]
        typer.echo("planner vs measured steady-state rounds, median |relative error|: " + ", ".join(
            f"{k} {100 * v['median_abs_relative_error']:.1f}% (max "
            f"{100 * v['max_abs_relative_error']:.1f}%)" for k, v in errors.items() if v["n"]))

    @bench_app.command("pipeline")
    def pipeline(
        out: Path = typer.Option(Path("bench/pipeline"), help="output directory"),
        model: str = typer.Option("tiny", help="model preset"),
        steps: int = typer.Option(150, help="optimizer steps per run"),
        batch_size: int = typer.Option(8, help="sequences per step (all peers together)"),
        micro_batches: int = typer.Option(4, help="pipeline micro-batches per step"),
        codecs: list[str] = typer.Option(["int8", "int4"], help="activation codecs to compare"),
        link: str = typer.Option("home", help="link profile of every peer (in-process)"),
        memory_cap_mb: float | None = typer.Option(
            None, help="per-peer training-state cap (default: between a stage's and the "
            "whole model's need)"),
        reuse: bool = typer.Option(False, help="read back the finished data-parallel run, and "
                                   "the rows of an earlier pipeline.json with the same settings "
                                   "in --out (only missing codecs run)"),
        placement: bool = typer.Option(
            False, help="instead: step time of the placement chosen from a two-site link "
            "matrix against random placements (4 peers, 2 x 2 stages)"),
        trials: int = typer.Option(5, help="--placement: runs of every placement (medians)"),
        inter: str = typer.Option("dsl", help="--placement: link profile between the sites"),
        link_matrix: Path | None = typer.Option(
            None, help="--placement: a 4-peer link matrix file (JSON: bandwidth_mbit, rtt_ms) "
            "instead of the two sites"),
    ) -> None:
        """Data parallel vs a 2-stage pipeline vs compressed activations: tokens/s, loss."""
        from farlink.bench.pipeline import run, run_placement

        if placement:
            found = run_placement(out, model, trials=trials, batch_size=batch_size,
                                  micro_batches=micro_batches, inter=inter,
                                  link_matrix=link_matrix)
            print_rows(found["rows"], ["label", "pipelines", "predicted_step_s",
                                       "measured_step_s"], "farlink bench pipeline --placement")
            typer.echo(f"chosen / best random measured: {found['chosen_vs_best_random']:.3g}; "
                       f"chosen fastest in {found['trials_chosen_fastest']} of {trials} trials")
            return
        result = run(out, model, steps, batch_size, micro_batches, tuple(codecs), link,
                     memory_cap_mb=memory_cap_mb, reuse=reuse)
        print_rows(result["rows"], ["label", "final_heldout_loss", "tokens_per_s",
                                    "activation_bytes_per_token", "activation_bytes_reduction",
                                    "heldout_loss_vs_fp32", "memory_mib_per_peer",
                                    "fits_memory_cap"], "farlink bench pipeline")

    @bench_app.command("backends")
    def backends(
        out: Path = typer.Option(Path("bench/backends"), help="output directory"),
        steps: int = typer.Option(200, help="inner steps per worker"),
        inner_steps: int = typer.Option(20, help="H"),
        workers: int = typer.Option(3, help="worker processes"),
        codec: str = typer.Option("int8", help="codec of the pseudo-gradients"),
    ) -> None:
        """The same DiLoCo scenario on torchft and on hivemind, side by side."""
        from farlink.bench.backends import run

        result = run(out, steps, inner_steps, workers, codec)
        print_rows(result["rows"], ["label", "mean_round_s", "mean_round_s_all",
                                    "mean_last_arrival_round_s", "bytes_per_worker",
                                    "compute_utilization", "final_heldout_loss", "wall_s"],
                   "farlink bench backends")
        typer.echo(f"hivemind / torchft: {result['ratios']}")

    @bench_app.command("swarm")
    def swarm(
        out: Path = typer.Option(Path("bench/swarm"), help="output directory"),
        model: str = typer.Option("tiny", help="model preset"),
        steps: int = typer.Option(30, help="inner steps of the run"),
        inner_steps: int = typer.Option(10, help="H: inner steps per DiLoCo round"),
        bandwidth_mbit: float | None = typer.Option(
            None, help="home links' upload at this rate (default: the profile's 50 Mbit/s)"),
        timeout_s: float = typer.Option(900.0, help="give up on the volunteers after this"),
    ) -> None:
        """A bootstrap peer, a reachable volunteer and two volunteers behind NAT (client mode)
        on home links of 50-150 ms, in network namespaces, training one run to its end."""
        from farlink.bench.swarm import plot_rounds, run

        result = run(out, model, steps, inner_steps, bandwidth_mbit, timeout_s)
        plot_rounds({"bench swarm": result}, out / "swarm.png")
        print_rows(result["rows"], ["peer", "role", "reachability", "latency_ms", "bytes_sent",
                                    "mean_round_s", "median_round_over_transfer",
                                    "group_sizes", "finished"],
                   "farlink bench swarm")
        typer.echo(f"median round / transfer time: {result['median_round_over_transfer']} "
                   "(transfer time: the round's largest upload over the home uplink); plain "
                   f"TCP for the same serving: {(result['tcp_serving'] or {}).get('median_s')} s")
        typer.echo(f"path: {result['path']}")
        typer.echo(f"all volunteers on the same state: {result['same_state']}")
        if not result["same_state"]:
            raise typer.Exit(1)
