"""``farlink train --pipeline-stages S``: the run shape, its outer step within a stage, its
checkpoints, and an end-to-end run on loopback that learns and resumes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from farlink.config import RunConfig
from farlink.model import GPTConfig
from farlink.parallel import wire
from farlink.parallel.peers import StagePeer
from farlink.parallel.stage_server import StageWorker
from farlink.parallel.stage_sync import StageAveraging
from farlink.parallel.stages import build_stage
from farlink.state.checkpoint import checkpoint_path, load_checkpoint
from farlink.train.metrics import read_metrics


# -- the run shape ------------------------------------------------------------------------------
def test_peers_per_stage_alone_sets_the_number_of_peers() -> None:
    cfg = RunConfig(pipeline_stages=2, peers_per_stage=3)
    assert (cfg.workers, cfg.pipeline_peers_per_stage) == (6, 3)
    assert RunConfig(pipeline_stages=2, workers=4).pipeline_peers_per_stage == 2


@pytest.mark.parametrize("values, says", [
    ({"workers": 3}, "does not split into 2 pipeline stages"),
    ({"workers": 4, "peers_per_stage": 3}, "give one of --workers and --peers-per-stage"),
    ({"algorithm": "ddp"}, "use local_sgd or diloco"),
    ({"algorithm": "streaming_diloco"}, "use local_sgd or diloco"),
    ({"ranks_per_worker": 2}, "ranks_per_worker"),
    ({"topology": "0,1|2,3"}, "with --emulate-link"),
    ({"auth": "ed25519"}, "use --auth none"),
    ({"auth": "secret", "secret": "s"}, "use --auth none"),
    ({"codec": "int8"}, "no byte on the wire"),
    ({"batch_size": 6}, "multiple of it"),
    ({"activation_codec": "int3"}, "activation_codec"),
])
def test_combinations_that_do_not_run_yet_are_refused_naming_the_fix(values: dict,
                                                                      says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("-", r"\-").replace("(", r"\(")):
        RunConfig(pipeline_stages=2, **values)


def test_peers_per_stage_without_pipeline_stages_is_refused() -> None:
    with pytest.raises(ValueError, match="give --pipeline-stages S"):
        RunConfig(peers_per_stage=2)


# -- the outer step within a stage -------------------------------------------------------------
class _OneWeight(torch.nn.Module):
    """A stage module of one parameter ``w`` (the run's initial θ = 0)."""

    def __init__(self, size: int = 1) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(size))


def _stage_of_two_peers(algorithm: str) -> tuple[StageAveraging, dict[str, dict]]:
    from farlink import compose

    weights = {"a": {"w": torch.tensor([0.0])}, "b": {"w": torch.tensor([0.0])}}
    stage = compose.build_stage_members(RunConfig(algorithm=algorithm), 0, ["a", "b"],
                                        _OneWeight)
    sync = StageAveraging([stage], lambda stage: ["a", "b"], lambda peer: weights[peer],
                          lambda peer, theta: weights.__setitem__(
                              peer, {n: t.detach().clone() for n, t in theta.items()}))
    weights["a"], weights["b"] = {"w": torch.tensor([1.0])}, {"w": torch.tensor([3.0])}
    return sync, weights


def test_local_sgd_within_a_stage_takes_the_peers_mean() -> None:
    sync, weights = _stage_of_two_peers("local_sgd")
    sync.sync(tokens=64)
    assert weights["a"]["w"].item() == weights["b"]["w"].item() == pytest.approx(2.0)


def test_diloco_within_a_stage_is_nesterov_sgd_on_the_pseudo_gradient() -> None:
    """θ=0, peers at 1 and 3: Δ = θ - mean = -2; Nesterov (lr 0.7, momentum 0.9) steps by
    Δ + 0.9 Δ = -3.8, so θ = 0 - 0.7 x -3.8 = 2.66; both peers continue from it."""
    from farlink import compose

    sync, weights = _stage_of_two_peers("diloco")
    sync.sync(tokens=64)
    assert weights["a"]["w"].item() == weights["b"]["w"].item() == pytest.approx(2.66)
    assert sync.globals[0]["w"].item() == pytest.approx(2.66)
    again = StageAveraging([compose.build_stage_members(RunConfig(), 0, ["a"], _OneWeight)],
                           lambda stage: ["a"], lambda peer: {"w": torch.tensor([0.0])},
                           lambda peer, theta: None)
    again.load_state_dict(sync.state_dict())  # θ and the momentum buffer travel together
    assert again.globals[0]["w"].item() == pytest.approx(2.66)
    assert again.rounds == 1
    momentum = {k: v for k, v in sync.state_dict().items() if ".outer." in k}
    assert momentum and all(torch.equal(v, again.state_dict()[k]) for k, v in momentum.items()
                            if k.startswith("stage0.member0."))


