"""One way to write a file that readers never see half-written: write a temporary file beside
it, then rename it into place (``os.replace`` is atomic on POSIX), so a concurrent reader or a
crash leaves either the old content or the new one.

Temporary names are ``.NAME.tmp-UNIQUE-PID``: unique per write (threads of one process may write
the same file), hidden, and recognised by
:func:`~farlink.state.checkpoint.remove_stale_temps`, which deletes those whose process died
mid-write."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

TEMP_PREFIX = ".tmp-"
_unique = itertools.count()


def temp_path(path: Path) -> Path:
    """A fresh temporary name beside ``path`` (ends in ``-PID``)."""
    return path.with_name(f".{path.name}{TEMP_PREFIX}{next(_unique)}-{os.getpid()}")


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` and wait until it is on disk (what a checkpoint's files need)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write(path: Path, data: bytes | str, *, sync: bool = False) -> None:
    """Replace ``path`` by ``data`` (text is UTF-8) all at once, creating its directory;
    ``sync``: on disk before the rename (a checkpoint's pointer), not only in the page cache."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    blob = data.encode("utf-8") if isinstance(data, str) else data
    try:
        if sync:
            write_synced(tmp, blob)
        else:
            tmp.write_bytes(blob)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
