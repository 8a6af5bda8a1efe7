"""Local workers are forks of the launcher's preloaded fork server, started as ``Popen`` started
them: their own session, ``farlink.worker`` in their command line, their exit status (a negative
signal number when killed) through the same interface; ``FARLINK_WORKER_START`` picks the way."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from procfs import command_line, parent

from farlink.config import ConfigError, RunConfig
from farlink.train.forkserver import ForkedWorker
from farlink.train.index_lock import IndexLock
from farlink.train.launcher import check_launch, spawn_worker
from farlink.train.rundir import write_run_config


def test_a_local_worker_is_forked_from_the_fork_server_and_ends_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FARLINK_WORKER_START", raising=False)
    cfg = RunConfig(run_dir=tmp_path / "run", workers=1)
    write_run_config(cfg)
    held = IndexLock(cfg.run_dir, 0)  # the worker waits for its index: alive, cheaply
    try:
        worker = spawn_worker(cfg, 0, "http://127.0.0.1:1", resume=False)
        assert isinstance(worker, ForkedWorker)
        named = f"-m farlink.worker {cfg.run_dir} 0 --lighthouse http://127.0.0.1:1"
        deadline = time.monotonic() + 30  # as `ps` shows it, once the fork has named itself
        while named not in command_line(worker.pid):
            assert worker.poll() is None and time.monotonic() < deadline, command_line(worker.pid)
            time.sleep(0.05)
        server = parent(worker.pid)
        assert server != os.getpid() and parent(server) == os.getpid()  # the fork server's child
        assert os.getsid(worker.pid) == worker.pid  # its own session: Ctrl-C is the launcher's
        assert worker.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(timeout=0.1)
        worker.kill()
        assert worker.wait(timeout=30) == -signal.SIGKILL == worker.returncode
    finally:
        held.release()

    # a worker that fails ends with the interpreter's code, its traceback in its log
    broken = RunConfig(run_dir=tmp_path / "not-prepared", workers=1)
    failed = spawn_worker(broken, 0, "http://127.0.0.1:1", resume=False)
    assert failed.wait(timeout=60) == 1
    assert "config.json" in (broken.run_dir / "logs" / "w0.log").read_text()


def test_worker_start_spawn_starts_an_interpreter_and_a_wrong_value_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RunConfig(run_dir=tmp_path / "run", workers=1)
    monkeypatch.setenv("FARLINK_WORKER_START", "spawn")
    started = spawn_worker(cfg, 0, "http://127.0.0.1:1", resume=False)
    assert isinstance(started, subprocess.Popen)
    started.kill()
    assert started.wait(timeout=30) == -signal.SIGKILL
    monkeypatch.setenv("FARLINK_WORKER_START", "fork")
    with pytest.raises(ConfigError, match="FARLINK_WORKER_START='fork'.*'forkserver'.*'spawn'"):
        check_launch(cfg)
