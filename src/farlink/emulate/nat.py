"""A home router in a namespace: masquerade outbound, admit only replies inbound.

A volunteer at home sits behind a router that rewrites its private source address to the
router's public one (source NAT, ``MASQUERADE``) and remembers each connection (conntrack), so
replies find their way back; a connection that starts outside finds nothing to forward to. That
is what makes community peers undialable, and why hivemind offers client mode and relays.
:class:`farlink.emulate.topology.Topology` builds one such router per ``behind_nat`` worker; this
module owns the router's rules:

- ``nat POSTROUTING -o WAN -j MASQUERADE``: what leaves carries the router's WAN address;
- ``FORWARD``: LAN -> WAN accepted; WAN -> LAN accepted only for ``ESTABLISHED,RELATED``
  connections (replies), every new inbound connection dropped (a packet to the worker's private
  address is dropped even when a peer routes it here);
- ``INPUT`` on the WAN side: new connections to the router itself dropped, as a home router's
  stealth firewall does (a dial to the public address times out rather than being refused).

Everything is set inside the router's own namespace (``ip_forward`` is per namespace), so the
host's firewall and forwarding stay as they are.
"""

from __future__ import annotations

from farlink.emulate import sysnet
from farlink.emulate.errors import EmulationError

WAN_IF = "flkn{}"  # the router's WAN side, on the shared bridge (formatted with the worker index)
LAN_IF = "flkl{}"  # the router's LAN side, toward the worker


def configure_router(ns: str, *, wan_if: str, wan_cidr: str, lan_if: str, lan_cidr: str) -> None:
    """Address both sides of the router in ``ns``, turn forwarding on and install the NAT and
    firewall rules (see the module docstring)."""
    sysnet.ip_batch(ns, [
        "link set lo up",
        f"link set {wan_if} up",
        f"addr add {wan_cidr} dev {wan_if}",
        f"link set {lan_if} up",
        f"addr add {lan_cidr} dev {lan_if}",
    ])
    sysnet.netns_exec(ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
    try:
        sysnet.iptables(ns, "-t", "nat", "-A", "POSTROUTING", "-o", wan_if, "-j", "MASQUERADE")
        sysnet.iptables(ns, "-A", "FORWARD", "-i", wan_if, "-o", lan_if, "-m", "conntrack",
                        "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
    except EmulationError as exc:
        raise EmulationError(f"{exc}. Emulating a NAT needs the kernel's NAT and connection "
                             "tracking (on the host: modprobe iptable_nat nf_conntrack "
                             "xt_MASQUERADE xt_conntrack)") from None
    sysnet.iptables(ns, "-A", "FORWARD", "-i", lan_if, "-o", wan_if, "-j", "ACCEPT")
    sysnet.iptables(ns, "-A", "FORWARD", "-i", wan_if, "-j", "DROP")
    sysnet.iptables(ns, "-A", "INPUT", "-i", wan_if, "-m", "conntrack", "--ctstate",
                    "ESTABLISHED,RELATED", "-j", "ACCEPT")
    sysnet.iptables(ns, "-A", "INPUT", "-i", wan_if, "-j", "DROP")


def dialed(ns: str) -> set[tuple[str, int]]:
    """(address, port) of every TCP connection the router has tracked from its LAN outward:
    whom the worker behind it dialed. Tracked connections outlive their close by minutes
    (TIME_WAIT), so a read at the end of a run still sees the run's connections."""
    table = sysnet.netns_exec(ns, "cat", "/proc/net/nf_conntrack").stdout
    found = set()
    for line in table.splitlines():
        fields = line.split()
        if "tcp" not in fields:
            continue
        first = {}  # the original direction's fields come first on each line
        for field in fields:
            key, _, value = field.partition("=")
            if value and key not in first:
                first[key] = value
        if "dst" in first and "dport" in first:
            found.add((first["dst"], int(first["dport"])))
    return found


def dropped_inbound_packets(ns: str, wan_if: str) -> int:
    """Packets the router dropped on its WAN side: dials from outside that found no way in."""
    rules = sysnet.netns_exec(ns, "iptables", "-w", "-L", "-v", "-x", "-n").stdout
    dropped = 0
    for line in rules.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[2] == "DROP" and fields[5] == wan_if:
            dropped += int(fields[0])
    return dropped
