"""A wide-area network on one machine: one network namespace per worker, all joined by a router.

Layout (``P`` = the run prefix ``flk-<pid>-<n>``)::

    P-w0 [flkw0 10.77.0.1] ==veth== [flkr0]--+
    P-w1 [flkw1 10.77.0.2] ==veth== [flkr1]--+-- flkbr0 10.77.0.254   (namespace P-r)
    ...                                      +

Every interface is created directly inside one of the run's namespaces (the veth pair is created
in the router namespace with its far end placed in the worker's), so the host namespace is never
modified. Per worker: ``tbf`` on the worker end shapes its upload, ``tbf`` on the router end its
download; one-way delay, jitter and loss are added on arrival by a delayer process
(:mod:`farlink.emulate.delayer`) fed by an NFQUEUE rule on the receiving namespace's INPUT chain.
The router namespace gets its own delayer, so a coordinator there (e.g. the torchft Lighthouse)
sees each worker at half that worker's path delay. Neighbour (ARP) entries are static so the
first packet of a run is not held up by address resolution.

A worker listed in ``behind_nat`` sits behind a home router of its own: a namespace ``P-nI``
takes the worker's place on the bridge (its WAN side holds the worker's public address
``10.77.0.I+1``) and leads to the worker over a second veth on a private LAN
(``10.78.I.0/24``, the worker at ``10.78.I.2``). The router masquerades what leaves through its
WAN side and lets in only replies to connections made from inside, so the worker can dial out
but nobody can dial in (:mod:`farlink.emulate.nat`)::

    P-w2 [flkw2 10.78.2.2] ==veth== [flkl2 10.78.2.1 P-n2 flkn2 10.77.0.3] ==veth== [flkr2]--+

With ``shared`` (a shared bottleneck: one cell, hub or congested uplink that every worker's
traffic crosses), what every worker uploads passes one more token bucket after its own: the
ingress of every router-side port ``flkrI`` is redirected (a ``u32`` match-all filter with
``mirred``) to one ``ifb`` device ``flkshared`` in the router namespace, whose ``tbf`` holds it to
the shared profile's rate, then it is handed back to the bridge. The workers therefore share
that rate instead of each having it; only the shared profile's rate is used (delay and loss stay
per worker)::

    [flkr0] --ingress--+
    [flkr1] --ingress--+--> flkshared (ifb, tbf at the shared rate) --> back to flkbr0
    ...                +
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import time
import weakref
from collections.abc import Collection, Mapping, Sequence

from farlink.emulate import nat, registry, sysnet
from farlink.emulate.delayer import READY
from farlink.emulate.errors import EmulationError
from farlink.links import LinkProfile, get_profile, path_latency_ms, path_loss

log = logging.getLogger(__name__)

SUBNET = "10.77.0"
LAN_SUBNET = "10.78"  # + ".I": the private LAN behind worker I's NAT router
ROUTER_HOST = 254
MAX_WORKERS = 250
BRIDGE = "flkbr0"
SHARED_IFB = "flkshared"  # the shared bottleneck's device in the router namespace
MIN_BURST_BYTES = 96 * 1024  # above one 64 KiB GSO segment, so tbf never has to split one
TCP_BUFFER_MAX = 64 << 20  # socket autotuning headroom for large bandwidth-delay products
# Every delayed packet passes through a Python callback: measured 100-300 Mbit/s per receiving
# namespace depending on machine load. Above this, shaped rates are not what arrives.
DELAYER_CEILING_MBIT = 150.0


def _mac(kind: int, index: int) -> str:
    return f"02:fa:77:{kind:02x}:{index >> 8:02x}:{index & 0xFF:02x}"


def _tbf_args(rate_mbit: float, queue_seconds: float) -> list[str]:
    rate_bps = rate_mbit * 1e6 / 8
    burst = max(MIN_BURST_BYTES, int(rate_bps * 0.001))
    limit = max(2 * burst, int(rate_bps * queue_seconds))
    return ["tbf", "rate", f"{int(rate_mbit * 1000)}kbit", "burst", str(burst),
            "limit", str(limit)]


class Topology:
    """Workers in their own namespaces behind shaped, delayed links; a context manager.

    ``profile`` applies to every worker, ``overrides`` maps worker index -> profile for
    heterogeneous links. ``shared`` adds one bottleneck that every worker's upload crosses
    after its own link (its rate is shared by all; None: no shared bottleneck). ``behind_nat``
    lists workers that each sit behind a NAT router of their own (they dial out; nobody dials
    in). Use :meth:`spawn` to run commands inside a worker's
    namespace and :meth:`address` / :meth:`ifname` to point programs at each other; a NATed
    worker listens on :meth:`address` (private) and others see it at :meth:`wan_address`.
    """

    def __init__(
        self,
        n_workers: int,
        profile: str | LinkProfile = "loopback",
        overrides: Mapping[int, str | LinkProfile] | None = None,
        *,
        seed: int = 0,
        wan_tuned_tcp: bool = True,
        behind_nat: Collection[int] = (),
        shared: str | LinkProfile | None = None,
    ) -> None:
        if not 1 <= n_workers <= MAX_WORKERS:
            raise EmulationError(f"n_workers must be in 1..{MAX_WORKERS}, got {n_workers}")
        overrides = dict(overrides or {})
        bad = [i for i in overrides if not (isinstance(i, int) and 0 <= i < n_workers)]
        if bad:
            raise EmulationError(f"overrides name workers {bad} outside 0..{n_workers - 1}")
        bad = [i for i in behind_nat if not (isinstance(i, int) and 0 <= i < n_workers)]
        if bad:
            raise EmulationError(f"behind_nat names workers {bad} outside 0..{n_workers - 1}")
        self.behind_nat = frozenset(behind_nat)
        self.n_workers = n_workers
        self.profiles: list[LinkProfile] = [
            get_profile(overrides.get(i, profile)) for i in range(n_workers)
        ]
        self.shared: LinkProfile | None = None if shared is None else get_profile(shared)
        self.seed = seed
        self.wan_tuned_tcp = wan_tuned_tcp  # False: Linux defaults (slow start after idle)
        self.record: registry.RunRecord | None = None
        self._delayers: dict[str, subprocess.Popen] = {}
        self._procs: list[subprocess.Popen] = []
        self._closed = False

    # ---- names and addresses -------------------------------------------------------------
    @property
    def prefix(self) -> str:
        self._require_started()
        assert self.record is not None
        return self.record.prefix

    def namespace(self, i: int) -> str:
        self._check_index(i)
        return f"{self.prefix}-w{i}"

    @property
    def router_namespace(self) -> str:
        return f"{self.prefix}-r"

    def nat_namespace(self, i: int) -> str:
        """The NAT router namespace in front of worker ``i`` (only for ``behind_nat`` workers)."""
        if i not in self.behind_nat:
            raise EmulationError(f"worker {i} is not behind a NAT (behind_nat="
                                 f"{sorted(self.behind_nat)})")
        return f"{self.prefix}-n{i}"

    def address(self, i: int) -> str:
        """The address worker ``i`` holds and listens on: its public one, or its private LAN
        address when it is behind a NAT."""
        self._check_index(i)
        return f"{LAN_SUBNET}.{i}.2" if i in self.behind_nat else self.wan_address(i)

    def wan_address(self, i: int) -> str:
        """Where the others see worker ``i``: its own address, or its NAT router's WAN side
        (its traffic leaves with this source address; nothing dialed there reaches it)."""
        self._check_index(i)
        return f"{SUBNET}.{i + 1}"

    def _gateway(self, i: int) -> str:
        return f"{LAN_SUBNET}.{i}.1"

    @property
    def router_address(self) -> str:
        return f"{SUBNET}.{ROUTER_HOST}"

    def ifname(self, i: int) -> str:
        """The worker's interface inside its namespace (``GLOO_SOCKET_IFNAME``)."""
        self._check_index(i)
        return f"flkw{i}"

    def profile(self, i: int) -> LinkProfile:
        self._check_index(i)
        return self.profiles[i]

    def expected_one_way_ms(self, a: int, b: int) -> float:
        return path_latency_ms(self.profile(a), self.profile(b))

    def expected_throughput_mbit(self, a: int, b: int) -> float | None:
        """Rate from ``a`` to ``b`` alone on the network: the lowest of a's upload, b's download
        and the shared bottleneck's rate (None: unshaped)."""
        rates = [r for r in (self.profile(a).up_mbit, self.profile(b).down_mbit,
                             self._shared_mbit) if r]
        return min(rates) if rates else None

    def worker_env(self, i: int) -> dict[str, str]:
        """Environment a distributed program in worker ``i`` needs to use the emulated link."""
        return {
            "GLOO_SOCKET_IFNAME": self.ifname(i),
            "TP_SOCKET_IFNAME": self.ifname(i),
            "FARLINK_EMULATED_HOST": self.address(i),
            "FARLINK_EMULATED_NAMESPACE": self.namespace(i),
        }

    # ---- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Topology:  # noqa: PYI034 - subclasses are not expected
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self.record is not None:
            raise EmulationError("topology already started")
        self.record = registry.RunRecord.new()
        _live[id(self)] = weakref.ref(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop spawned processes and delayers, delete every namespace of this run."""
        if self._closed or self.record is None:
            return
        self._closed = True
        _live.pop(id(self), None)
        for proc in [*self._procs, *self._delayers.values()]:
            _terminate(proc)
        registry.release(self.record)

    def check(self) -> None:
        """Raise if a delayer has died (its namespace would then drop all arriving traffic)."""
        for ns, proc in self._delayers.items():
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr else ""
                raise EmulationError(f"delayer in {ns} exited ({proc.returncode}): {err.strip()}")

    # ---- running programs inside ----------------------------------------------------------
    def spawn(
        self,
        worker_index: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen_kwargs: object,
    ) -> subprocess.Popen:
        """Run ``argv`` inside worker ``worker_index``'s namespace. ``env`` is added to this
        process's environment; the child is stopped when the topology closes."""
        return self._spawn_in(self.namespace(worker_index), argv, env, **popen_kwargs)

    def spawn_router(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen_kwargs: object
    ) -> subprocess.Popen:
        """Run ``argv`` in the router namespace (reachable at :attr:`router_address`)."""
        self._require_started()
        return self._spawn_in(self.router_namespace, argv, env, **popen_kwargs)

    def _spawn_in(self, ns: str, argv: Sequence[str], env: Mapping[str, str] | None,
                  **popen_kwargs: object) -> subprocess.Popen:
        self._require_started()
        if not argv:
            raise EmulationError("spawn needs a command")
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen([sysnet.tool("ip"), "netns", "exec", ns, *map(str, argv)],
                                env=full_env, **popen_kwargs)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    # ---- construction ---------------------------------------------------------------------
    def _build(self) -> None:
        assert self.record is not None
        n = self.n_workers
        router = self.router_namespace
        self.record.claim(router, [BRIDGE] + [f"flkr{i}" for i in range(n)]
                          + ([SHARED_IFB] if self._shared_mbit else []))
        sysnet.add_namespace(router)
        sysnet.ip_batch(router, [
            "link set lo up",
            f"link add {BRIDGE} address {_mac(0xFF, 0)} type bridge",
            f"link set {BRIDGE} up",
            f"addr add {self.router_address}/24 dev {BRIDGE}",
        ])
        for i in range(n):
            ns = self.namespace(i)
            self.record.claim(ns, [self.ifname(i)])
            sysnet.add_namespace(ns)
            # the bridge port's far end: the worker itself, or its NAT router's WAN side
            wan_ns, wan_if = (self.nat_namespace(i), nat.WAN_IF.format(i)) \
                if i in self.behind_nat else (ns, self.ifname(i))
            if i in self.behind_nat:
                self.record.claim(wan_ns, [wan_if, nat.LAN_IF.format(i)])
                sysnet.add_namespace(wan_ns)
            sysnet.ip(router, "link", "add", f"flkr{i}", "address", _mac(1, i), "type", "veth",
                      "peer", "name", wan_if, "address", _mac(0, i), "netns", wan_ns)
            sysnet.ip_batch(router, [f"link set flkr{i} master {BRIDGE}", f"link set flkr{i} up"])
            if i in self.behind_nat:
                lan_if = nat.LAN_IF.format(i)
                sysnet.ip(wan_ns, "link", "add", lan_if, "address", _mac(2, i), "type", "veth",
                          "peer", "name", self.ifname(i), "address", _mac(3, i), "netns", ns)
                nat.configure_router(wan_ns, wan_if=wan_if, wan_cidr=f"{self.wan_address(i)}/24",
                                     lan_if=lan_if, lan_cidr=f"{self._gateway(i)}/24")
            sysnet.ip_batch(ns, [
                "link set lo up",
                f"link set {self.ifname(i)} up",
                f"addr add {self.address(i)}/24 dev {self.ifname(i)}",
                *([f"route add default via {self._gateway(i)}"] if i in self.behind_nat else []),
            ])
            buf = f"4096 131072 {TCP_BUFFER_MAX}"
            # Hosts set up for long-fat links, as a WAN training deployment tunes them: socket
            # buffers that can hold a bandwidth-delay product, and a congestion window kept
            # across the idle gap between outer rounds (by default Linux restarts slow start
            # after one RTO of silence, costing each round ~log2(bytes / 14 KB) extra RTTs).
            sysnet.netns_exec(ns, "sysctl", "-q", "-w", f"net.ipv4.tcp_rmem={buf}",
                              f"net.ipv4.tcp_wmem={buf}",
                              f"net.ipv4.tcp_slow_start_after_idle={0 if self.wan_tuned_tcp else 1}")
        self._static_neighbours()
        self._shape()
        self._start_delayers()

    def _static_neighbours(self) -> None:
        n = self.n_workers
        peers = [(self.wan_address(j), _mac(0, j)) for j in range(n)]
        router_entry = (self.router_address, _mac(0xFF, 0))
        for i in range(n):
            # on the bridge: the worker itself, or its NAT router's WAN side
            wan_ns, dev = (self.nat_namespace(i), nat.WAN_IF.format(i)) \
                if i in self.behind_nat else (self.namespace(i), self.ifname(i))
            sysnet.ip_batch(wan_ns, [
                f"neigh replace {addr} lladdr {mac} dev {dev} nud permanent"
                for j, (addr, mac) in enumerate([*peers, router_entry]) if j != i
            ])
            if i in self.behind_nat:  # the LAN: the worker and its gateway
                sysnet.ip_batch(wan_ns, [f"neigh replace {self.address(i)} lladdr {_mac(3, i)} "
                                         f"dev {nat.LAN_IF.format(i)} nud permanent"])
                sysnet.ip_batch(self.namespace(i), [
                    f"neigh replace {self._gateway(i)} lladdr {_mac(2, i)} dev {self.ifname(i)} "
                    "nud permanent"])
        sysnet.ip_batch(self.router_namespace, [
            f"neigh replace {addr} lladdr {mac} dev {BRIDGE} nud permanent" for addr, mac in peers
        ])

    def _queue_seconds(self, i: int) -> float:
        """Queue room of worker i's shapers: one worst-case round trip (the path's
        bandwidth-delay product, which a single TCP flow needs to keep the link busy)."""
        worst = max(self.expected_one_way_ms(i, j) for j in range(self.n_workers))
        return max(0.01, 2 * worst / 1000)

    def _shape(self) -> None:
        for i, prof in enumerate(self.profiles):
            q = self._queue_seconds(i)
            if prof.up_mbit:
                sysnet.tc(self.namespace(i), "qdisc", "replace", "dev", self.ifname(i), "root",
                          *_tbf_args(prof.up_mbit, q))
            if prof.down_mbit:
                sysnet.tc(self.router_namespace, "qdisc", "replace", "dev", f"flkr{i}", "root",
                          *_tbf_args(prof.down_mbit, q))
        self._shape_shared()

    @property
    def _shared_mbit(self) -> float | None:
        return self.shared.up_mbit if self.shared is not None else None

    def _shape_shared(self) -> None:
        """Every worker's upload, as it arrives at the router, through one shared token bucket."""
        rate = self._shared_mbit
        if not rate:
            return
        router = self.router_namespace
        q = max(self._queue_seconds(i) for i in range(self.n_workers))
        sysnet.ip_batch(router, [f"link add {SHARED_IFB} type ifb", f"link set {SHARED_IFB} up"])
        sysnet.tc(router, "qdisc", "replace", "dev", SHARED_IFB, "root", *_tbf_args(rate, q))
        for i in range(self.n_workers):
            sysnet.tc(router, "qdisc", "add", "dev", f"flkr{i}", "handle", "ffff:", "ingress")
            # u32 matching every packet: the kernels this runs on may lack the matchall filter
            sysnet.tc(router, "filter", "add", "dev", f"flkr{i}", "parent", "ffff:", "protocol",
                      "all", "u32", "match", "u32", "0", "0", "action", "mirred", "egress",
                      "redirect", "dev", SHARED_IFB)

    def _rules_for(self, i: int | None) -> dict[str, list[float]]:
        """Delayer rules for packets arriving at worker ``i`` (None: at the router)."""
        rules: dict[str, list[float]] = {}
        for j, src in enumerate(self.profiles):
            if j == i:
                continue
            if i is None:
                spec = [src.latency_ms / 2000, src.jitter_ms / 2000, path_loss(None, src)]
            else:
                dst = self.profiles[i]
                spec = [path_latency_ms(src, dst) / 1000, (src.jitter_ms + dst.jitter_ms) / 2000,
                        path_loss(src, dst)]
            if any(spec):  # a NATed sender's packets carry its router's WAN address
                rules[self.wan_address(j)] = spec
        if i is not None:
            dst = self.profiles[i]
            spec = [dst.latency_ms / 2000, dst.jitter_ms / 2000, path_loss(None, dst)]
            if any(spec):
                rules[self.router_address] = spec
        return rules

    def _start_delayers(self) -> None:
        plans = [(self.namespace(i), self.ifname(i), self._rules_for(i))
                 for i in range(self.n_workers)]
        plans.append((self.router_namespace, BRIDGE, self._rules_for(None)))
        plans = [p for p in plans if p[2]]
        if not plans:
            return
        fast = [f"w{i} ({p.name})" for i, p in enumerate(self.profiles)
                if (p.down_mbit or float("inf")) > DELAYER_CEILING_MBIT]
        if fast:
            log.warning("delayed links faster than ~%g Mbit/s are capped by the user-space "
                        "delayer: %s; use farlink.links.scaled() for rate-accurate runs",
                        DELAYER_CEILING_MBIT, ", ".join(fast))
        from farlink.emulate.capabilities import nfqueue_problem

        problem = nfqueue_problem()
        if problem:
            raise EmulationError(f"the links need delay/jitter/loss but {problem}")
        for k, (ns, _, rules) in enumerate(plans):
            argv = [sysnet.tool("ip"), "netns", "exec", ns, sys.executable, "-m",
                    "farlink.emulate.delayer", "--queue", "0", "--rules", json.dumps(rules),
                    "--seed", str(self.seed * 1000 + k)]
            self._delayers[ns] = subprocess.Popen(argv, stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        for (ns, dev, _) in plans:
            proc = self._delayers[ns]
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.1, deadline - time.monotonic()))
            line = proc.stdout.readline().strip() if ready else ""
            if line != READY:
                proc.kill()
                err = proc.stderr.read() if proc.stderr else ""
                raise EmulationError(f"delayer in {ns} did not start: {line} {err.strip()}")
            # no --queue-bypass: if the delayer dies, traffic stops instead of silently
            # arriving undelayed (check() reports it)
            sysnet.iptables(ns, "-A", "INPUT", "-i", dev, "-j", "NFQUEUE", "--queue-num", "0")

    # ---- helpers --------------------------------------------------------------------------
    def _require_started(self) -> None:
        if self.record is None:
            raise EmulationError("topology not started; use `with Topology(...) as topo:`")
        if self._closed:
            raise EmulationError("topology already closed")

    def _check_index(self, i: int) -> None:
        if not (isinstance(i, int) and 0 <= i < self.n_workers):
            raise EmulationError(f"worker index {i!r} outside 0..{self.n_workers - 1}")


def _terminate(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


_live: dict[int, weakref.ref] = {}


@atexit.register
def _close_leftovers() -> None:
    """Topologies still open at interpreter exit (a forgotten close, an uncaught exception)."""
    for ref in list(_live.values()):
        topo = ref()
        if topo is not None:
            try:
                topo.close()
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                log.error("closing %s at exit failed: %s", topo.record and topo.record.prefix, exc)

