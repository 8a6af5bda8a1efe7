"""Starting hivemind's DHT safely and turning its startup failures into actionable errors.

hivemind's defaults reach out to the internet (UPnP/NAT-PMP port mapping, AutoNAT probes, circuit
relays, IPFS bootstrap). A local or test run must never do that, so every DHT this project starts
goes through :func:`dht_options`, which switches all of them off unless the user asked for a
public peer explicitly.

It also reads a peer's addresses for the people running it: which address to hand to peers
elsewhere (:func:`best_address`), and whether the swarm's other peers can dial it directly or
only through a relay, and what to open if not (:func:`reachability`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any

from farlink.comm.errors import DaemonFailed, MembershipRefused, PeerUnreachable
from farlink.extras import require

log = logging.getLogger(__name__)

# Everything that would send packets off the machine, off.
LOCAL_ONLY = dict(
    nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False, use_ipfs=False
)
# --public: peers behind NAT may be reached through relays and port mapping (never IPFS bootstrap).
PUBLIC = dict(nat_port_map=True, auto_nat=True, use_relay=True, use_auto_relay=True, use_ipfs=False)


def p2pd_path() -> str:
    cli = require("hivemind.hivemind_cli", "community mode (hivemind)")

    return str(resources.files(cli) / "p2pd")


def check_p2pd(path: str | None = None) -> str:
    """Fail early, with a fix, when the p2pd binary shipped in the hivemind wheel is unusable."""
    path = path or p2pd_path()
    if not os.path.isfile(path):
        raise DaemonFailed(
            f"hivemind's p2p daemon binary is missing at {path}. "
            "Fix: reinstall hivemind (pip install --force-reinstall hivemind==1.1.12)."
        )
    if not os.access(path, os.X_OK):
        raise DaemonFailed(
            f"hivemind's p2p daemon binary at {path} is not executable. "
            f"Fix: chmod +x {path} (or reinstall hivemind)."
        )
    return path


def tcp_maddr(host: str, port: int = 0) -> str:
    kind = "ip6" if ":" in host else "ip4"
    return f"/{kind}/{host}/tcp/{port}"


def validate_initial_peers(initial_peers: Sequence[str]) -> list[str]:
    """Reject malformed multiaddrs before the daemon does (its message names no fix)."""
    from hivemind.utils.multiaddr import Multiaddr

    out = []
    for addr in initial_peers:
        try:
            maddr = Multiaddr(str(addr))
        except Exception as exc:
            raise PeerUnreachable(
                f"initial peer {addr!r} is not a valid multiaddress ({exc}). Fix: pass the full "
                "address printed by `farlink swarm start`, e.g. /ip4/127.0.0.1/tcp/PORT/p2p/PEERID."
            ) from exc
        if "p2p" not in [p.name for p in maddr.protocols()]:
            raise PeerUnreachable(
                f"initial peer {addr!r} has no /p2p/PEERID part, so it cannot be dialed securely. "
                "Fix: copy the full address printed by `farlink swarm start`."
            )
        out.append(str(maddr))
    return out


def dht_options(
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str] | None = None,
    client_mode: bool = False,
    public: bool = False,
    identity_path: str | None = None,
) -> dict[str, Any]:
    """hivemind.DHT's options. Every DHT refuses records under an ``[owner:KEY]`` key or subkey
    that KEY did not sign (hivemind's RSASignatureValidator; a volunteer's shard claim is one):
    a peer without it would store a forgery that makes every checking reader drop all it
    answers. With ``identity_path`` (made here if missing) the DHT signs with that libp2p
    identity, so its ``[owner:...]`` records are tied to its peer id."""
    from hivemind.dht.crypto import RSASignatureValidator

    opts: dict[str, Any] = dict(PUBLIC if public else LOCAL_ONLY)
    opts.update(host_maddrs=list(host_maddrs), client_mode=client_mode)
    if announce_maddrs:
        opts["announce_maddrs"] = list(announce_maddrs)
    key = None
    if identity_path:
        opts["identity_path"] = identity_path
        if not os.path.isfile(identity_path):
            # a new identity is nobody's: skip hivemind's check for a peer already using it
            opts["check_if_identity_free"] = False
        key = identity_key(identity_path)
    opts["record_validators"] = [RSASignatureValidator(key)]
    return opts


def identity_key(identity_path: str):
    """The RSA key of the libp2p identity at ``identity_path`` (a hivemind ``RSAPrivateKey``),
    made as hivemind makes one when the file is missing: the key signs what this peer stores
    under its ``[owner:...]`` marker, and its hash is the peer id."""
    from hivemind.p2p import P2P
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    if not os.path.isfile(identity_path):
        P2P.generate_identity(identity_path)
    with open(identity_path, "rb") as f:
        proto = crypto_pb2.PrivateKey.FromString(f.read())
    if proto.key_type != crypto_pb2.RSA:
        raise DaemonFailed(f"the identity {identity_path} holds no RSA key. Fix: remove it; a "
                           "new one is made at the next start (this peer gets a new peer id)")
    key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind has no loader: restore as unpickling
    key.__setstate__({"_private_key": proto.data})
    return key


def _tied_dht_class():
    """``hivemind.DHT`` whose process (forked from this one) stops, with its p2pd, when this
    process dies: a launcher killed with SIGKILL leaves no bootstrap peer behind."""
    import hivemind

    from farlink.lifeline import tie_forked_child

    parent = os.getpid()

    class TiedDHT(hivemind.DHT):
        def run(self) -> None:
            tie_forked_child(parent)
            super().run()

    return TiedDHT


def start_dht(
    initial_peers: Sequence[str],
    startup_timeout: float = 30.0,
    connect_attempts: int = 3,
    tied: bool = False,
    **opts: Any,
):
    """A running ``hivemind.DHT``, or a :class:`CommError` subclass that says what to fix.

    Reaching the bootstrap peers is retried (``connect_attempts``): on a loaded machine or link a
    live peer can miss the daemon's short dial window, and a joiner should not give up on that.
    ``tied``: the DHT process ends with this one (call from the main thread: the kernel ties a
    child to the thread that forked it).
    """
    hivemind = require("hivemind", "community mode (hivemind)")
    from hivemind.p2p import P2PDaemonError

    check_p2pd()
    peers = validate_initial_peers(initial_peers)
    try:
        for attempt in range(1, connect_attempts + 1):
            try:
                dht_class = _tied_dht_class() if tied else hivemind.DHT
                return dht_class(
                    initial_peers=peers or None, start=True, startup_timeout=startup_timeout, **opts
                )
            except (P2PDaemonError, RuntimeError) as exc:
                if isinstance(exc, P2PDaemonError):
                    error = translate_daemon_error(str(exc), peers, opts.get("host_maddrs"))
                elif opts.get("authorizer") is not None and "bootstrap failed" in str(exc):
                    error = MembershipRefused(
                        f"none of the initial peers {list(peers)} accepted this peer into the "
                        "run's DHT: they are unreachable, or they refused its signed requests "
                        "(wrong run secret / key not in --allowed-keys). Fix: check the "
                        "addresses, and that this peer uses the run's --auth with its secret "
                        "(--secret or FARLINK_SECRET) or a --key-file listed in --allowed-keys."
                    )
                elif "bootstrap failed" in str(exc):
                    error = PeerUnreachable(
                        f"none of the initial peers {list(peers)} answered this peer's DHT "
                        "requests. Fix: check that they run and are reachable; if the run uses "
                        "--auth, start this peer with the same --auth and its secret or key."
                    )
                else:
                    raise
                if not isinstance(error, PeerUnreachable) or attempt == connect_attempts:
                    raise error from exc
                log.warning("initial peers unreachable (attempt %d), retrying", attempt)
                time.sleep(1.0 * attempt)
    except TimeoutError as exc:
        raise DaemonFailed(
            f"hivemind's DHT did not become ready within {startup_timeout:.0f} s. Fix: check that "
            "the machine is not overloaded and that initial peers are alive; raise the timeout."
        ) from exc


def translate_daemon_error(text: str, peers: Sequence[str], host_maddrs) -> Exception:
    if "address already in use" in text:
        return DaemonFailed(
            f"the p2p daemon could not listen on {list(host_maddrs or [])}: port already in use. "
            "Fix: pick another --port, or --port 0 for a free one. (daemon said: "
            f"{text.strip()})"
        )
    if "failed to connect to bootstrap peers" in text:
        return PeerUnreachable(
            f"none of the initial peers {list(peers)} answered. Fix: check that `farlink swarm "
            "start` is running there, that the address (port and peer id) is the one it printed, "
            "and that no firewall blocks the port."
        )
    if "failed to parse multiaddr" in text:
        return PeerUnreachable(
            f"a multiaddress was rejected by the p2p daemon ({text.strip()}). Fix: use the form "
            "/ip4/HOST/tcp/PORT/p2p/PEERID."
        )
    return DaemonFailed(
        f"hivemind's p2p daemon failed to start: {text.strip()}. Fix: check host/port settings "
        "and that the p2pd binary runs on this machine."
    )


def start_bootstrap_peer(host: str = "127.0.0.1", port: int = 0, public: bool = False,
                         authorizer: Any = None):
    """A DHT peer others can join, and the full multiaddresses to give them.

    In a run with ``--auth`` pass the run's :class:`~farlink.comm.hivemind_admission.RunAuthorizer`:
    members sign their DHT requests and accept only signed answers, so an unauthorized bootstrap
    peer would be useless to them (and would serve non-members).
    """
    opts = dht_options([tcp_maddr(host, port)], public=public)
    if authorizer is not None:
        opts["authorizer"] = authorizer
    import threading

    dht = start_dht([], tied=threading.current_thread() is threading.main_thread(), **opts)
    return dht, [str(m) for m in dht.get_visible_maddrs()]


# --- where a peer can be reached from --------------------------------------------------------
def _maddr_host(maddr: str) -> str | None:
    """The IP of ``/ip4/A/...`` or ``/ip6/A/...``; None for DNS names and relayed addresses."""
    parts = maddr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "/p2p-circuit" not in maddr:
        return parts[2]
    return None


def _scope(maddr: str) -> int:
    """0 loopback, 1 private or link-local (a LAN), 2 global, 1 for names and relays."""
    import ipaddress

    host = _maddr_host(maddr)
    if host is None:
        return 1
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return 1
    if ip.is_loopback or ip.is_unspecified:
        return 0
    return 2 if ip.is_global else 1


def nat_in_between(seen_from: str | None, own_maddrs: Sequence[str]) -> str | None:
    """The address a peer was seen at when it is none of its own (a NAT rewrote its source on
    the way: peers cannot dial it at any address it announces); None when it is one of them,
    or when that cannot be told (no observation, a relayed connection)."""
    seen = _maddr_host(seen_from or "")
    own = {_maddr_host(m) for m in own_maddrs} - {None}
    if seen is None or not own or seen in own:
        return None
    return seen


def is_loopback_only(maddrs: Sequence[str]) -> bool:
    """Whether every address is a loopback one (only this machine can dial it)."""
    return bool(maddrs) and all(_scope(m) == 0 for m in maddrs)


def best_address(maddrs: Sequence[str]) -> str:
    """The address to hand to peers elsewhere: global before LAN before loopback, and a direct
    address before a relayed one."""
    if not maddrs:
        raise ValueError("no addresses to choose from")
    return max(maddrs, key=lambda m: (_scope(m), "/p2p-circuit" not in m))


def tcp_port(maddrs: Sequence[str]) -> int | None:
    """The TCP port this peer listens on (its first direct address's)."""
    for maddr in maddrs:
        parts = maddr.split("/")
        if "/p2p-circuit" not in maddr and "tcp" in parts:
            try:
                return int(parts[parts.index("tcp") + 1])
            except (IndexError, ValueError):
                continue
    return None


def reachability(maddrs: Sequence[str], client_mode: bool, bootstrap: Sequence[str] = ()
                 ) -> str | None:
    """One line for a volunteer's console when the swarm's other peers cannot dial it
    directly, with what to open; None when they can.

    The swarm's reach is the bootstrap peer's (``bootstrap``: loopback, a LAN or the internet);
    a volunteer is reachable when it has a direct address of at least that scope. With
    ``--public`` hivemind adds the address the router maps (UPnP/NAT-PMP) or that peers observe
    (AutoNAT), and a relayed ``/p2p-circuit`` address when it finds none."""
    port = tcp_port(maddrs)
    open_port = (f"open TCP port {port} to this machine (forward it on the router; "
                 f"--port {port} keeps it across restarts)" if port else
                 "open a TCP port to this machine and pass it as --port")
    if client_mode:
        return ("client mode: this volunteer only dials out. It trains and averages through "
                "peers that accept connections, but reduces no share of the all-reduce and "
                "serves no state to newcomers. To take a full part, start it with --host "
                f"0.0.0.0, {open_port}, and drop --client-mode")
    reach = max((_scope(m) for m in bootstrap), default=0)
    direct = [m for m in maddrs if "/p2p-circuit" not in m]
    if any(_scope(m) >= reach for m in direct):
        return None
    if len(direct) < len(maddrs):
        return ("reachable only through a relay: no address of this volunteer can be dialed "
                "directly (NAT or firewall), so every byte to it passes a relay peer, slower "
                f"and dependent on that peer. To be reached directly, {open_port}")
    if is_loopback_only(direct):
        return ("listening on loopback only: peers on other machines cannot connect to this "
                f"volunteer. Fix: start it with --host 0.0.0.0 and {open_port}, or with "
                "--client-mode if it cannot accept connections")
    return (f"only a private address ({', '.join(sorted({_maddr_host(m) or m for m in direct}))})"
            ": peers on the internet cannot connect to this volunteer (NAT). Fix: "
            f"{open_port}; or --public to be reached through port mapping or a relay; or "
            "--client-mode")
