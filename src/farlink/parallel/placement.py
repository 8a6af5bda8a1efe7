"""Which peers serve which stage of which pipeline, chosen from a measured link matrix (DTFM).

Given the links between ``n = S x P`` peers as probed (:class:`~farlink.comm.linkprobe.
LinkMatrix`: Mbit/s and round-trip milliseconds per ordered pair), a placement puts peer
``grid[p][s]`` at stage ``s`` of pipeline ``p``. Consecutive stages of one pipeline exchange a
micro-batch's activations forward and their gradients backward; the peers of one stage average
their parameters now and then. A step of M micro-batches through S stages on a 1F1B schedule
takes, per pipeline (pipelines run side by side and a step waits for the slowest)::

    fill  = sum over stages of compute + 2 x sum over boundaries of transfer
    step  = fill + (M - 1) x bottleneck,   bottleneck = max(stage compute, boundary transfer)

with ``transfer(i -> j) = rtt/2 + bytes / bandwidth``, both directions of a boundary counted at
its slower one (the gradient goes back over j -> i). Averaging the stage of ``bytes_per_stage``
over the ring of its P peers adds ``2 (P-1)/P x bytes / slowest ring link + (P-1) x rtt``
divided by ``average_every`` steps. The slowest link on the critical path dominates, so the
search minimises this predicted step time: every assignment for up to 8 peers, else pairwise
swaps from random starts until no swap helps (DTFM searches with a genetic algorithm over
graph partitions; the cost model is the point, the search is small here).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from farlink.comm.linkprobe import LinkMatrix

EXHAUSTIVE_PEERS = 8


@dataclass(frozen=True)
class PipelineCost:
    """What one micro-batch costs where: bytes across a stage boundary (forward; its gradient
    goes back with the same size), seconds of compute per stage, bytes to average a stage."""

    activation_bytes: float
    stage_compute_s: float = 0.0
    micro_batches: int = 4
    stage_bytes: float = 0.0
    average_every: int = 0  # steps between averages within a stage; 0: never


@dataclass(frozen=True)
class Placement:
    grid: tuple[tuple[int, ...], ...]  # grid[p][s]: the peer at stage s of pipeline p
    step_s: float
    slowest_link_s: float  # the slowest boundary transfer of any pipeline
    total_s: float = 0.0  # sum of the pipelines' own step times: breaks ties in the search

    @property
    def rank(self) -> tuple[float, float]:
        """Search order: the step time, then how much the other pipelines could still gain
        (without it, fixing one of two slow pipelines looks like no progress)."""
        return (self.step_s, self.total_s)

    def stages(self) -> list[list[int]]:
        """Peers per stage (what :class:`~farlink.parallel.pipeline.PipelineTrainer` takes)."""
        return [[row[s] for row in self.grid] for s in range(len(self.grid[0]))]

    def to_json(self) -> dict:
        return {"pipelines": [list(r) for r in self.grid], "stages": self.stages(),
                "predicted_step_s": self.step_s, "slowest_link_s": self.slowest_link_s}


def transfer_s(links: LinkMatrix, i: int, j: int, nbytes: float) -> float:
    """One message of ``nbytes`` from peer i to peer j: half the round trip plus bytes / rate."""
    mbit, rtt = links.bandwidth_mbit[i][j], links.rtt_ms[i][j]
    if mbit is None or rtt is None:
        return math.inf  # not measured (unreachable): never place a boundary there
    return rtt / 2000 + nbytes * 8 / (mbit * 1e6)


def boundary_s(links: LinkMatrix, i: int, j: int, nbytes: float) -> float:
    return max(transfer_s(links, i, j, nbytes), transfer_s(links, j, i, nbytes))


def step_seconds(links: LinkMatrix, grid, cost: PipelineCost) -> tuple[float, float, float]:
    """(predicted step seconds, slowest boundary seconds, sum of the pipelines' step seconds)
    of ``grid`` under ``cost``."""
    step, slowest, total = 0.0, 0.0, 0.0
    n_stages = len(grid[0])
    for row in grid:
        hops = [boundary_s(links, row[s], row[s + 1], cost.activation_bytes)
                for s in range(n_stages - 1)]
        fill = n_stages * cost.stage_compute_s + 2 * sum(hops)
        bottleneck = max([cost.stage_compute_s, *hops])
        own = fill + (cost.micro_batches - 1) * bottleneck
        step, total = max(step, own), total + own
        slowest = max(slowest, *hops)
    if cost.average_every and cost.stage_bytes and len(grid) > 1:
        p = len(grid)
        for s in range(n_stages):
            ring = [grid[k][s] for k in range(p)]
            edges = [(ring[k], ring[(k + 1) % p]) for k in range(p)]
            rate = min(links.bandwidth_mbit[a][b] or 0.0 for a, b in edges) * 1e6 / 8
            rtt = max(links.rtt_ms[a][b] or math.inf for a, b in edges) / 1000
            ring_s = (2 * (p - 1) / p * cost.stage_bytes / rate if rate else math.inf)
            step += (ring_s + (p - 1) * rtt) / cost.average_every
    return step, slowest, total


def _grid(order: list[int], n_stages: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(order[k:k + n_stages]) for k in range(0, len(order), n_stages))


def _check(links: LinkMatrix, n_stages: int) -> int:
    n = len(links.bandwidth_mbit)
    if n_stages < 2 or n % n_stages:
        raise ValueError(f"{n} peers do not form pipelines of {n_stages} stages: the number of "
                         "peers must be a multiple of the stage count (>= 2)")
    return n


def evaluate(links: LinkMatrix, order: list[int], n_stages: int,
             cost: PipelineCost) -> Placement:
    grid = _grid(list(order), n_stages)
    step, slowest, total = step_seconds(links, grid, cost)
    return Placement(grid, step, slowest, total)


def place(links: LinkMatrix, n_stages: int, cost: PipelineCost, seed: int = 0,
          restarts: int = 8) -> Placement:
    """The placement with the least predicted step time that the search finds."""
    n = _check(links, n_stages)
    if n <= EXHAUSTIVE_PEERS:
        return min((evaluate(links, list(o), n_stages, cost)
                    for o in itertools.permutations(range(n))), key=lambda p: p.rank)
    rng = random.Random(seed)
    best: Placement | None = None
    for _ in range(restarts):
        order = list(range(n))
        rng.shuffle(order)
        current = evaluate(links, order, n_stages, cost)
        improved = True
        while improved:
            improved = False
            for a, b in itertools.combinations(range(n), 2):
                order[a], order[b] = order[b], order[a]
                candidate = evaluate(links, order, n_stages, cost)
                if candidate.rank < current.rank:
                    current, improved = candidate, True
                else:
                    order[a], order[b] = order[b], order[a]
        if best is None or current.rank < best.rank:
            best = current
    return best


def random_placements(links: LinkMatrix, n_stages: int, cost: PipelineCost, samples: int = 200,
                      seed: int = 0) -> list[Placement]:
    """Placements drawn uniformly at random: the baseline a measured placement must beat."""
    n = _check(links, n_stages)
    rng = random.Random(seed)
    out = []
    for _ in range(samples):
        order = list(range(n))
        rng.shuffle(order)
        out.append(evaluate(links, order, n_stages, cost))
    return out


def site_pattern(grid, site_of: dict[int, int] | None = None) -> tuple[tuple[int, ...], ...]:
    """Which site serves each stage of each pipeline, pipelines sorted: two placements with the
    same pattern put the same links on every boundary of a grouped matrix, so they differ only
    by which peer of a site does what (without ``site_of`` every peer is its own site)."""
    site_of = site_of or {}
    return tuple(sorted(tuple(site_of.get(i, i) for i in row) for row in grid))


def distinct_random_placements(links: LinkMatrix, n_stages: int, cost: PipelineCost,
                               exclude: Placement, samples: int = 3, seed: int = 0,
                               site_of: dict[int, int] | None = None,
                               draws: int = 10_000) -> list[Placement]:
    """Up to ``samples`` random placements whose site patterns differ from ``exclude``'s and
    from each other: a baseline that is really another placement, not the chosen one relabelled
    (fewer when fewer distinct patterns exist)."""
    seen = {site_pattern(exclude.grid, site_of)}
    out = []
    for candidate in random_placements(links, n_stages, cost, draws, seed):
        pattern = site_pattern(candidate.grid, site_of)
        if pattern not in seen:
            seen.add(pattern)
            out.append(candidate)
            if len(out) == samples:
                break
    return out


def grouped_links(groups: list[list[int]], intra: tuple[float, float],
                  inter: tuple[float, float]) -> LinkMatrix:
    """A link matrix of sites: (Mbit/s, RTT ms) inside a group and between groups."""
    n = sum(len(g) for g in groups)
    site = {i: k for k, g in enumerate(groups) for i in g}
    links = LinkMatrix.empty(n)
    for i in range(n):
        for j in range(n):
            if i != j:
                mbit, rtt = intra if site[i] == site[j] else inter
                links.bandwidth_mbit[i][j], links.rtt_ms[i][j] = mbit, rtt
    return links
