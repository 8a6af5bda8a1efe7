"""Ownership records for emulated topologies, so cleanup can never hit someone else's network.

Every topology (or capability probe) gets a run prefix ``flk-<pid>-<n>`` and a marker file
``<prefix>.json`` in :func:`marker_dir` (``/run/farlink``, else ``/tmp/farlink``). A namespace is
recorded in the marker *before* it is created, so a crash at any point leaves a record of
everything that may exist. Deletion goes through :func:`remove_namespace`, which refuses any name
that lacks the run's prefix or is not in its marker, whoever asks. Interfaces, addresses,
qdiscs and iptables rules all live inside the run's namespaces and vanish with them; nothing is
ever created in the host namespace, so there is nothing there to clean.

A run is stale when its owner pid no longer exists, or exists with another start time (pid
reuse); :func:`cleanup_stale` removes exactly those runs' namespaces and markers.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from farlink.emulate import sysnet
from farlink.emulate.errors import EmulationError
from farlink.lifeline import process_running
from farlink.state.files import atomic_write

log = logging.getLogger(__name__)

PREFIX_RE = re.compile(r"^flk-(\d+)-(\d+)$")
_counter = itertools.count()


class ForeignResourceError(EmulationError):
    """Refused: the namespace was not created by the run that asked to remove it."""


def marker_dir() -> Path:
    """Where run markers live: ``$FARLINK_EMULATE_DIR``, ``/run/farlink`` or ``/tmp/farlink``."""
    env = os.environ.get("FARLINK_EMULATE_DIR")
    candidates = [Path(env)] if env else [Path("/run/farlink"), Path(tempfile.gettempdir()) / "farlink"]
    for path in candidates:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise EmulationError(f"no writable marker directory among {[str(p) for p in candidates]}")


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after "comm)"


@dataclass
class RunRecord:
    """What one run created: its prefix, owner and the namespaces (with their interfaces)."""

    prefix: str
    pid: int
    start_ticks: int
    created: float
    namespaces: list[str] = field(default_factory=list)
    interfaces: dict[str, list[str]] = field(default_factory=dict)
    path: str = ""

    @classmethod
    def new(cls, directory: Path | None = None) -> RunRecord:
        directory = directory or marker_dir()
        pid = os.getpid()
        ticks = process_start_ticks(pid)
        assert ticks is not None  # we are alive
        while True:
            prefix = f"flk-{pid}-{next(_counter)}"
            path = directory / f"{prefix}.json"
            if not path.exists():
                break
        record = cls(prefix, pid, ticks, time.time(), path=str(path))
        record.save()
        return record

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        data = json.loads(path.read_text())
        data["path"] = str(path)
        return cls(**data)

    def save(self) -> None:
        atomic_write(Path(self.path), json.dumps(asdict(self), indent=1))

    def claim(self, namespace: str, interfaces: list[str] | None = None) -> None:
        """Record a namespace (and the interfaces that will live in it) before creating it."""
        if not namespace.startswith(self.prefix + "-"):
            raise EmulationError(f"namespace {namespace!r} lacks the run prefix {self.prefix!r}")
        if len(namespace) > 200:
            raise EmulationError(f"namespace name too long: {namespace!r}")
        if namespace not in self.namespaces:
            self.namespaces.append(namespace)
        if interfaces:
            self.interfaces.setdefault(namespace, []).extend(interfaces)
        self.save()

    def owns(self, namespace: str) -> bool:
        match = PREFIX_RE.match(self.prefix)
        return bool(
            match
            and int(match.group(1)) == self.pid
            and namespace.startswith(self.prefix + "-")
            and namespace in self.namespaces
        )

    def owner_alive(self) -> bool:
        return process_start_ticks(self.pid) == self.start_ticks


def _stop_processes_in(namespace: str, grace_s: float = 2.0) -> None:
    """End what runs inside one of our namespaces (delayers, spawned workers)."""
    pids = [p for p in sysnet.namespace_pids(namespace) if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if process_running(p)]
            time.sleep(0.05)
        if not pids:
            return


def remove_namespace(record: RunRecord, namespace: str) -> bool:
    """Delete ``namespace`` if ``record`` created it; True if it existed. Raises
    :class:`ForeignResourceError` for any other name, without touching it."""
    if not record.owns(namespace):
        raise ForeignResourceError(
            f"refusing to remove namespace {namespace!r}: not created by run {record.prefix!r} "
            f"(needs the prefix and an entry in {record.path})"
        )
    if namespace not in sysnet.list_namespaces():
        return False
    _stop_processes_in(namespace)
    sysnet.delete_namespace(namespace)
    return True


def release(record: RunRecord) -> list[str]:
    """Remove all of a run's namespaces, then its marker; returns the ones that existed.
    Names that fail the ownership check are logged and left, and so is the marker."""
    removed, refused = [], []
    for ns in list(reversed(record.namespaces)):
        try:
            if remove_namespace(record, ns):
                removed.append(ns)
        except ForeignResourceError as exc:
            log.error("%s", exc)
            refused.append(ns)
    if not refused:
        Path(record.path).unlink(missing_ok=True)
    return removed


@dataclass
class CleanupReport:
    removed: list[str] = field(default_factory=list)  # namespaces deleted
    refused: list[str] = field(default_factory=list)  # listed in a marker but not ownable
    live_runs: list[str] = field(default_factory=list)  # prefixes whose owner still runs
    bad_markers: list[str] = field(default_factory=list)  # unreadable marker files


def cleanup_stale(directory: Path | None = None) -> CleanupReport:
    """Remove the namespaces and markers of runs whose owner process is gone."""
    directory = directory or marker_dir()
    report = CleanupReport()
    for path in sorted(directory.glob("flk-*.json")):
        try:
            record = RunRecord.load(path)
        except (OSError, ValueError, TypeError) as exc:
            log.error("unreadable marker %s: %s", path, exc)
            report.bad_markers.append(str(path))
            continue
        if record.owner_alive():
            report.live_runs.append(record.prefix)
            continue
        before = set(record.namespaces)
        report.removed.extend(release(record))
        report.refused.extend(ns for ns in before if not record.owns(ns))
    return report
