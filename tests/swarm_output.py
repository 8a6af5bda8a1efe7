"""What the ``farlink swarm`` tests read from a peer's output (a helper module, not tests)."""

from __future__ import annotations

import re
import signal
import subprocess
import time


def read_multiaddress(proc: subprocess.Popen, host: str = "127.0.0.1",
                      timeout: float = 60) -> str:
    """The first full multiaddress on ``host`` that ``proc`` prints; fails with its stderr if the
    peer exits or prints none within ``timeout`` seconds."""
    pattern = re.compile(rf"^/ip4/{re.escape(host)}/tcp/\d+/p2p/\w+$")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline().strip()
        if pattern.match(line):
            return line
        if proc.poll() is not None:
            break
    raise AssertionError(f"no multiaddress on {host}; stderr: {proc.stderr.read()}")


def stop(proc: subprocess.Popen | None) -> None:
    """Ctrl-C a swarm peer and wait for it; SIGKILL it if it has not stopped within 30 s."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
