"""``farlink train``: a Lighthouse and N local worker processes, watched through their metrics.

The launcher owns no training state. It prepares the data once (so N workers do not all train the
tokenizer), starts the processes, draws a progress bar from the workers' JSONL metrics, and on
Ctrl-C asks the workers to stop between steps; their last checkpoints are the committed state and
``farlink train --resume --run-dir DIR`` continues from them.

Everything that can be checked is checked before anything is written or started (the run dir's
rules in :mod:`farlink.train.rundir`, key files and the secret, the corpus and every worker's
shard); a worker that fails anyway has the end of its log shown on the console.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from farlink import interrupt
from farlink import lifeline
from farlink.config import ConfigError, RunConfig
from farlink.loggers import require_sinks
from farlink.robust.auth import SECRET_ENV, run_authenticator, run_secret
from farlink.state.checkpoint import EXIT_DISK_FULL, is_disk_full
from farlink.train import forkserver
from farlink.train.console import console as console  # where callers find it
from farlink.train.forkserver import ForkedWorker
from farlink.train.lighthouse import Lighthouse
from farlink.train.metrics import read_metrics
from farlink.train.result import RunResult as RunResult  # where callers find it
from farlink.train.rundir import open_run_dir, plan_run_dir
from farlink.train.start_line import StartLine
from farlink.train.rundir import write_run_config as write_run_config  # where callers find it

if TYPE_CHECKING:
    from farlink.data import PreparedData
    from farlink.emulate.topology import Topology


def write_model_files(cfg: RunConfig, data: PreparedData) -> None:
    """The run directory keeps its tokenizer and model shape next to the weights, so
    ``farlink export`` and ``farlink generate`` need nothing from the cache or the inputs."""
    from farlink.model.build import write_model_description
    from farlink.state.files import atomic_write

    atomic_write(cfg.run_dir / "tokenizer.json", data.tokenizer.to_str().encode("utf-8"))
    write_model_description(cfg.run_dir, cfg.model, data.vocab_size, cfg.seq_len)


def worker_command(run_dir: Path, index: int, lighthouse: str, resume: bool,
                   join: bool = False, stop_at_step: int | None = None,
                   ranks: int = 1, host: str = "127.0.0.1") -> list[str]:
    """A worker's argv: the run dir holds its config; this invocation's own flags (resume,
    join, a stop point) ride along here. Never a secret: argv is visible to every local user.
    A worker of several ranks is a replica group on this machine: torchrun starts its ranks, through
    :mod:`farlink.parallel.replica_group_agent` so that the replica group's store listens on
    ``host`` only."""
    python = [sys.executable]
    if ranks > 1:
        python += ["-m", "farlink.parallel.replica_group_agent", "--host", host,
                   f"--nproc-per-node={ranks}", "--max-restarts=0"]
    argv = [*python, "-m", "farlink.worker", str(run_dir), str(index),
            "--lighthouse", lighthouse]
    if stop_at_step is not None:
        argv += ["--stop-at-step", str(stop_at_step)]
    return argv + (["--resume"] if resume else []) + (["--join"] if join else [])


def spawn_worker(cfg: RunConfig, index: int, lighthouse: str, resume: bool,
                 extra_env: dict[str, str] | None = None, join: bool = False,
                 network: Topology | None = None) -> subprocess.Popen | ForkedWorker:
    """Start worker ``index``; with ``network``, inside its namespace of the emulated WAN (its
    environment then names the veth Gloo must bind and the address peers reach it at). A plain
    local worker of one rank is forked from the preloaded fork server (see
    :mod:`farlink.train.forkserver`), unless ``FARLINK_WORKER_START=spawn``."""
    logs = cfg.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # the worker stops by itself if this process dies without stopping it (see lifeline)
    env = {"OMP_NUM_THREADS": str(cfg.threads), **lifeline.child_env()}
    secret = run_secret(cfg)
    if secret is not None:  # the worker's environment: not argv, not a file
        env[SECRET_ENV] = secret
    env.update(extra_env or {})
    out = open(logs / f"w{index}.log", "ab")
    argv = worker_command(cfg.run_dir, index, lighthouse, resume, join, cfg.stop_at_step,
                          cfg.ranks_per_worker, cfg.host)
    if cfg.ranks_per_worker > 1:
        env["REPLICA_GROUP_ID"] = str(index)
    # a new session: Ctrl-C reaches the launcher only, and it stops workers in order
    if network is not None:
        return network.spawn(index, argv, {**network.worker_env(index), **env}, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    if cfg.ranks_per_worker == 1 and forkserver.worker_start() == "forkserver":
        out.close()  # the forked worker opens its log itself
        return forkserver.start_worker(argv, {**os.environ, **env}, logs / f"w{index}.log")
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, **env}, start_new_session=True)


def final_replicas(ends: dict[str, dict]) -> tuple[list[str], bool]:
    """The workers that hold the run's result, and whether every worker ended on the same state.

    An elastic run can end split: a straggler that missed the last round while the others
    finished and left forms a quorum of one and commits its own last round, a state no one else
    holds. The run's result is then the state most workers ended on (ties: the later outer step).
    """
    states: dict[tuple[int, str], list[str]] = {}
    for worker, end in sorted(ends.items()):
        if end.get("fingerprint") is not None:
            states.setdefault((end.get("outer_step", 0), end["fingerprint"]), []).append(worker)
    if not states:  # metrics that predate end-of-run fingerprints
        return sorted(ends), True
    best = max(states, key=lambda key: (len(states[key]), key[0]))
    return states[best], len(states) == 1


def ended_apart_report(ended: dict) -> str:
    """The workers that ended on another state than the run's result (``summary.json``'s
    ``final_replicas``), each with the group of the last round it committed."""
    apart = []
    for worker, (step, fingerprint) in sorted(ended["states"].items()):
        if worker in ended["holders"]:
            continue
        group = ended.get("last_groups", {}).get(worker)
        last = f", its last round in a group of {group}" if group is not None else ""
        apart.append(f"{worker} (outer step {step}, state {str(fingerprint)[:12]}{last})")
    return ("workers ended on different states (a straggler that missed the run's last round "
            "finds no peer left to heal from and commits its own): "
            f"{'; '.join(apart)}. The run's result is the state most hold, that of "
            f"{', '.join(ended['holders'])}")


def result_evals(evals: list[dict], holders: list[str] | None) -> list[dict]:
    """The evaluations of the state the run ended on, not of a straggler's lone last round
    (evaluations or summaries that predate ``final_replicas`` are all kept)."""
    return [e for e in evals if not holders or "worker" not in e or e["worker"] in holders]


def summarize(cfg: RunConfig) -> dict:
    """Final figures from the workers' metrics: held-out loss (of the run's result, see
    :func:`final_replicas`), bytes, utilization."""
    per_worker, evals, last, groups = {}, [], {}, []
    for path in sorted((cfg.run_dir / "metrics").glob("w*.jsonl")):
        records = read_metrics(path)
        evals += [r for r in records if r["kind"] == "eval"]
        ends = [r for r in records if r["kind"] == "end"]
        groups += [r["world_size"] for r in records if r.get("committed") and "world_size" in r]
        groups += [r["widest_group"] for r in ends if r.get("widest_group")]
        if ends:
            end = last[path.stem] = ends[-1]
            per_worker[path.stem] = {
                "tokens": end["tokens"],
                "bytes_sent": end["bytes_sent"],
                "bytes_per_token": end["bytes_sent"] / max(end["tokens"], 1),
                # inner compute over all of the worker's wall-clock: setup, rounds, and what
                # evaluation and checkpoints cost the loop all count against it
                "compute_utilization": end["compute_s"] / max(end["wall_s"], 1e-9),
                "wall_s": end["wall_s"],
                "compute_s": end["compute_s"],
                "comm_s": end["comm_s"],
                **{k: end.get(k, 0.0) for k in ("eval_s", "checkpoint_s", "setup_s")},
                "failed_rounds": end.get("failed_rounds", 0),
                "skipped_rounds": end.get("skipped_rounds", 0),
                "pace_overruns": end.get("pace_overruns", 0),
                **{k: end[k] for k in ("intra_bytes", "inter_bytes") if k in end},
            }
    evals.sort(key=lambda r: (r["step"], r["time"]))
    holders, consistent = final_replicas(last)
    final = (result_evals(evals, holders) or evals or [None])[-1]
    return {
        "algorithm": cfg.algorithm,
        "codec": cfg.codec,
        "workers": cfg.workers,
        "inner_steps": cfg.inner_steps,
        "steps": cfg.steps,
        "final_heldout_loss": final["loss"] if final else None,
        "final_heldout_ppl": final["ppl"] if final else None,
        "total_tokens": sum(w["tokens"] for w in per_worker.values()),
        "widest_group": max(groups, default=None),
        "final_replicas": {"holders": holders, "consistent": consistent,
                           "states": {w: [e.get("outer_step"), e.get("fingerprint")]
                                      for w, e in last.items()},
                           "last_groups": {w: e.get("last_group") for w, e in last.items()}},
        "per_worker": per_worker,
        "evals": [{k: r[k] for k in ("worker", "step", "tokens", "loss", "bytes_sent", "wall_s")}
                  for r in evals],
    }


def never_averaged(cfg: RunConfig, summary: dict) -> str | None:
    """What is wrong when several workers committed rounds but no round had two of them: each
    trained its own model, which is not the run that was asked for."""
    if cfg.workers < 2 or summary.get("widest_group") != 1:
        return None
    return (f"no round averaged two or more of the {cfg.workers} workers (every committed round "
            "had a group of 1): they trained independent models, not one. Fix: let rounds wait "
            f"for everyone with --min-replicas {cfg.workers} (or at least 2), check that the "
            f"peers reach each other (logs in {cfg.run_dir / 'logs'}), or raise "
            "--quorum-timeout / --join-timeout.")


def export_model(cfg: RunConfig, holders: list[str] | None = None) -> Path | None:
    """Copy the final model of a worker holding the run's result to ``run_dir/model.safetensors``:
    one whose file still hashes to the SHA-256 that worker recorded in its end record when it
    wrote it (a file changed since, by a bad disk or a stray write, is skipped with a warning)."""
    finals = sorted((cfg.run_dir / "final").glob("w*.safetensors"))
    preferred = [f for f in finals if holders is None or f.stem in holders]
    recorded = {path.stem: ends[-1].get("model_sha256")
                for path in (cfg.run_dir / "metrics").glob("w*.jsonl")
                if (ends := [r for r in read_metrics(path) if r["kind"] == "end"])}
    checked = any(recorded.values())  # runs that predate model digests export unchecked
    for candidate in preferred or finals:
        if checked:
            digest = hashlib.sha256(candidate.read_bytes()).hexdigest()
            if digest != recorded.get(candidate.stem):
                console.print(f"[yellow]{candidate} does not match the SHA-256 its worker "
                              "recorded when writing it; not exported[/]")
                continue
        target = cfg.run_dir / "model.safetensors"
        shutil.copyfile(candidate, target)
        return target
    return None


def checkpoint_fallbacks(cfg: RunConfig) -> list[dict]:
    """Checkpoints the workers found corrupt on resume, and what each resumed from instead."""
    found = []
    for path in sorted((cfg.run_dir / "metrics").glob("w*.jsonl")):
        rejected = None
        for r in read_metrics(path):
            if r["kind"] == "checkpoint_rejected":
                rejected = rejected or []
                rejected.append(r)
            elif r["kind"] == "resume" and rejected:
                found += [{"worker": r["worker"], "rejected": x["path"], "reason": x["reason"],
                           "resumed_from": r["path"]} for x in rejected]
                rejected = None
    return found


def _report_checkpoint_fallbacks(fallbacks: list[dict]) -> None:
    for f in fallbacks:
        instead = (f"resumed from {Path(f['resumed_from']).name}" if f["resumed_from"]
                   else "no intact checkpoint left: started from the initial state")
        console.print(f"[yellow]{f['worker']}: {f['reason']}; set aside as "
                      f"{Path(f['rejected']).name}, {instead}; a live peer ahead of it, if any, "
                      "heals it at its first quorum[/]")


def _progress_state(cfg: RunConfig) -> tuple[int, float | None, float | None]:
    steps, loss, heldout = 0, None, None
    for path in (cfg.run_dir / "metrics").glob("w*.jsonl"):
        records = read_metrics(path)
        stepped = [r for r in records if "step" in r and r["kind"] in ("step", "sync", "eval")]
        if stepped:
            steps += stepped[-1]["step"]
            loss = next((r["loss"] for r in reversed(stepped) if r["kind"] != "eval"), loss)
        evals = [r for r in records if r["kind"] == "eval"]
        if evals:
            heldout = evals[-1]["loss"]
    return steps, loss, heldout


def _stop_all(procs: list[subprocess.Popen], grace: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def check_launch(cfg: RunConfig, network: Topology | None = None) -> None:
    """What a run needs besides its data, checked before anything is written or started:
    the emulated network's limits, the secret and key files (ConfigError naming the fix)."""
    from farlink import matrix

    try:  # what does not run in started processes (farlink.matrix), then the trust's files
        matrix.check(cfg, ["train"] + (["namespaces"] if network is not None else []))
        run_authenticator(cfg, "w0")  # a member's authenticator loads its keys and secret
        forkserver.worker_start()  # FARLINK_WORKER_START names a way to start workers
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    require_sinks(cfg.log_to)  # --log-to's packages (farlink[metrics]), before any process


