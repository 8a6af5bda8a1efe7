"""Thin wrappers over ``ip``/``tc``/``iptables`` that only ever address a named namespace.

Every command here that changes state takes the namespace as an argument and runs ``ip -n NS``,
``tc -n NS`` or ``ip netns exec NS iptables``: nothing in this module touches the host's own
interfaces, routes or firewall. Failures raise :class:`EmulationError` with the command's stderr.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

from farlink.emulate.errors import EmulationError

log = logging.getLogger(__name__)


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise EmulationError(f"`{name}` not found; install it (apt-get install -y {APT[name]})")
    return path


APT = {"ip": "iproute2", "tc": "iproute2", "iptables": "iptables"}


def run(argv: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    log.debug("run %s", " ".join(argv))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise EmulationError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    out = run([tool("ip"), "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def add_namespace(ns: str) -> None:
    run([tool("ip"), "netns", "add", ns])


def delete_namespace(ns: str) -> None:
    """Delete a namespace by name; only :mod:`farlink.emulate.registry` calls this, after its
    ownership checks."""
    run([tool("ip"), "netns", "del", ns])


def namespace_pids(ns: str) -> list[int]:
    out = run([tool("ip"), "netns", "pids", ns], check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def ip(ns: str, *args: str) -> None:
    run([tool("ip"), "-n", ns, *args])


def tc(ns: str, *args: str) -> None:
    run([tool("tc"), "-n", ns, *args])


def netns_exec(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return run([tool("ip"), "netns", "exec", ns, *argv], check=check)


def iptables(ns: str, *args: str) -> None:
    netns_exec(ns, tool("iptables"), "-w", *args)


def iptables_rules(ns: str) -> list[str]:
    return netns_exec(ns, tool("iptables"), "-w", "-S").stdout.splitlines()


def ip_batch(ns: str, lines: list[str]) -> None:
    """Several ``ip`` commands in one process (``ip -n NS -batch -``): neighbour tables grow
    with the square of the worker count."""
    if not lines:
        return
    argv = [tool("ip"), "-n", ns, "-batch", "-"]
    proc = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=60, check=False)
    if proc.returncode != 0:
        raise EmulationError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
