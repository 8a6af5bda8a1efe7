"""Nothing a user has is lost or silently wrong: run dirs are never deleted, saved configs are
never rewritten by a joiner or changed under a resumed run, secrets never reach the disk, and a
run that cannot work is refused, with the reason, before any process starts.

Most checks run the real CLI (``farlink train``/``join``) as a user would, with tiny settings.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from farlink.config import ConfigError, load_config
from farlink.testing.runs import launch_in_threads
from farlink.train.launcher import launch, write_run_config
from farlink.train.lighthouse import Lighthouse
from farlink.train.metrics import read_metrics

TINY = {"model": "nano", "steps": 4, "inner_steps": 2, "workers": 2, "vocab_size": 512,
        "seq_len": 64,
        "batch_size": 4, "eval_batches": 2, "warmup_steps": 1, "join_timeout": 10}


def tiny_flags(**changes: object) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in {**TINY, **changes}.items()]


def farlink(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> tuple[int, str]:
    """Run the CLI as a user does; its exit code and everything it printed."""
    proc = subprocess.run([sys.executable, "-m", "farlink.cli", *args], cwd=cwd,
                          env={**os.environ, "COLUMNS": "200", **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout


def farlink_here(*args: str) -> tuple[int, str]:
    """The CLI run in this process (typer's runner) for an invocation that ends before any
    process starts (a refusal, a report): the same app, options and messages as ``python -m
    farlink.cli``, without a fresh interpreter importing torch. An error the CLI does not turn
    into a message and an exit code is raised here (a user would have seen a traceback)."""
    from typer.testing import CliRunner

    from farlink.cli import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def farlink_train_in_threads(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    """``farlink train ARGS`` through the CLI in this process (typer's runner, as
    :func:`farlink_here`): its flags, its config (``--resume`` reading the saved run's), its run
    dir planning and messages and exit code are the CLI's; the run's workers are threads
    (:func:`launch_in_threads`, torchft's real Lighthouse in this process) instead of worker
    processes. For tests whose subject is the run dir the CLI chooses and leaves, not its
    processes (a test using it is marked ``torchft_threads``)."""
    monkeypatch.setattr("farlink.train.launcher.launch",
                        lambda cfg, **_: launch_in_threads(cfg))
    return farlink_here("train", *args)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` and the digest of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def end_record(run_dir: Path, worker: str = "w0") -> dict:
    return [r for r in read_metrics(run_dir / "metrics" / f"{worker}.jsonl")
            if r["kind"] == "end"][-1]


# --- a fresh run never deletes a run dir -----------------------------------------------------

@pytest.mark.torchft_threads
def test_fresh_run_in_a_used_run_dir_is_refused_and_overwrite_moves_it_aside(
        tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusals and the ``--overwrite`` run go through the CLI in this process; the
    overwriting run's workers are threads (the subject is what happens to the run dirs)."""
    run = tmp_path / "run"
    made = launch_in_threads(load_config(None, {**TINY, "run_dir": run, "cache_dir": cache_dir}))
    assert made.returncodes == [0, 0]
    (run / "notes.txt").write_text("the user's own notes")
    before = snapshot(run)
    assert any(name.startswith("checkpoints/") for name in before)

    # a bad invocation and a forgotten --resume: refused, not one byte of the run changed
    code, out = farlink_here("train", *tiny_flags(), "--run-dir", str(run), "--cache-dir",
                             str(cache_dir), "--corpus", str(tmp_path / "missing.txt"))
    assert code == 2, out
    assert snapshot(run) == before
    code, out = farlink_here("train", *tiny_flags(), "--run-dir", str(run), "--cache-dir",
                             str(cache_dir))
    assert code == 2, out
    assert "--resume" in out and "--run-dir" in out and "--overwrite" in out, out
    assert snapshot(run) == before

    # --overwrite: a fresh run here, the old one kept whole next to it
    code, out = farlink_train_in_threads(monkeypatch, *tiny_flags(), "--run-dir", str(run),
                                         "--cache-dir", str(cache_dir), "--overwrite")
    assert code == 0, out
    [old] = tmp_path.glob("run.old-*")
    assert snapshot(old) == before
    assert not (run / "notes.txt").exists() and (run / "final" / "w0.safetensors").is_file()


@pytest.mark.torchft_threads
def test_default_run_dir_is_a_new_dir_per_run_and_resume_follows_latest(
        tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fresh runs with no --run-dir land in two runs/<time> dirs (the first one kept);
    runs/latest names the newest, and `--resume` alone continues it. A stop point belongs to
    its invocation: the resume runs to the end instead of stopping again. The two fresh runs
    are the launcher's run dir planning with workers as threads (a config with no run dir, as
    the CLI builds it without --run-dir); the resume is the CLI's (in this process, its workers
    as threads: the subject is which run dir it continues, not its processes)."""
    monkeypatch.chdir(tmp_path)
    made = launch_in_threads(load_config(None, {**TINY, "cache_dir": cache_dir}))
    assert made.returncodes == [0, 0]
    runs = tmp_path / "runs"
    [first] = [p for p in runs.iterdir() if not p.is_symlink()]
    kept = snapshot(first)

    made = launch_in_threads(load_config(None, {**TINY, "stop_at_step": 2,
                                                "cache_dir": cache_dir}))
    assert made.returncodes == [0, 0]
    dirs = sorted(p for p in runs.iterdir() if not p.is_symlink())
    assert len(dirs) == 2 and snapshot(first) == kept
    [second] = [p for p in dirs if p != first]
    assert (runs / "latest").is_symlink() and (runs / "latest").resolve() == second.resolve()
    assert end_record(second)["inner_steps"] == 2 and not (second / "final").exists()
    assert "stop_at_step" not in (second / "config.toml").read_text()

    code, out = farlink_train_in_threads(monkeypatch, "--resume")  # in tmp_path
    assert code == 0, out
    for worker in ("w0", "w1"):
        end = end_record(second, worker)
        assert end["finished"] and end["inner_steps"] == TINY["steps"], end
    assert (second / "final" / "w0.safetensors").is_file()
    assert snapshot(first) == kept


# --- a joiner and a resumed run leave the saved run as it is ------------------------------------

def test_join_with_the_run_config_never_rewrites_it(tmp_path: Path, cache_dir: Path) -> None:
    from farlink.data import prepare_data

    cfg = load_config(None, {**TINY, "min_replicas": 2, "run_dir": tmp_path / "run",
                             "cache_dir": cache_dir})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    saved = snapshot(cfg.run_dir)
    lighthouse = Lighthouse(min_replicas=2, join_timeout=5).start()
    joiner = subprocess.Popen(
        [sys.executable, "-m", "farlink.cli", "join", "--config",
         str(cfg.run_dir / "config.toml"), "--lighthouse", lighthouse.address, "--index", "1",
         "--secret", "joiner-secret-123"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # the joiner is in: it waits for a quorum that no one else joins
        metrics = cfg.run_dir / "metrics" / "w1.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and any(r["kind"] == "start" for r in read_metrics(metrics))):
            assert joiner.poll() is None, joiner.communicate()[0]
            assert time.monotonic() < deadline, "the joiner never started"
            time.sleep(0.3)
        now = snapshot(cfg.run_dir)
        assert {name: now[name] for name in saved} == saved  # config.toml, config.json as saved
        assert not any(b"joiner-secret-123" in p.read_bytes()
                       for p in cfg.run_dir.rglob("*") if p.is_file())
    finally:
        joiner.kill()
        joiner.wait()
        lighthouse.stop()


def starts(run_dir: Path, worker: str) -> list[dict]:
    path = run_dir / "metrics" / f"{worker}.jsonl"
    return [r for r in read_metrics(path) if r["kind"] == "start"] if path.is_file() else []


def wait_for_start(run_dir: Path, worker: str, proc: subprocess.Popen, count: int) -> None:
    """Until ``worker`` has started ``count`` lives (it then holds its index)."""
    deadline = time.monotonic() + 120
    while len(starts(run_dir, worker)) < count:
        assert proc.poll() is None, f"{worker} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{worker} never started"
        time.sleep(0.3)


# by default: test_an_index_held_by_a_live_process_is_refused_and_free_once_it_is_killed
@pytest.mark.slow
def test_join_refuses_an_index_in_use_and_continues_its_own_after_a_crash(
        tmp_path: Path, cache_dir: Path) -> None:
    """A second process as worker 0 would share its metrics, its checkpoints and its replica
    id: a joiner is refused with a free index. Once worker 0 is SIGKILLed its index is free, a
    plain join of it is told to --resume, and `join --resume --index 0` takes it."""
    from farlink.data import prepare_data
    from farlink.train.index_lock import IndexInUse, check_joinable, holder
    from farlink.train.launcher import _stop_all, spawn_worker

    cfg = load_config(None, {**TINY, "min_replicas": 2, "run_dir": tmp_path / "run",
                             "cache_dir": cache_dir})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    lighthouse = Lighthouse(min_replicas=2, join_timeout=5).start()
    join = ["join", "--config", str(cfg.run_dir / "config.toml"), "--lighthouse",
            lighthouse.address, "--index", "0"]
    procs = [spawn_worker(cfg, 0, lighthouse.address, resume=False)]
    try:  # worker 0 is in: it waits for a quorum that no one else joins
        wait_for_start(cfg.run_dir, "w0", procs[0], 1)
        record = (cfg.run_dir / "metrics" / "w0.jsonl").read_bytes()
        code, out = farlink(*join, timeout=90)
        assert code == 2 and "in use by a live worker" in out and "--index 1" in out, out
        assert procs[0].poll() is None and starts(cfg.run_dir, "w0")[0]["pid"] == procs[0].pid
        assert (cfg.run_dir / "metrics" / "w0.jsonl").read_bytes() == record

        procs[0].kill()
        procs[0].wait()
        with pytest.raises(IndexInUse, match=r"continue that worker with --resume.*--index 1"):
            check_joinable(cfg.run_dir, 0, resume=False)  # what `join` without --resume says
        procs.append(subprocess.Popen([sys.executable, "-m", "farlink.cli", *join, "--resume"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 120  # past the checks, it holds index 0 as its worker
        while holder(cfg.run_dir, 0) != procs[1].pid:
            assert procs[1].poll() is None, f"join --resume exited with {procs[1].returncode}"
            assert time.monotonic() < deadline, "join --resume never took its index"
            time.sleep(0.3)
    finally:
        _stop_all(procs)
        lighthouse.stop()


HOLDS_INDEX_0 = """
import sys, time
from pathlib import Path
from farlink.train.index_lock import IndexLock
lock = IndexLock(Path(sys.argv[1]), 0)  # what a worker holds for its whole life
print("held", flush=True)
time.sleep(600)
"""


def test_an_index_held_by_a_live_process_is_refused_and_free_once_it_is_killed(
        tmp_path: Path) -> None:
    """What ``farlink join`` asks before it starts anything, against a real process holding
    worker 0's index: a joiner is refused with a free index; once the holder is SIGKILLed the
    index is free, a plain join of it is told to --resume, and a resumed worker 0 takes it.
    (The CLI's refusal, against a real worker: the test after this one, with the slow
    scenarios.)"""
    from farlink.train.index_lock import IndexInUse, IndexLock, check_joinable, holder

    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    (run / "metrics" / "w0.jsonl").write_text("{}\n")  # worker 0's record so far
    worker = subprocess.Popen([sys.executable, "-c", HOLDS_INDEX_0, str(run)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "held"
        assert holder(run, 0) == worker.pid
        for resume in (False, True):
            with pytest.raises(IndexInUse, match=rf"in use by a live worker \(pid {worker.pid}\)"
                                                 r".*--index 1"):
                check_joinable(run, 0, resume=resume)
        with pytest.raises(IndexInUse, match="in use by a live worker"):
            IndexLock(run, 0)  # a second process as worker 0 cannot take it either
        worker.kill()
        worker.wait()
    finally:
        worker.kill()
    assert holder(run, 0) is None  # the kernel dropped the lock with the process
    with pytest.raises(IndexInUse, match=r"continue that worker with --resume.*--index 1"):
        check_joinable(run, 0, resume=False)
    check_joinable(run, 0, resume=True)
    lock = IndexLock(run, 0)
    try:
        assert holder(run, 0) == os.getpid()
    finally:
        lock.release()


@pytest.mark.parametrize("change", [{"model": "small"}, {"seq_len": 32}, {"corpus": "other.txt"},
                                    {"seed": 7}, {"batch_size": 2}, {"workers": 3},
                                    {"algorithm": "local_sgd"}, {"inner_steps": 4}])
def test_resume_with_a_config_that_changes_the_model_or_data_is_refused(
        tmp_path: Path, cache_dir: Path, change: dict) -> None:
    cfg = load_config(None, {**TINY, "run_dir": tmp_path / "run", "cache_dir": cache_dir})
    write_run_config(cfg)
    saved = snapshot(cfg.run_dir)
    field = next(iter(change))
    changed = load_config(None, {**TINY, "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                                 "resume": True, **change})
    with pytest.raises(ConfigError, match=field):  # a RunDirError, before anything is written
        launch(changed, show_progress=False)
    assert snapshot(cfg.run_dir) == saved and sorted(os.listdir(cfg.run_dir)) == [
        "config.json", "config.toml"]


def test_resume_may_change_what_does_not_define_the_run(tmp_path: Path,
                                                         cache_dir: Path) -> None:
    """More steps, another learning rate or timeout: the CLI accepts them on --resume, and
    the set of fields that are fixed is the documented one."""
    run = tmp_path / "run"
    write_run_config(load_config(None, {**TINY, "run_dir": run, "cache_dir": cache_dir}))
    code, out = farlink_here("train", "--resume", "--run-dir", str(run), "--model", "small")
    assert code == 2 and "model" in out and "--run-dir" in out, out
    from farlink.train.rundir import FIXED_ON_RESUME

    assert set(FIXED_ON_RESUME) >= {"model", "vocab_size", "seq_len", "corpus", "seed",
                                    "batch_size", "workers", "algorithm"}
    from farlink.train.rundir import plan_run_dir

    longer = load_config(None, {**TINY, "run_dir": run, "cache_dir": cache_dir, "resume": True,
                                "steps": 8, "lr": 1e-3, "quorum_timeout": 60})
    assert plan_run_dir(longer)[0].run_dir == run


# --- secrets ------------------------------------------------------------------------------------

# by default: test_a_run_given_a_secret_file_keeps_it_off_disk_and_console (workers as threads)
@pytest.mark.slow
def test_secret_file_run_keeps_the_secret_off_disk_and_console(tmp_path: Path,
                                                               cache_dir: Path) -> None:
    secret = "s3cret-correct-horse-battery"
    secret_file = tmp_path / "run.secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    run = tmp_path / "run"
    code, out = farlink("train", *tiny_flags(), "--auth", "secret", "--secret-file",
                        str(secret_file), "--run-dir", str(run), "--cache-dir", str(cache_dir))
    assert code == 0, out  # the workers authenticated: they got the secret
    assert secret not in out
    files = [p for p in run.rglob("*") if p.is_file()]
    assert files and not [p for p in files if secret.encode() in p.read_bytes()]
    assert "secret_file =" not in (run / "config.toml").read_text()
    assert 'auth = "secret"' in (run / "config.toml").read_text()


@pytest.mark.torchft_threads  # torchft in this process: after every test that forks
def test_a_run_given_a_secret_file_keeps_it_off_disk_and_console(
        tmp_path: Path, cache_dir: Path, capfd: pytest.CaptureFixture) -> None:
    """The same run with its workers as threads (the gated Lighthouse a process, given the
    secret as the launcher gives it): the workers authenticate, and the secret is in no file of
    the run dir and on no console line it printed. (`farlink train --secret-file`, its console
    and its worker processes:
    test_secret_file_run_keeps_the_secret_off_disk_and_console, with the slow scenarios.)"""
    secret = "s3cret-correct-horse-battery"
    secret_file = tmp_path / "run.secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    run = tmp_path / "run"
    cfg = load_config(None, {**TINY, "auth": "secret", "secret_file": secret_file,
                             "run_dir": run, "cache_dir": cache_dir})
    assert launch_in_threads(cfg).returncodes == [0, 0]  # they authenticated: they got it
    out, err = capfd.readouterr()
    assert secret not in out + err  # what this process printed (the CLI's: the test above)
    files = [p for p in run.rglob("*") if p.is_file()]
    assert files and not [p for p in files if secret.encode() in p.read_bytes()]
    assert "secret_file =" not in (run / "config.toml").read_text()
    assert 'auth = "secret"' in (run / "config.toml").read_text()


def test_secret_sources_and_a_secret_file_others_can_read(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    exposed = tmp_path / "exposed.secret"
    exposed.write_text("abc\n")
    exposed.chmod(0o644)
    from farlink.robust.auth import read_secret_file, resolve_secret

    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(exposed)
    code, out = farlink_here("train", "--auth", "secret", "--secret-file", str(exposed),
                             "--run-dir", str(tmp_path / "run"))
    assert code == 2 and "chmod 600" in out, out
    assert not (tmp_path / "run").exists()

    exposed.chmod(0o600)
    monkeypatch.setenv("FARLINK_SECRET", "from-env")
    assert resolve_secret(None, exposed) == "abc"  # an explicit source wins over the env
    assert resolve_secret("flag", None) == "flag"
    assert resolve_secret(None, None) == "from-env"
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, {"secret": "x", "secret_file": exposed})
    cfg = load_config(None, {"auth": "secret", "secret": "never-saved-42",
                             "run_dir": tmp_path / "r"})
    assert "never-saved-42" not in repr(cfg) and "never-saved-42" not in cfg.model_dump_json()
    write_run_config(cfg)  # what the launcher saves for a run given --secret
    assert sorted(os.listdir(cfg.run_dir)) == ["config.json", "config.toml"]
    assert not [p for p in cfg.run_dir.iterdir() if b"never-saved-42" in p.read_bytes()]


# --- refused up front ---------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["diloco", "local_sgd", "streaming_diloco", "sparseloco",
                                       "hierarchical_diloco"])
def test_steps_below_inner_steps_are_refused_for_round_based_algorithms(algorithm: str) -> None:
    extra = {"island_steps": 5} if algorithm == "hierarchical_diloco" else {}
    with pytest.raises(ConfigError, match="0 outer rounds"):
        load_config(None, {"algorithm": algorithm, "steps": 5, "inner_steps": 10,
                           "warmup_steps": 0, **extra})


@pytest.mark.parametrize("algorithm", ["ddp", "demo"])
def test_algorithms_that_sync_every_step_take_any_number_of_steps(algorithm: str) -> None:
    assert load_config(None, {"algorithm": algorithm, "steps": 5, "inner_steps": 10,
                              "warmup_steps": 0}).steps == 5


def _small_corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "small"
    corpus.mkdir()
    (corpus / "a.txt").write_text("In the beginning was the word. " * 40)
    (corpus / "b.txt").write_text("And the word was short.\n")
    return corpus


@pytest.mark.parametrize("case", ["model", "shards", "rounds", "keys"])
def test_a_run_that_cannot_work_is_refused_before_anything_starts(
        tmp_path: Path, cache_dir: Path, case: str) -> None:
    flags, reason = {
        "model": (["--model", "nonexistent"], "tiny, small"),
        "shards": (["--corpus", str(_small_corpus(tmp_path)), "--vocab-size", "300"],
                   "shard 0/2 has"),
        "rounds": (["--steps", "1"], "0 outer rounds"),
        "keys": (["--auth", "ed25519", "--allowed-keys", str(tmp_path / "no-such-keys")],
                 "no-such-keys"),
    }[case]
    run = tmp_path / "run"
    code, out = farlink_here("train", *tiny_flags(), *flags, "--run-dir", str(run),
                             "--cache-dir", str(cache_dir))
    assert code == 2 and reason in out, out
    assert not run.exists()  # no config written, no Lighthouse log, no worker log


def test_a_failing_worker_shows_the_end_of_its_log(tmp_path: Path, cache_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies after the launcher's checks (here: a log level it cannot parse) has
    its error on the console, not only an exit code and a log path. The workers are processes
    (a worker's exit code and log are the subject); the CLI that launches them runs in this
    process (typer's runner: the same command, its console and exit code)."""
    run = tmp_path / "run"
    monkeypatch.setenv("FARLINK_LOG", "NOT-A-LEVEL")  # what the worker processes inherit
    code, out = farlink_here("train", *tiny_flags(), "--run-dir", str(run), "--cache-dir",
                             str(cache_dir))
    assert code == 1, out
    last = (run / "logs" / "w0.log").read_text().strip().splitlines()[-1]
    assert "NOT-A-LEVEL" in last and last in out, out
    assert "worker w0 exited with code 1" in out, out