def test_a_checkpoint_of_one_theta_per_stage_still_resumes() -> None:
    """A trainer checkpoint written before a stage's peers were members of a collective holds
    one θ and outer optimizer per stage (``stage0.global.w``, ``stage0.outer.0.*``): every
    member takes them."""
    from farlink import compose

    stage = compose.build_stage_members(RunConfig(), 0, ["a", "b"], _OneWeight)
    sync = StageAveraging([stage],
                          lambda stage: ["a", "b"], lambda peer: None, lambda peer, theta: None)
    sync.load_state_dict({"rounds": torch.tensor(3), "stage0.global.w": torch.tensor([2.5]),
                          "stage0.outer.0.momentum_buffer": torch.tensor([0.5])})
    assert sync.rounds == 3 and sync.globals[0]["w"].item() == 2.5
    for member in sync.stages[0].members:
        assert member.algorithm.outer_step == 3
        assert member.weights()["w"].item() == 2.5
        assert member.algorithm.outer_opt.state[member.algorithm.global_params[0]][
            "momentum_buffer"].item() == 0.5


# -- a stage peer's own checkpoint -------------------------------------------------------------
def test_stage_peer_checkpoint_restores_weights_and_adam_moments(tmp_path: Path) -> None:
    config = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, d_ff=64)
    worker = StageWorker(build_stage(config, 0, 0, 2), checkpoint_dir=tmp_path)
    tokens = torch.randint(0, 64, (2, 16))

    def train_once(w: StageWorker, mb: str) -> None:
        y = w.handle(wire.Message("forward", {"mb": mb}, {"x": tokens})).tensors["y"]
        w.handle(wire.Message("backward", {"mb": mb}, {"dy": torch.ones_like(y)}))
        w.handle(wire.Message("step", {"lr": 1e-2}))

    train_once(worker, "1")
    worker.handle(wire.Message("save", {"step": 1}))
    _, meta = load_checkpoint(checkpoint_path(tmp_path, 1))  # digests verified
    assert (meta["stage"], meta["stages"], meta["steps"]) == (0, 2, 1)

    fresh = StageWorker(build_stage(config, 0, 0, 2), checkpoint_dir=tmp_path)
    fresh.handle(wire.Message("restore", {"step": 1}))
    train_once(worker, "2")
    train_once(fresh, "2")  # the same step from the restored state: the same weights
    for name, p in worker.params.items():
        assert torch.equal(p, fresh.params[name]), name

    other_stage = StageWorker(build_stage(config, 0, 1, 2), checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="holds stage 0 of 2, not stage 1 of 2"):
        other_stage.handle(wire.Message("restore", {"step": 1}))