def check_data(cfg: RunConfig, data) -> None:
    """Every worker's shard holds a batch and the held-out text a window (CorpusError saying
    what to change), and the model preset fits the tokenizer, before a worker starts."""
    from farlink.data import ShardSampler, heldout_batches
    from farlink.model import preset_config

    shards = cfg.pipeline_peers_per_stage if cfg.pipeline_stages > 1 else cfg.workers
    for shard in range(shards):  # a pipeline replica reads one shard, as a worker does
        ShardSampler(data.train, shard=shard, num_shards=shards, seq_len=cfg.seq_len,
                     batch_size=cfg.batch_size, seed=cfg.seed)
    heldout_batches(data.heldout, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    if cfg.hf_model_dir is not None:  # ConfigError if its embeddings or positions are too few
        from farlink.model.hf import check_fits

        check_fits(cfg.hf_model_dir, data.vocab_size, cfg.seq_len)
        return
    try:
        config = preset_config(cfg.model, vocab_size=data.vocab_size, seq_len=cfg.seq_len)
        if cfg.pipeline_stages > 1:
            from farlink.parallel.stages import stage_bounds

            stage_bounds(config.n_layer, cfg.pipeline_stages)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None


def _report_skipped_rounds(per_worker: dict[str, dict], group_size: int | None) -> None:
    """Say which workers sat rounds out because no group took them (Moshpit groups of
    ``group_size`` leave a peer out whenever the live peers do not divide into them)."""
    for worker, figures in sorted(per_worker.items()):
        if figures.get("skipped_rounds"):
            console.print(f"{worker} skipped averaging in {figures['skipped_rounds']} round(s): "
                          f"no group of {group_size} took it in time; it went on with its local "
                          "update, and its next group brought it up to date")


def log_tail(path: Path, lines: int = 15) -> list[str]:
    """The last ``lines`` lines of a worker's log (where its traceback ends)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.rstrip().splitlines()[-lines:]


def report_failures(cfg: RunConfig, codes: list[int | None]) -> None:
    """Each failed worker's exit code and the end of its log, on the console."""
    secret = run_secret(cfg)  # checked before the launch, so present when needed
    for index, code in enumerate(codes):
        if not code:
            continue
        log_path = cfg.run_dir / "logs" / f"w{index}.log"
        console.print(f"[red]worker w{index} exited with code {code}; the end of {log_path}:[/]")
        for line in log_tail(log_path):
            if secret:
                line = line.replace(secret, "<secret>")
            console.print("  " + line, markup=False, highlight=False, soft_wrap=True)


def launch(cfg: RunConfig, show_progress: bool = True,
           network: Topology | None = None) -> RunResult:
    """Run ``cfg`` to the end (or Ctrl-C). With ``network`` (a started
    :class:`~farlink.emulate.Topology`), every worker runs in its own namespace behind the
    emulated WAN and the Lighthouse in the router namespace, so all traffic crosses real shaped,
    delayed links. ``RunResult.run_dir`` is where the run went (the default ``runs/latest``
    becomes a new ``runs/<time>``)."""
    from farlink.data import prepare_data

    cfg, latest_link = plan_run_dir(cfg)  # refusals first: nothing written yet
    check_launch(cfg, network)
    with console.status(f"preparing corpus {cfg.corpus!r} and tokenizer"):
        data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir,
                            tokenizer=cfg.given_tokenizer)
    check_data(cfg, data)
    moved = open_run_dir(cfg, latest_link)
    if moved is not None:
        console.print(f"--overwrite: the previous run is kept, moved to {moved}")
    write_model_files(cfg, data)
    console.print(
        f"[bold]farlink[/] {cfg.algorithm} ({cfg.codec}) | {cfg.workers} workers | "
        f"model {cfg.model} | corpus {cfg.corpus}: {len(data.train):,} train / "
        f"{len(data.heldout):,} held-out tokens | run dir {cfg.run_dir}"
    )
    if cfg.pipeline_stages > 1:  # stage peers driven by this process, not worker processes
        from farlink.train.pipeline_run import train_pipeline

        return train_pipeline(cfg, data, show_progress)
    from farlink.train.network import network_summary, prepare_network

    # --topology / hierarchical_diloco: measure the links, form islands, one Lighthouse per island
    net_plan, island_lighthouses = prepare_network(cfg, data.vocab_size, network is not None)
    if net_plan is not None:
        console.print(f"islands {net_plan.islands} ({net_plan.source}"
                      + (f": {net_plan.formation}" if net_plan.formation else "") + ")")
    lighthouse = bootstrap = router_lighthouse = None
    address = cfg.lighthouse
    if cfg.backend == "hivemind":
        address = cfg.initial_peers
        if not address:
            from farlink.comm.hivemind_net import start_bootstrap_peer

            member = run_authenticator(cfg, "bootstrap")
            if member is not None:
                from farlink.comm.hivemind_admission import RunAuthorizer

                member = RunAuthorizer(member)
            bootstrap, maddrs = start_bootstrap_peer(cfg.host, authorizer=member)
            address = ",".join(maddrs)
            console.print(f"swarm bootstrap peer: {maddrs[0]}")
    elif address is None and network is not None:
        from farlink.emulate.launch import start_lighthouse

        router_lighthouse, address = start_lighthouse(
            network, cfg.min_replicas, join_timeout_s=cfg.join_timeout,
            heartbeat_timeout_s=cfg.heartbeat_timeout, log_path=cfg.run_dir / "lighthouse.log")
    elif address is None:
        lighthouse = Lighthouse(
            cfg.host, min_replicas=cfg.min_replicas, join_timeout=cfg.join_timeout,
            heartbeat_timeout=cfg.heartbeat_timeout, log_path=cfg.run_dir / "lighthouse.log",
            authenticator=run_authenticator(cfg, "lighthouse-gate", verifier=True),
        ).start()
        address = lighthouse.address
        if lighthouse.gate is not None:
            console.print(f"Lighthouse gate (members only): {address}")
    start_line = StartLine(cfg.workers)  # the first quorum waits for every worker
    procs = [spawn_worker(cfg, i, address, cfg.resume, extra_env=start_line.env(),
                          network=network)
             for i in range(cfg.workers)]
    interrupted = False
    total = cfg.steps * cfg.workers
    columns = [TextColumn("[bold blue]{task.description}"), BarColumn(),
               TextColumn("{task.completed}/{task.total} steps"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    try:
        with Progress(*columns, console=console, disable=not show_progress) as progress:
            task = progress.add_task("training", total=total, info="")
            while any(p.poll() is None for p in procs):
                interrupt.check()
                steps, loss, heldout = _progress_state(cfg)
                info = f"loss {loss:.3f}" if loss is not None else ""
                if heldout is not None:
                    info += f" | held-out {heldout:.3f}"
                progress.update(task, completed=min(steps, total), info=info)
                time.sleep(0.5)
            steps, loss, heldout = _progress_state(cfg)
            progress.update(task, completed=min(steps, total))
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted: stopping workers at their next step boundary[/]")
        _stop_all(procs)
    finally:
        _stop_all(procs)
        start_line.remove()
        if lighthouse is not None:
            lighthouse.stop()
        if router_lighthouse is not None:
            _stop_all([router_lighthouse], grace=5.0)
        if bootstrap is not None:
            bootstrap.shutdown()
        for island_lighthouse in island_lighthouses:
            island_lighthouse.stop()
    codes = [p.returncode for p in procs]
    summary = summarize(cfg)
    if net_plan is not None:
        summary.update(network_summary(net_plan, cfg, summary["per_worker"]))
    summary["returncodes"] = codes
    summary["checkpoint_fallbacks"] = checkpoint_fallbacks(cfg)
    _report_checkpoint_fallbacks(summary["checkpoint_fallbacks"])
    problem = None if interrupted else never_averaged(cfg, summary)
    if problem is not None:
        summary["problem"] = problem
    try:
        model_path = export_model(cfg, summary["final_replicas"]["holders"])
        if model_path is not None:
            summary["model"] = str(model_path)
        (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        console.print(f"[red]disk full writing the run's summary and model under "
                      f"{cfg.run_dir}; each worker's final model is in {cfg.run_dir / 'final'}[/]")
    if problem is not None:
        console.print(f"[red]error: {problem}[/]")
    _report_skipped_rounds(summary["per_worker"], cfg.group_size)
    if not summary["final_replicas"]["consistent"] and not interrupted:
        console.print(f"[yellow]{ended_apart_report(summary['final_replicas'])}: "
                      f"{cfg.run_dir / 'model.safetensors'}[/]")
    if interrupted:
        console.print(f"checkpoints kept under {cfg.run_dir / 'checkpoints'}; continue with "
                      f"`farlink train --resume --run-dir {cfg.run_dir}`")
    elif EXIT_DISK_FULL in codes:
        console.print(f"[red]disk full writing checkpoint under {cfg.run_dir / 'checkpoints'}: "
                      "free space there, then continue with "
                      f"`farlink train --resume --run-dir {cfg.run_dir}`[/]")
    elif any(codes):
        report_failures(cfg, codes)
        console.print(f"[red]workers exited with codes {codes}; logs in {cfg.run_dir / 'logs'}[/]")
    return RunResult(cfg.run_dir, codes, summary, interrupted, problem)
