"""A worker's collectives under the run's network plan (``RUN_DIR/network.json``).

Why: one place decides which Lighthouse and which emulated link each level of communication uses,
so the worker loop stays the same for flat and hierarchical runs:

* flat algorithm with a ``--topology``: one collective on the main Lighthouse, paced by the
  slowest link among all workers (the inter-island one when the topology has several groups);
* ``hierarchical_diloco``: an island collective on the island's own Lighthouse, paced by the
  intra-island link, and for the island's leader (its lowest worker index) a global collective
  on the main Lighthouse among leaders, paced by the inter-island link. The island collective's
  timeout covers a global round, since members wait inside an island round for their leader's
  hand-off. Each level keeps its own :class:`~farlink.comm.base.CommStats` (a global round may
  run in a background thread); :meth:`Tiers.bytes_sent` is the worker's total.

A worker that is a replica group of K ranks (:mod:`farlink.parallel.sharding`) is one torchft
replica group on each level: rank r's island Manager pairs it with rank r of its island's other
replica groups, its global Manager (leader replica groups) with rank r of the other leaders, so
each rank moves only its own shard on both levels. The two levels' Managers of one rank get
separate replica-group stores (:meth:`~farlink.parallel.sharding.ReplicaGroup.with_own_store`): a
Manager publishes its server's address under fixed keys of its store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from farlink.comm.base import Collective, LinkModel
from farlink.config import RunConfig
from farlink.train.network import NetworkPlan, emulated_link, has_islands


@dataclass
class Tiers:
    collective: Collective  # the worker's own level: flat, or its island
    upper: Collective | None  # the global level (island leaders only)
    plan: NetworkPlan | None = None  # the launcher's; None for islands an API caller formed

    def bytes_sent(self) -> int:
        """Everything this worker sent, on both levels."""
        upper = self.upper.stats.bytes_sent if self.upper is not None else 0
        return self.collective.stats.bytes_sent + upper

    def close(self) -> None:
        if self.upper is not None:
            self.upper.close()


def island_config(cfg: RunConfig) -> RunConfig:
    """The island collective's settings: its timeout covers a global round, since members
    wait inside an island round for their leader's hand-off."""
    return cfg.model_copy(update={"round_timeout": cfg.round_timeout + cfg.quorum_timeout})


def build_tiers(cfg: RunConfig, index: int, lighthouse: str,
                build_collective: Callable[..., Collective], replica_group=None,  # noqa: ANN001
                host: str = "127.0.0.1") -> Tiers | None:
    """The collectives of worker ``index``; None when the run has no network plan (a flat run, or
    islands that a caller of :class:`farlink.Optimizer` formed itself). ``replica_group``: the
    worker's started :class:`~farlink.parallel.sharding.ReplicaGroup` when it has several ranks
    (every rank calls this at the same point: the island level's store is a collective of the
    replica group); ``host``: where rank 0 hosts that store."""
    plan = NetworkPlan.load(cfg.run_dir)
    if plan is None:
        return None
    replica = f"w{index}"
    if not has_islands(cfg.algorithm):
        flat = build_collective(cfg, replica, lighthouse, replica_group=replica_group,
                                link=emulated_link(plan.collective_link(list(range(cfg.workers)))))
        return Tiers(flat, None, plan)
    k = plan.island_index(index)
    members = plan.islands[k]
    island, upper = two_levels(cfg, replica, plan.island_lighthouses[k],
                               lighthouse if plan.is_leader(index) else None,
                               build_collective, replica_group, host,
                               emulated_link(plan.collective_link(members)),
                               emulated_link(plan.collective_link(plan.leaders())))
    return Tiers(island, upper, plan)


def two_levels(cfg: RunConfig, replica: str, island_lighthouse: str,
               global_lighthouse: str | None, build_collective: Callable[..., Collective],
               replica_group=None, host: str = "127.0.0.1",  # noqa: ANN001 - a ReplicaGroup
               island_link: LinkModel | None = None, upper_link: LinkModel | None = None,
               ) -> tuple[Collective, Collective | None]:
    """The island collective and, for a leader (``global_lighthouse`` given), the global one. On a
    replica group of several ranks the island level gets a store of its own and the global level
    keeps the replica group's. ``island_link``/``upper_link``: each level's emulated link, if
    any."""
    island_replica_group = replica_group.with_own_store(host) if replica_group is not None else None
    island = build_collective(island_config(cfg), replica, island_lighthouse,
                              replica_group=island_replica_group, link=island_link)
    upper = None
    if global_lighthouse is not None:
        try:
            upper = build_collective(cfg, replica, global_lighthouse, replica_group=replica_group,
                                     link=upper_link)
        except BaseException:
            island.close()
            raise
    return island, upper
