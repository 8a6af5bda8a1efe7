"""The torchft Lighthouse as a child process.

It is the organizational mode's one central piece (quorum membership, not data): when it dies,
rounds cannot form, but no state lives in it, so restarting it on the same address lets workers
reconnect and continue. Running it as a separate process is what makes that restart possible.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Lighthouse:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        min_replicas: int = 1,
        join_timeout: float = 30.0,
        heartbeat_timeout: float = 5.0,
        log_path: Path | None = None,
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        self.min_replicas = min_replicas
        self.join_timeout, self.heartbeat_timeout = join_timeout, heartbeat_timeout
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, wait: float = 60.0) -> Lighthouse:
        binary = shutil.which("torchft_lighthouse") or str(
            Path(sys.executable).with_name("torchft_lighthouse")
        )
        argv = [
            binary, "--bind", f"{self.host}:{self.port}",
            "--min_replicas", str(self.min_replicas),
            "--join_timeout_ms", str(int(self.join_timeout * 1000)),
            "--heartbeat_timeout_ms", str(int(self.heartbeat_timeout * 1000)),
            "--quorum_tick_ms", "20",
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + wait
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"Lighthouse exited with code {self.proc.returncode} at {self.address} "
                    f"(port in use? see {self.log_path})"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"Lighthouse did not listen on {self.address} within {wait:.0f}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.kill() if kill else self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
