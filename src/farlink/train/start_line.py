"""A start line for the workers one ``farlink train`` launches together.

A torchft Lighthouse forms a quorum from the peers that heartbeat when the first one asks; a peer
still importing torch or loading its data is not one of them. On a busy machine the fast worker
then commits its first rounds alone (a group of one) and the replicas only meet later, or, in a
short run, never. Each worker therefore reaches the line once its collective is up (its Manager
heartbeats from then on) and waits there until all of its launch's workers have, so the first
quorum counts them all. A worker that never arrives holds the others for ``join_timeout`` at most,
which is what the Lighthouse would wait anyway; a worker restarted later, or a joiner, is not held.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger("farlink.start")

LINE_ENV = "FARLINK_START_LINE"
PEERS_ENV = "FARLINK_START_PEERS"


class StartLine:
    """A dir the workers of one launch mark when ready; the launcher makes and removes it."""

    def __init__(self, workers: int, path: Path | None = None) -> None:
        self.workers = workers
        self.path = path or Path(tempfile.mkdtemp(prefix="farlink-start-"))

    @classmethod
    def from_env(cls) -> StartLine | None:
        """The line the launcher named in this process's environment (taken out of it, so
        children do not inherit it); None for a joiner, a restart or library use."""
        path, peers = os.environ.pop(LINE_ENV, None), os.environ.pop(PEERS_ENV, "")
        if not path or not peers.isdigit() or not Path(path).is_dir():
            return None
        return cls(int(peers), Path(path))

    def env(self) -> dict[str, str]:
        return {LINE_ENV: str(self.path), PEERS_ENV: str(self.workers)}

    def wait(self, index: int, timeout: float) -> float:
        """Mark worker ``index`` ready and wait for the others, ``timeout`` at most; the seconds
        waited."""
        start = time.monotonic()
        (self.path / f"w{index}").touch()
        while len(list(self.path.iterdir())) < self.workers:
            if time.monotonic() - start > timeout:
                arrived = sorted(p.name for p in self.path.iterdir())
                log.warning("only %s of %d workers ready after %.0f s; starting without the "
                            "rest (they join the rounds when they arrive)", ", ".join(arrived),
                            self.workers, timeout)
                break
            time.sleep(0.05)
        return time.monotonic() - start

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)  # only the launcher's own markers
