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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from farlink.comm.base import Collective
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
                build_collective: Callable[[RunConfig, str, str], Collective]) -> Tiers | None:
    """The collectives of worker ``index``; None when the run has no network plan (a flat
    run, or islands that a caller of :class:`farlink.Optimizer` formed itself)."""
    plan = NetworkPlan.load(cfg.run_dir)
    if plan is None:
        return None
    replica = f"w{index}"
    if not has_islands(cfg.algorithm):
        flat = build_collective(cfg, replica, lighthouse)
        flat.emulated_link = emulated_link(plan.collective_link(list(range(cfg.workers))))
        return Tiers(flat, None, plan)
    k = plan.island_index(index)
    members = plan.islands[k]
    island = build_collective(island_config(cfg), replica, plan.island_lighthouses[k])
    island.emulated_link = emulated_link(plan.collective_link(members))
    upper = None
    if plan.is_leader(index):
        upper = build_collective(cfg, replica, lighthouse)
        upper.emulated_link = emulated_link(plan.collective_link(plan.leaders()))
    return Tiers(island, upper, plan)
