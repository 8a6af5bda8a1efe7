"""Whole runs on localhost with their workers as threads (``farlink.testing``) against torchft's
real Lighthouse and Gloo, on the smallest model. A run of worker processes and a Lighthouse
process through the CLI, to its end: test_orphans.py::
test_sigkilled_launcher_leaves_no_process_and_resume_finishes[torchft] (its ``--resume`` run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from farlink.config import ConfigError, load_config
from farlink.testing.runs import launch_in_threads
from farlink.train.audit import audit_run
from farlink.train.metrics import read_metrics

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

SMALL = {"vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 4,
         "warmup_steps": 5, "log_every": 5, "join_timeout": 10, "heartbeat_timeout": 3}


def small_config(tmp_path: Path, cache_dir: Path, **overrides):  # noqa: ANN003, ANN201
    return load_config(None, {**SMALL, "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                              **overrides})


def final_params(run_dir: Path) -> list[dict]:
    return [load_file(str(p)) for p in sorted((run_dir / "final").glob("w*.safetensors"))]


def audit_fingerprint(run_dir: Path) -> str:
    """The fingerprint w0 logged for its last committed round."""
    syncs = [r for r in read_metrics(run_dir / "metrics" / "w0.jsonl")
             if r["kind"] == "sync" and r["committed"]]
    return syncs[-1]["fingerprint"]


def test_diloco_three_workers_agree_and_learn(tmp_path: Path, cache_dir: Path) -> None:
    """Workers as threads: a worker process's setup (imports, model, data) was most of this
    run's cost. The process path (worker processes, the Lighthouse binary, exit codes 0):
    test_orphans.py::test_sigkilled_launcher_leaves_no_process_and_resume_finishes[torchft]."""
    cfg = small_config(tmp_path, cache_dir, workers=3, steps=30, inner_steps=10, lr=3e-3,
                       model="nano")
    result = launch_in_threads(cfg)
    assert result.returncodes == [0, 0, 0]
    models = final_params(cfg.run_dir)
    assert len(models) == 3
    for other in models[1:]:
        assert other.keys() == models[0].keys()
        for name in models[0]:
            assert (other[name] == models[0][name]).all(), name  # bit-identical replicas
    audit = audit_run(cfg.run_dir)
    assert audit["consistent"] and audit["outer_steps"] == 3
    first_losses = [r["loss"] for r in read_metrics(cfg.run_dir / "metrics" / "w0.jsonl")
                    if r["kind"] in ("step", "sync")][:1]
    assert result.summary["final_heldout_loss"] < first_losses[0] - 0.5, (
        result.summary["final_heldout_loss"], first_losses)
    assert (cfg.run_dir / "model.safetensors").is_file()
    assert (cfg.run_dir / "config.toml").is_file()
    ended = result.summary["final_replicas"]
    assert ended["consistent"] and ended["holders"] == ["w0", "w1", "w2"]
    assert {tuple(v) for v in ended["states"].values()} == {(3, audit_fingerprint(cfg.run_dir))}
    w = result.summary["per_worker"]["w0"]
    assert w["bytes_sent"] > 0 and 0 < w["compute_utilization"] <= 1
    # each round's time splits into quorum, wire and local work (what the planner is fed)
    syncs = [r for r in read_metrics(cfg.run_dir / "metrics" / "w1.jsonl") if r["kind"] == "sync"]
    last = syncs[-1]
    assert last["quorum_s"] > 0 and last["network_s"] > 0
    assert last["quorum_s"] + last["network_s"] <= last["rounds_s"] <= last["comm_s"] + 1e-3


@pytest.mark.parametrize("algorithm,codec", [
    ("ddp", "none"), ("local_sgd", "none"), ("streaming_diloco", "int4+ef"), ("demo", "none"),
    ("diloco", "int8+ef"), ("sparseloco", "none"),
])
def test_every_algorithm_keeps_replicas_in_agreement(tmp_path: Path, cache_dir: Path,
                                                     algorithm: str, codec: str) -> None:
    streaming = {"fragments": 2, "overlap_steps": 2} \
        if algorithm == "streaming_diloco" else {}  # options the others do not read
    cfg = small_config(tmp_path, cache_dir, workers=2, steps=30, inner_steps=10, model="nano",
                       algorithm=algorithm, codec=codec, **streaming)
    result = launch_in_threads(cfg)
    assert result.returncodes == [0, 0]
    if cfg.sync_every > 1:
        audit = audit_run(cfg.run_dir)
        assert audit["consistent"] and audit["outer_steps"] >= 3, audit
    if algorithm != "streaming_diloco":  # streaming mixes global into local copies by alpha
        a, b = final_params(cfg.run_dir)
        assert all((a[k] == b[k]).all() for k in a)


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="algorithm 'nope' unknown"):
        load_config(None, {"algorithm": "nope"})
    with pytest.raises(ConfigError, match="batch_size"):
        load_config(None, {"batch_size": 0})
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = [oops")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="would reject honest updates"):
        load_config(None, {"screen_ratio": 0.5})


def test_screen_ratio_zero_turns_the_norm_screen_off(tmp_path: Path) -> None:
    """A flag left unset is ignored, so "off" needs a value of its own: 0."""
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nscreen_ratio = 0\n")
    assert load_config(toml).screen_ratio == 0
    assert load_config(None, {"screen_ratio": None}).screen_ratio == 10.0


def test_cli_reports_missing_corpus_and_bad_flags(tmp_path: Path) -> None:
    from farlink.cli import app

    runner = CliRunner()
    missing = tmp_path / "no-such-corpus"
    result = runner.invoke(app, ["train", "--corpus", str(missing), "--run-dir",
                                 str(tmp_path / "r"), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 2
    assert str(missing) in result.output
    result = runner.invoke(app, ["train", "--algorithm", "bogus"])
    assert result.exit_code == 2 and "bogus" in result.output


def test_toml_config_and_flags_precedence(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[train]\nalgorithm = "ddp"\nsteps = 123\nworkers = 2\n')
    cfg = load_config(path, {"steps": 77, "codec": None})
    assert (cfg.algorithm, cfg.steps, cfg.workers, cfg.codec) == ("ddp", 77, 2, "none")


def test_paced_workers_run_at_their_emulated_speeds(tmp_path: Path, cache_dir: Path) -> None:
    """--pace-seconds pads every step to slowdown x pace: worker 1 (factor 2) spends twice as
    long per step as worker 0, whatever else shares the cores."""
    cfg = small_config(tmp_path, cache_dir, workers=2, steps=6, inner_steps=3, slowdown="1,2",
                       pace_seconds=0.4, model="nano")
    result = launch_in_threads(cfg)
    assert result.returncodes == [0, 0]
    w0, w1 = (result.summary["per_worker"][w] for w in ("w0", "w1"))
    assert w0["pace_overruns"] == 0 and w1["pace_overruns"] == 0
    assert 6 * 0.4 <= w0["compute_s"] < 6 * 0.4 + 1.5
    assert 6 * 0.8 <= w1["compute_s"] < 6 * 0.8 + 1.5


def test_time_budgeted_rounds_keep_a_slow_worker_in_every_round(tmp_path: Path,
                                                                cache_dir: Path) -> None:
    """Flat DiLoCo with rounds of equal time: a paced worker 4x slower than the others runs
    fewer inner steps per round instead of holding every round up, all replicas stay
    bit-identical, and the slow worker is in every quorum."""
    cfg = small_config(tmp_path, cache_dir, workers=3, steps=30, inner_steps=10,
                       slowdown="1,1,4", pace_seconds=0.25, round_seconds=3.0, model="nano")
    result = launch_in_threads(cfg)
    assert result.returncodes == [0, 0, 0]
    audit = audit_run(cfg.run_dir)
    assert audit["consistent"] and audit["outer_steps"] == 3, audit
    syncs = {w: [r for r in read_metrics(cfg.run_dir / "metrics" / f"{w}.jsonl")
                 if r["kind"] == "sync"] for w in ("w0", "w1", "w2")}
    assert all(r["world_size"] == 3 and r["committed"] for rs in syncs.values() for r in rs)
    a, b, c = final_params(cfg.run_dir)
    assert all((a[k] == b[k]).all() and (a[k] == c[k]).all() for k in a)
    per = result.summary["per_worker"]
    # ~12 steps per round at full speed, ~3 at a quarter (the nearest step boundary to 3 s); the
    # pace is a floor on a step's time, so it is set well above a nano step's compute on a busy
    # machine (at 0.1 s, load 23 slowed full-speed steps to a third of a round's steps);
    # w1 is the full-speed reference: w0 shares its cores with its background evaluations
    assert per["w2"]["tokens"] < 0.5 * per["w1"]["tokens"]
    assert per["w2"]["tokens"] >= 3 * 2 * cfg.batch_size * cfg.seq_len
    # the slow worker waited less than a step per round for the others, on average (its
    # wall-clock also counts its process's setup, which is no waiting for others)
    assert per["w2"]["compute_s"] > 0.6 * (per["w2"]["wall_s"] - per["w2"]["setup_s"])
