"""Which TCP ports a process listens on, read from Linux's /proc.

A connection that succeeds says only that *something* listens on a port; a process started to
listen there (the Lighthouse) may have lost the port to another process and exited, so the
question asked of /proc is whose socket it is.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets ``pid`` holds (none if it is gone); an fd closed while they
    are read is skipped."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # IPv6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that one of ``pids`` holds."""
    owner = {inode: pid for pid in pids for inode in socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in owner:  # 0A: TCP_LISTEN
                host, port = local.split(":")
                found.append((owner[inode], _address(host), int(port, 16)))
    return found
