"""``farlink rl`` and ``farlink bench rl``: the commands only; what they build lives in
:mod:`farlink.train.rl` and :mod:`farlink.bench.rl`, imported when a command runs (so the CLI
starts without torch)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @app.command("rl")
    def rl(
        task: str = typer.Option("sorting:3", help="addition[:D], sorting[:N], countdown[:N] "
                                 "or FILE.jsonl ({prompt, answer} a line)"),
        base: Path | None = typer.Option(None, help="a `farlink train` run directory to start "
                                         "from (default: pre-train on the task's examples)"),
        model: str = typer.Option("nano", help="the recipe's model: a preset, or hf:DIR (a "
                                  "local transformers causal LM; its weights and tokenizer.json "
                                  "when it has them)"),
        pretrain_steps: int = typer.Option(1000, help="steps of the base-model recipe"),
        steps: int = typer.Option(60, help="GRPO steps"),
        workers: int = typer.Option(2, help="honest rollout workers (threads)"),
        malicious: list[str] = typer.Option([], help="add a cheating worker: fabricate, wrong_model, stale, replay"),
        group_size: int = typer.Option(8, help="completions per prompt"),
        groups_per_step: int = typer.Option(8, help="prompts per step"),
        max_staleness: int = typer.Option(2, help="oldest policy version a rollout may use"),
        deadline: float = typer.Option(5.0, help="seconds a step waits for rollouts"),
        lr: float = typer.Option(3e-4, help="AdamW learning rate of the policy"),
        kl_coef: float = typer.Option(0.0, help="KL penalty to the base model"),
        codec: str = typer.Option("int4", help="codec of policy deltas to workers"),
        verify_fraction: float = typer.Option(0.25, help="groups recomputed (>= 1 per worker)"),
        pace_seconds: float = typer.Option(0.0, help="each job takes at least this long"),
        worker_link: str | None = typer.Option(None, help="a link profile (home, dsl, ...) "
                                               "each worker thread's fetches and hand-ins "
                                               "cross, emulated in-process"),
        listen: str | None = typer.Option(None, help="HOST:PORT where `farlink rl-worker` "
                                          "processes connect (port 0: any free one)"),
        worker_idle_s: float = typer.Option(120.0, help="cut a worker connection that sends "
                                            "no whole request for this long (it reconnects)"),
        max_worker_connections: int = typer.Option(256, help="worker connections open at once"),
        max_connections_per_host: int = typer.Option(16, help="worker connections from one "
                                                     "address (workers behind one NAT share it)"),
        worker_processes: int = typer.Option(0, help="start this many local `farlink "
                                             "rl-worker` processes (implies --listen "
                                             "127.0.0.1:0 unless given)"),
        out: Path = typer.Option(Path("runs/rl"), help="logs, ledger and summary"),
        seed: int = typer.Option(0),
    ) -> None:
        """GRPO post-training with rollout workers whose rollouts are verified."""
        import torch

        from farlink.rl.trainer import RLConfig
        from farlink.train.rl import (make_base, make_session, restore_state, run_session,
                                      serve, spawn_workers)

        torch.set_num_threads(1)
        config = RLConfig(group_size=group_size, groups_per_step=groups_per_step,
                          max_staleness=max_staleness, deadline_s=deadline, kl_coef=kl_coef,
                          verify_fraction=verify_fraction, seed=seed)
        session = make_session(make_base(task, base, pretrain_steps, seed=seed,
                                         model_name=model), config,
                               workers=workers, lr=lr, codec=codec, malicious=malicious,
                               pace_seconds=pace_seconds, worker_link=worker_link)

        def echo(row: dict) -> None:
            acc = row.get("heldout_accuracy")
            typer.echo(f"step {row['step']:4d} reward {row['reward']:.3f} kl {row['kl']:.4f} "
                       f"len {row['response_len']:.1f} staleness {row['staleness_mean']:.1f} "
                       f"rejected {row['rejected_groups']}"
                       + (f" heldout {acc:.3f}" if acc is not None else ""))

        checkpoints = out / "checkpoints"  # every committed step; a rerun resumes from it
        done = restore_state(checkpoints, session) or 0
        if done:
            typer.echo(f"resuming after committed step {done}")
        server, children = None, []
        if listen is None and worker_processes:
            listen = "127.0.0.1:0"
        if listen is not None:
            host, _, port = listen.rpartition(":")
            server = serve(session, codec, host, int(port), idle_s=worker_idle_s,
                           max_connections=max_worker_connections,
                           max_per_host=max_connections_per_host)
            typer.echo(f"serving rollout workers on {server.address[0]}:{server.address[1]}")
            children = spawn_workers(server.address, worker_processes, pace_seconds,
                                     identity_dir=out / "worker-keys")
        try:
            summary = run_session(session, steps - done, out=out, echo=echo,
                                  checkpoints=checkpoints, remote=server is not None,
                                  server=server)
        finally:
            for child in children:
                child.terminate()
            for child in children:
                child.wait(timeout=30)
            if server is not None:
                server.close()
        typer.echo(f"held-out accuracy {summary['heldout_accuracy_base']:.3f} -> "
                   f"{summary['heldout_accuracy_final']:.3f}; rejected: "
                   f"{len(summary['rejections'])}; logs in {out}")

    @app.command("rl-worker", context_settings={"allow_extra_args": True,
                                                "ignore_unknown_options": True})
    def rl_worker(ctx: typer.Context) -> None:
        """A rollout worker process for `farlink rl --listen` (--connect HOST:PORT --name N
        [--identity KEYFILE]; its key id is its name on the trainer side)."""
        from farlink.train.rl_worker import main

        raise typer.Exit(main(list(ctx.args)))

    @bench_app.command("rl")
    def bench_rl(
        out: Path = typer.Option(Path("docs/results"), help="output directory"),
        steps: int = typer.Option(60, help="GRPO steps per scenario"),
        seeds: int = typer.Option(3, help="seeds of the accuracy-rise scenario"),
        only: list[str] = typer.Option([], help="run only these scenarios (rise, workers, "
                                       "staleness, cheats, diloco_two_groups, false_rejects, "
                                       "processes, home_links) into rl-<names>.json"),
    ) -> None:
        """Accuracy and reward vs wall-clock and rollouts; workers 1/2/4, staleness, cheats."""
        import json

        from farlink.bench.rl import SCENARIOS, headline, run

        result = run(out, steps, seeds, only=tuple(only) or SCENARIOS)
        typer.echo(json.dumps(headline(result), indent=1))
