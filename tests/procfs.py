"""What a process tree is and what it listens on, read from Linux's /proc (no psutil here)."""

from __future__ import annotations

import os
from pathlib import Path

from farlink.listeners import listening  # noqa: F401 - what tests import from here


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()  # fields after "pid (comm)"


def alive(pid: int) -> bool:
    """Running (a zombie has finished: only its exit status is left)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields is not None else None


def descendants(root: int) -> set[int]:
    """Every live process below ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and alive(child):
                found.add(child)
                todo.append(child)
    return found


def replica_group_ranks(root: int, argument: bytes, replica_group: int | None = None) -> list[int]:
    """PIDs of a replica group's training ranks below ``root``: torchrun's children (LOCAL_RANK in
    their environment, not the replica group agent itself) with ``argument`` among their arguments,
    and of replica group ``replica_group`` when given."""
    ranks = []
    for pid in descendants(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (argument in cmdline and b"farlink.parallel.replica_group_agent" not in cmdline
            and (replica_group is None
                 or f"REPLICA_GROUP_ID={replica_group}".encode() in environ)
            and any(e.startswith(b"LOCAL_RANK=") for e in environ)):
            ranks.append(pid)
    return ranks


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
