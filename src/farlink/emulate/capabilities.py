"""What this machine lets us emulate, found by trying it in a throw-away namespace.

Checking privileges alone is not enough (a container may be root without CAP_SYS_ADMIN, a kernel
may lack tbf or the NFQUEUE target), so :func:`detect_capabilities` creates a probe namespace,
puts a tbf qdisc and an NFQUEUE rule in it, binds a queue from inside it, and deletes it. When
something fails, ``reason`` says what and how to fix it; callers then fall back to the in-process
shaper (:mod:`farlink.emulate.shaper`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass

from farlink.emulate import registry, sysnet
from farlink.emulate.errors import EmulationError

CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
APT_PACKAGES = "iproute2 iptables libnetfilter-queue-dev"


@dataclass(frozen=True)
class Capabilities:
    netns: bool  # namespaces + veth + bridge can be created
    tc: bool  # tbf shaping works inside them
    nfqueue: bool  # packets can be delayed (iptables NFQUEUE + the netfilterqueue package)
    reason: str  # empty when everything works; otherwise what is missing and how to fix it

    @property
    def full(self) -> bool:
        return self.netns and self.tc and self.nfqueue


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def nfqueue_problem() -> str | None:
    """Why packet delay cannot work here (without probing the kernel), or None."""
    if shutil.which("iptables") is None and shutil.which("iptables", path="/usr/sbin:/sbin") is None:
        return f"`iptables` is missing (apt-get install -y {APT_PACKAGES})"
    if importlib.util.find_spec("netfilterqueue") is None:
        return ("the netfilterqueue package is missing (apt-get install -y libnetfilter-queue-dev; "
                "pip install 'farlink[emulate]')")
    return None


def detect_capabilities() -> Capabilities:
    """Try each piece of the namespace emulator; never raises."""
    caps = _effective_caps()
    missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not caps >> bit & 1]
    if missing:
        who = "not root" if os.geteuid() != 0 else "root without " + ", ".join(missing)
        return Capabilities(False, False, False,
                            f"{who}: network namespaces need {' and '.join(missing)} "
                            "(run as root, or in a container with --cap-add NET_ADMIN,SYS_ADMIN)")
    for name in ("ip", "tc"):
        try:
            sysnet.tool(name)
        except EmulationError as exc:
            return Capabilities(False, False, False, str(exc))
    try:
        record = registry.RunRecord.new()
    except EmulationError as exc:
        return Capabilities(False, False, False, str(exc))
    ns = f"{record.prefix}-probe"
    netns = tc = nfq = False
    reasons: list[str] = []
    try:
        record.claim(ns, ["flkp0", "flkp1"])
        sysnet.add_namespace(ns)
        sysnet.ip(ns, "link", "add", "flkp0", "type", "veth", "peer", "name", "flkp1")
        sysnet.ip(ns, "link", "add", "flkpbr", "type", "bridge")
        netns = True
        sysnet.tc(ns, "qdisc", "add", "dev", "flkp0", "root", "tbf", "rate", "10mbit",
                  "burst", "65536", "limit", "131072")
        tc = True
    except EmulationError as exc:
        reasons.append(str(exc))
    if netns:
        problem = nfqueue_problem()
        if problem:
            reasons.append(problem)
        else:
            try:
                sysnet.iptables(ns, "-A", "INPUT", "-i", "flkp0", "-j", "NFQUEUE",
                                "--queue-num", "0")
                code = ("from netfilterqueue import NetfilterQueue as Q\n"
                        "q = Q(); q.bind(0, lambda p: p.accept()); q.unbind()")
                sysnet.netns_exec(ns, sys.executable, "-c", code)
                nfq = True
            except EmulationError as exc:
                reasons.append(f"NFQUEUE delay unavailable: {exc}")
    try:
        registry.release(record)
    except EmulationError as exc:
        reasons.append(f"could not remove probe namespace {ns}: {exc}")
    return Capabilities(netns, tc, nfq, "; ".join(reasons))
