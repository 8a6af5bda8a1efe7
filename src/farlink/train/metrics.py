"""Per-worker JSONL metrics: one line per event, flushed at once so a crash loses nothing.

Background evaluations write from their own thread: a lock keeps every line whole. With
``--log-to`` the figures of every ``step``, ``sync``, ``eval`` and ``end`` record also go, as
scalars, to the sinks given (TensorBoard, W&B: :mod:`farlink.loggers`); the JSONL stays the
run's own record."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from farlink.loggers import Sink, scalars_of

#: the records whose figures go to the sinks (the others are events: start, resume, ...)
SCALAR_KINDS = frozenset({"step", "sync", "eval", "end"})


class MetricsLog:
    def __init__(self, path: Path, sinks: list[Sink] | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self.sinks = list(sinks or ())
        self.start = time.time()

    def write(self, kind: str, *, extra_scalars: dict[str, Any] | None = None,
              **fields: Any) -> None:
        """One JSONL record; ``extra_scalars`` (figures too bulky for every line, such as the
        rejections per peer) go only to the sinks."""
        record = {"kind": kind, "time": round(time.time(), 3), **fields}
        with self._lock:
            self._fh.write(json.dumps(record) + "\n")
            step = fields.get("step", fields.get("inner_steps"))  # an end record's: its last
            if self.sinks and kind in SCALAR_KINDS and step is not None:
                scalars = scalars_of(kind, {**fields, **(extra_scalars or {})})
                for sink in self.sinks:
                    sink.log(int(step), scalars)

    def close(self) -> None:
        with self._lock:
            self._fh.close()
            for sink in self.sinks:
                sink.close()


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
