"""The torchft Lighthouse as a child process.

It is the organizational mode's one central piece (quorum membership, not data): when it dies,
rounds cannot form, but no state lives in it, so restarting it on the same address lets workers
reconnect and continue. Running it as a separate process is what makes that restart possible.

With an ``authenticator`` (a run with ``--auth``) the Lighthouse itself binds a loopback port and a
:class:`~farlink.robust.gate.Gate` listens on the advertised address: only peers that prove
membership reach it, so a non-member never enters a quorum or learns the members' addresses.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from farlink.lifeline import popen_tied
from farlink.listeners import listening

if TYPE_CHECKING:
    from farlink.robust.auth import Authenticator
    from farlink.robust.gate import Gate


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on ``port`` (a connection that succeeds may reach
    another process that took the port first). Without /proc (not Linux), any listener
    counts."""
    if not Path("/proc/net/tcp").exists():
        return not port_free("127.0.0.1", port)
    return any(held == port for _, _, held in listening({pid}))


class Lighthouse:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        min_replicas: int = 1,
        join_timeout: float = 30.0,
        heartbeat_timeout: float = 5.0,
        log_path: Path | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        # a port picked here may be taken by another process before the Lighthouse binds it:
        # then start() picks another one (a port the caller named is refused instead)
        self._port_picked = port is None or authenticator is not None
        self.authenticator = authenticator
        self.gate: Gate | None = None
        # behind a gate the Lighthouse listens on loopback only; the gate takes the address
        self.bind_host = "127.0.0.1" if authenticator is not None else self.host
        self.bind_port = free_port(self.bind_host) if authenticator is not None else self.port
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
            binary, "--bind", f"{self.bind_host}:{self.bind_port}",
            "--min_replicas", str(self.min_replicas),
            "--join_timeout_ms", str(int(self.join_timeout * 1000)),
            "--heartbeat_timeout_ms", str(int(self.heartbeat_timeout * 1000)),
            "--quorum_tick_ms", "20",
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        deadline = time.time() + wait
        for attempt in range(3):
            # tied to this process: a launcher killed with SIGKILL takes its Lighthouse along
            self.proc = popen_tied(argv, stdout=out, stderr=subprocess.STDOUT)
            while time.time() < deadline and self.proc.poll() is None:
                if listens(self.proc.pid, self.bind_port):
                    return self._start_gate()
                time.sleep(0.1)
            if self.proc.poll() is None:
                break
            taken = not port_free(self.bind_host, self.bind_port)
            if not (taken and self._port_picked and attempt < 2):
                raise RuntimeError(
                    f"Lighthouse exited with code {self.proc.returncode} at {self.address}"
                    f"{' (its port is in use by another process)' if taken else ''}; see "
                    f"{self.log_path or 'its output'}")
            self._repick_port()  # another process took the port picked for it: pick again
            argv[2] = f"{self.bind_host}:{self.bind_port}"
        self.stop(kill=True)
        raise RuntimeError(f"Lighthouse did not listen on {self.address} within {wait:.0f}s")

    def _repick_port(self) -> None:
        self.bind_port = free_port(self.bind_host)
        if self.authenticator is None:
            self.port = self.bind_port

    def _start_gate(self) -> Lighthouse:
        if self.authenticator is None:
            return self
        from farlink.robust.gate import Gate

        gate_log = self.log_path.with_name("gate.log") if self.log_path else None
        try:
            self.gate = Gate(self.authenticator, (self.bind_host, self.bind_port), self.host,
                             self.port, name="Lighthouse", log_path=gate_log).start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, kill: bool = False) -> None:
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.kill() if kill else self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
