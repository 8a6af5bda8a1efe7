"""The run's network: the emulated topology, the measured links, and the islands formed from them.

Why: islands should follow what the links deliver, and every worker must agree on them. So the
launcher decides once, before any worker starts: it probes every pair of worker slots with real
TCP (:mod:`farlink.comm.linkprobe`) through the emulated per-pair links of ``--topology``
(:mod:`farlink.emulate.pairwise`; plain loopback when no topology is given), clusters the
measured matrix (:func:`farlink.comm.islands.form_islands`), and writes the outcome to
``RUN_DIR/network.json`` (and the run's summary). Each worker reads the same file: its island, its
island's Lighthouse, whether it leads the island, and the emulated link each of its collectives
crosses. ``--islands`` skips the measurement and forces the grouping.

Links at least as good as 1 Gbit/s with a 1 ms round trip count as alike (the clustering floor),
so CPU noise between loopback probes on a busy machine cannot split an island.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from farlink.comm.base import LinkModel
from farlink.comm.islands import Islands, form_islands, format_islands, parse_islands
from farlink.config import RunConfig
from farlink.links import LinkProfile, get_profile

NETWORK_FILE = "network.json"
PROBE_PINGS = 4
PROBE_BULK_BYTES = 4 << 20


def has_islands(algorithm: str) -> bool:
    """Whether ``algorithm`` runs on two tiers of collectives (islands, then leaders)."""
    from farlink.sync import capabilities

    return capabilities(algorithm).islands


def needs_network(cfg: RunConfig) -> bool:
    return bool(cfg.topology) or has_islands(cfg.algorithm)


@dataclass
class NetworkPlan:
    workers: int
    islands: Islands
    source: str  # "measured", "forced" (--islands) or "topology" (flat algorithm: not used)
    topology: Islands | None = None  # the emulated groups (None: plain loopback)
    intra_link: str = "datacenter"
    inter_link: str = "intercontinental"
    links: dict | None = None  # the measured matrix (bandwidth_mbit, rtt_ms)
    formation: str | None = None  # why these islands
    measure_seconds: float | None = None
    island_lighthouses: list[str] = field(default_factory=list)

    # --- who is where ----------------------------------------------------------------------------
    def island_index(self, worker: int) -> int:
        for k, group in enumerate(self.islands):
            if worker in group:
                return k
        raise ValueError(f"worker {worker} is in no island of {format_islands(self.islands)}")

    def leaders(self) -> list[int]:
        return [group[0] for group in self.islands]

    def is_leader(self, worker: int) -> bool:
        return worker in self.leaders()

    # --- emulated links ----------------------------------------------------------------------
    def collective_link(self, members: list[int]) -> LinkProfile | None:
        """The emulated link a collective among ``members`` is paced by: the inter-group link
        as soon as two members sit in different topology groups (a ring is as slow as its slowest
        hop), else the intra-group one; None without a topology or for a single member."""
        if self.topology is None or len(members) < 2:
            return None
        groups = {next(k for k, g in enumerate(self.topology) if m in g) for m in members}
        return get_profile(self.inter_link if len(groups) > 1 else self.intra_link)

    def crosses(self, a: int, b: int) -> bool:
        """Whether the link a -> b joins two different islands."""
        return self.island_index(a) != self.island_index(b)

    # --- files ------------------------------------------------------------------------------------
    def save(self, run_dir: Path) -> Path:
        path = run_dir / NETWORK_FILE
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, run_dir: Path) -> NetworkPlan | None:
        path = run_dir / NETWORK_FILE
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "island_lighthouses"}
        out["islands_text"] = format_islands(self.islands)
        return out


def plan_network(cfg: RunConfig, reference_bytes: int) -> NetworkPlan | None:
    """Islands for this run (measured unless forced); None when the run needs no network plan."""
    if not needs_network(cfg):
        return None
    topology = parse_islands(cfg.topology, cfg.workers, "topology") if cfg.topology else None
    plan = NetworkPlan(cfg.workers, [], "topology", topology, cfg.intra_link, cfg.inter_link)
    if cfg.islands:
        plan.islands, plan.source = parse_islands(cfg.islands, cfg.workers), "forced"
    elif has_islands(cfg.algorithm):
        start = time.perf_counter()
        matrix = measure(cfg.workers, topology, cfg.intra_link, cfg.inter_link)
        formed = form_islands(matrix.bandwidth_mbit, matrix.rtt_ms, reference_bytes,
                              floor_ms=1.0 + reference_bytes * 8 / 1e9 * 1000)
        plan.islands, plan.source = formed.islands, "measured"
        plan.links, plan.formation = matrix.to_json(), formed.explain()
        plan.measure_seconds = round(time.perf_counter() - start, 2)
    else:
        plan.islands = topology or [list(range(cfg.workers))]
    return plan


def measure(workers: int, topology: Islands | None, intra: str, inter: str):
    """Probe every pair of worker slots through the emulated per-pair links (a LinkMatrix)."""
    from farlink.comm.linkprobe import measure_links
    from farlink.emulate.pairwise import GroupLinks, PairwiseNetwork

    groups = topology or [list(range(workers))]
    links = GroupLinks.of(groups, intra, inter) if topology else GroupLinks.of(
        groups, "loopback", "loopback")
    with PairwiseNetwork(links) as net:
        return measure_links(workers, net.route, PROBE_PINGS, PROBE_BULK_BYTES)


def emulated_link(profile: LinkProfile | None) -> LinkModel | None:
    """A profile as :attr:`Collective.emulated_link` wants it (its uplink rate and delay)."""
    return None if profile is None else LinkModel.of_profile(profile)


def crossing_bytes(plan: NetworkPlan, algorithm: str, per_worker: dict[str, dict]) -> int:
    """Bytes that crossed between islands, over the run.

    Hierarchical: what the leaders sent on the global collective (every one of its links joins
    two islands). Flat: a ring all-reduce in rank order (worker index order) sends each worker's
    bytes to its successor, so the bytes of workers whose successor sits in another island.
    """
    if has_islands(algorithm):
        return sum(int(w.get("inter_bytes", 0)) for w in per_worker.values())
    n = plan.workers
    return sum(int(per_worker.get(f"w{i}", {}).get("bytes_sent", 0)) for i in range(n)
               if plan.crosses(i, (i + 1) % n))


def prepare_network(cfg: RunConfig, vocab_size: int, namespaced: bool = False):
    """Launcher side: plan the network, start one Lighthouse per island (hierarchical runs) and
    write ``network.json``. Returns (plan or None, the island Lighthouses to stop at the end)."""
    from farlink.robust.auth import run_authenticator
    from farlink.model.build import count_parameters
    from farlink.train.lighthouse import Lighthouse

    if not needs_network(cfg):
        return None, []
    if namespaced:
        from farlink import matrix

        matrix.check(cfg, ["namespaces"])  # in-process link emulation only (launch checked it)
    previous = NetworkPlan.load(cfg.run_dir) if cfg.resume else None
    if previous is not None:  # a resumed run keeps its islands (checkpoints were made in them)
        plan = previous
    else:
        params = count_parameters(cfg.model, vocab_size, cfg.seq_len)
        plan = plan_network(cfg, reference_bytes=4 * params)
        assert plan is not None
    lighthouses: list[Lighthouse] = []
    if has_islands(cfg.algorithm):
        try:
            for k in range(len(plan.islands)):
                lighthouses.append(Lighthouse(
                    cfg.host, min_replicas=1, join_timeout=cfg.join_timeout,
                    heartbeat_timeout=cfg.heartbeat_timeout,
                    log_path=cfg.run_dir / f"lighthouse-island{k}.log",
                    # with --auth, only members reach an island's quorum, as on the main one
                    authenticator=run_authenticator(cfg, f"island{k}-gate", verifier=True),
                ).start())
        except BaseException:
            for lighthouse in lighthouses:
                lighthouse.stop()
            raise
        plan.island_lighthouses = [lh.address for lh in lighthouses]
    plan.save(cfg.run_dir)
    return plan, lighthouses


def network_summary(plan: NetworkPlan, cfg: RunConfig, per_worker: dict[str, dict]) -> dict:
    """The run summary's network part: islands, how they were formed, bytes across islands."""
    total = sum(int(w.get("bytes_sent", 0)) for w in per_worker.values())
    inter = crossing_bytes(plan, cfg.algorithm, per_worker)
    return {"network": plan.summary(), "inter_island_bytes": inter,
            "intra_island_bytes": total - inter}
