"""Stage peers as real processes on this machine, for the CLI, benchmarks and tests."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from farlink.model import GPTConfig
from farlink.parallel.stage_auth import TOKEN_ENV, driver_token
from farlink.parallel.stage_server import config_json


@dataclass
class StagePeer:
    stage: int
    address: str  # host:port
    process: subprocess.Popen

    def kill(self) -> None:
        """SIGKILL, as a crash or a preempted machine would end it."""
        self.process.kill()
        self.process.wait()


def start_stage_peer(config: GPTConfig, stage: int, stages: int, seed: int = 0,
                     lr: float = 3e-3, slowdown: float = 1.0, link_mbit: float | None = None,
                     link_ms: float = 0.0, memory_cap_mb: float | None = None,
                     host: str = "127.0.0.1", ready_timeout: float = 120.0,
                     weight_decay: float = 0.1, threads: int = 1,
                     log_path: Path | None = None,
                     env: dict[str, str] | None = None, token: str | None = None,
                     checkpoint_dir: Path | None = None) -> StagePeer:
    """Start ``python -m farlink.parallel.stage_server`` and wait for its READY line; with
    ``log_path``, its stderr (warnings, a traceback) goes there instead of a pipe nobody reads
    once it runs. The peer serves only the holder of ``token`` (default: this process's
    :func:`~farlink.parallel.stage_auth.driver_token`, which trainers built here use too), and
    keeps its checkpoints under ``checkpoint_dir``."""
    cmd = [sys.executable, "-m", "farlink.parallel.stage_server", "--stage", str(stage),
           "--stages", str(stages), "--config", config_json(config), "--seed", str(seed),
           "--lr", str(lr), "--slowdown", str(slowdown), "--host", host,
           "--link-ms", str(link_ms), "--weight-decay", str(weight_decay),
           "--threads", str(threads)]
    if link_mbit is not None:
        cmd += ["--link-mbit", str(link_mbit)]
    if memory_cap_mb is not None:
        cmd += ["--memory-cap-mb", str(memory_cap_mb)]
    if checkpoint_dir is not None:
        cmd += ["--checkpoint-dir", str(checkpoint_dir)]
    stderr = subprocess.PIPE
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        stderr = open(log_path, "ab")
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr,
                               env={**os.environ, **(env or {}),
                                    TOKEN_ENV: token or driver_token()}, text=True)
    if log_path is not None:
        stderr.close()  # the child holds its own copy
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            line = process.stdout.readline()
            if line.startswith("READY "):
                return StagePeer(stage, f"{host}:{int(line.split()[1])}", process)
        if process.poll() is not None:
            break
    process.kill()
    _, err = process.communicate()
    if log_path is not None:
        err = log_path.read_text(errors="replace")
    raise RuntimeError(f"stage {stage} peer did not start: {err.strip()[-500:]}")


def start_pipeline(config: GPTConfig, stages: int, peers_per_stage: int = 1,
                   **options) -> list[list[StagePeer]]:
    """``peers_per_stage`` peers for each of ``stages`` stages, all from the same seed."""
    started: list[list[StagePeer]] = []
    try:
        for s in range(stages):
            started.append([start_stage_peer(config, s, stages, **options)
                            for _ in range(peers_per_stage)])
    except BaseException:
        stop_pipeline(started)
        raise
    return started


def stop_pipeline(peers: list[list[StagePeer]]) -> None:
    for stage in peers:
        for peer in stage:
            if peer.process.poll() is None:
                peer.process.kill()
            peer.process.wait()
            for stream in (peer.process.stdout, peer.process.stderr):
                if stream:
                    stream.close()
