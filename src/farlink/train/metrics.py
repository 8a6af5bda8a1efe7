"""Per-worker JSONL metrics: one line per event, flushed at once so a crash loses nothing.

Background evaluations write from their own thread: a lock keeps every line whole."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self.start = time.time()

    def write(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "time": round(time.time(), 3), **fields}
        with self._lock:
            self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read_metrics(path: Path) -> list[dict]:
    """All complete records of a JSONL file (a torn last line from a crash is skipped)."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