# -- end to end --------------------------------------------------------------------------------
def _train(run_dir: Path, cache_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "farlink.cli", "train", "--run-dir", str(run_dir),
            "--cache-dir", str(cache_dir), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def serve_stage_peers_in_threads(monkeypatch: pytest.MonkeyPatch,
                                 stages: frozenset[int] | None = None) -> None:
    """``farlink train``'s stage peers of ``stages`` (all: None) served on threads of this
    process instead of processes: each is what ``python -m farlink.parallel.stage_server``
    builds (the same seed's stage, its AdamW, its checkpoint dir, the run's token) behind the
    same server; the other stages' peers stay processes."""
    from farlink.parallel import peers as process_peers
    from farlink.parallel.stage_auth import driver_auth
    from farlink.parallel.stage_server import StageServer
    from farlink.train import pipeline_run

    building = threading.Lock()  # build_stage seeds the process's RNG: one stage at a time
    servers: dict[str, StageServer] = {}

    def start(config: GPTConfig, stage: int, stages_of_run: int, **options: object) -> StagePeer:
        if stages is not None and stage not in stages:
            return process_peers.start_stage_peer(config, stage, stages_of_run, **options)
        with building:
            worker = StageWorker(build_stage(config, options["seed"], stage, stages_of_run),
                                 options["lr"], options["weight_decay"], options["slowdown"],
                                 options["checkpoint_dir"])
        server = StageServer(worker, options["host"], auth=driver_auth(options["token"]))
        server.on_shutdown = server.stop
        threading.Thread(target=server.serve_forever, daemon=True).start()
        peer = StagePeer(stage, f"{options['host']}:{server.port}", process=None)
        servers[peer.address] = server
        return peer

    def stop(peers: list[list[StagePeer]]) -> None:
        for row in peers:
            for peer in row:
                if peer.address in servers:
                    servers.pop(peer.address).stop()
        process_peers.stop_pipeline([[peer for peer in row if peer.process is not None]
                                     for row in peers])

    monkeypatch.setattr(pipeline_run, "start_stage_peer", start)
    monkeypatch.setattr(pipeline_run, "stop_pipeline", stop)


def _train_here(run_dir: Path, cache_dir: Path, *flags: str):  # noqa: ANN202
    """``farlink train`` in this process (typer's runner): the CLI's flags, --resume's reading
    of the run's config.toml, the console's lines."""
    from typer.testing import CliRunner

    from farlink.cli import app

    return CliRunner().invoke(app, ["train", "--run-dir", str(run_dir), "--cache-dir",
                                    str(cache_dir), *flags])


def test_farlink_train_pipeline_stages_learns_checkpoints_each_peer_and_resumes(
        tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 stages x 2 peers on loopback: 8 steps with DiLoCo within a stage every 4, stopped
    after step 4 and resumed; held-out loss drops, every peer checkpointed itself. The stage
    peers are threads (the kill test below runs stage peer processes)."""
    serve_stage_peers_in_threads(monkeypatch)
    run_dir = tmp_path / "run"
    flags = ["--pipeline-stages", "2", "--workers", "4", "--steps", "8", "--inner-steps", "4",
             "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4",
             "--pipeline-micro-batches", "2", "--eval-batches", "2", "--warmup-steps", "2",
             "--lr", "1e-2", "--log-every", "1", "--stage-peer-timeout", "60"]
    first = _train_here(run_dir, cache_dir, *flags, "--stop-at-step", "4")
    assert first.exit_code == 0, first.output[-2000:]
    assert "continue with `farlink train --resume" in " ".join(first.stderr.split())
    for peer in ("s0p0", "s0p1", "s1p0", "s1p1"):
        _, meta = load_checkpoint(checkpoint_path(run_dir / "checkpoints" / peer, 4))
        assert meta["stage"] == int(peer[1])
    assert not (run_dir / "model.safetensors").exists()  # it really stopped early

    second = _train_here(run_dir, cache_dir, "--resume")
    assert second.exit_code == 0, second.output[-2000:]
    records = read_metrics(run_dir / "metrics" / "pipeline.jsonl")
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # nothing redone, nothing skipped
    assert [r["step"] for r in records if r["kind"] == "resume"] == [4]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 4, 8]
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.5, evals
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outer_steps"] == 2 and summary["final_heldout_loss"] == evals[-1]["loss"]
    assert [e["step"] for e in summary["evals"]] == [0, 4, 8]  # both invocations' evaluations
    assert summary["bytes_by_kind"]["activations"] > 0
    assert summary["bytes_by_kind"]["averaging"] > 0
    model = run_dir / "model.safetensors"
    assert hashlib.sha256(model.read_bytes()).hexdigest() == summary["model_sha256"]
    from farlink.train.report import report

    shown = report(run_dir, plot=False)["summary"]  # farlink report reads the pipeline's figures
    assert shown["final_heldout_loss"] == evals[-1]["loss"] and shown["outer_steps"] == 2


def test_a_stage_peer_killed_mid_run_is_routed_around_and_the_run_finishes(
        tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL of one last-stage peer of `farlink train --pipeline-stages 2 --workers 4` once
    step 2 is logged: its micro-batches go to the stage's other peer, the stage's outer rounds
    go on with the survivor, and the run ends with its model and a held-out loss below the
    initial one. Whether a step or a stage's outer round meets the dead peer first depends on
    when the kill lands (a step re-routes, a round drops it from the router);
    ``tests/test_pipeline.py`` pins the re-routing of a step at a known point. The command runs
    in this process (typer's runner); stage 1's peers are processes (one of them is killed),
    stage 0's are served on threads."""
    import os
    import signal
    import time

    from procfs import descendants

    serve_stage_peers_in_threads(monkeypatch, stages=frozenset({0}))
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics" / "pipeline.jsonl"
    run_ended = threading.Event()
    killed: list[list[int]] = []

    def kill_a_peer_of_stage_one_after_step_two() -> None:
        deadline = time.monotonic() + 240
        while not any(r.get("step", 0) >= 2 and r["kind"] == "step"
                      for r in read_metrics(metrics)):
            if run_ended.is_set() or time.monotonic() > deadline:
                return
            time.sleep(0.2)
        victims = [pid for pid in descendants(os.getpid())
                   if b"--stage\x001\x00" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        killed.append(victims)
        if len(victims) == 2:  # the two peers of stage 1
            os.kill(victims[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_a_peer_of_stage_one_after_step_two, daemon=True)
    killer.start()
    try:
        result = _train_here(run_dir, cache_dir, "--pipeline-stages", "2", "--workers", "4",
                             "--steps", "8", "--inner-steps", "4", "--vocab-size", "512",
                             "--seq-len", "32", "--batch-size", "4", "--pipeline-micro-batches",
                             "2", "--eval-batches", "2", "--warmup-steps", "2", "--lr", "1e-2",
                             "--log-every", "1")
    finally:
        run_ended.set()
        killer.join(timeout=30)
    assert result.exit_code == 0, result.output[-2000:]
    assert [len(victims) for victims in killed] == [2], killed  # one of stage 1's two peers
    records = read_metrics(metrics)
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 9))
    assert [r["live_peers"] for r in records if r["kind"] == "sync"][-1] == [2, 1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["live_peers"].values()).count(False) == 1
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.5, evals
    assert (run_dir / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_pipeline_runs_with_the_exchange_options_of_any_run(tmp_path: Path,
                                                              cache_dir: Path) -> None:
    """`farlink train --pipeline-stages 2` with what pipelines refused before: --aggregator
    median, --grad-accum 2 and --emulate-link. The stages' rounds go through the run's exchange
    (the members' fp32 all-reduce: half the stage weights per member and round), each step
    holds grad_accum batches, and the run learns."""
    run_dir = tmp_path / "run"
    result = _train(run_dir, cache_dir, "--pipeline-stages", "2", "--workers", "4", "--steps",
                    "4", "--inner-steps", "2", "--vocab-size", "512", "--seq-len", "32",
                    "--batch-size", "4", "--pipeline-micro-batches", "2", "--eval-batches", "2",
                    "--warmup-steps", "1", "--lr", "1e-2", "--aggregator", "median", "--grad-accum", "2",
                    "--emulate-link", "datacenter")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["total_tokens"] == 4 * 2 * 2 * 4 * 32  # steps x replicas x grad_accum x batch
    records = read_metrics(run_dir / "metrics" / "pipeline.jsonl")
    rounds = [r["exchange_bytes"] for r in records if r["kind"] == "sync"]
    assert len(rounds) == 2 and 0 < rounds[0] < rounds[1]  # cumulative
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.3, evals


@pytest.mark.slow
def test_a_pipeline_with_round_seconds_runs_as_many_steps_as_fit_in_each_round(
        tmp_path: Path, cache_dir: Path) -> None:
    """--round-seconds with pipelines (refused before): the run lasts steps / inner_steps
    rounds of round_seconds each, and a round ends at the step boundary nearest its deadline,
    however many steps that is (here 2 rounds of 6 s: more than the 2 steps a run of
    --steps 2 --inner-steps 1 would take without the budget)."""
    run_dir = tmp_path / "run"
    result = _train(run_dir, cache_dir, "--pipeline-stages", "2", "--workers", "4", "--steps",
                    "2", "--inner-steps", "1", "--round-seconds", "6", "--vocab-size", "512",
                    "--seq-len", "32", "--batch-size", "4", "--pipeline-micro-batches", "2",
                    "--eval-batches", "2", "--warmup-steps", "1", "--lr", "1e-2",
                    "--log-every", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    records = read_metrics(run_dir / "metrics" / "pipeline.jsonl")
    steps = [r["step"] for r in records if r["kind"] == "step"]
    rounds = [r for r in records if r["kind"] == "sync"]
    assert [r["outer_step"] for r in rounds] == [1, 2]
    assert len(steps) > 2 and steps == list(range(1, len(steps) + 1)), steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outer_steps"] == 2 and summary["round_seconds"] == 6.0
    assert (run_dir / "model.safetensors").is_file()
