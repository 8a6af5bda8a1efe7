"""Islands: groups of peers joined by fast links, formed from measured bandwidth and latency.

Why: in hierarchical training only one worker per island crosses the slow link, so the grouping
decides what the slow link has to carry. It should follow the network as measured, not a guess in
a config file (a config may still force it, see :func:`parse_islands`).

The rule (:func:`form_islands`), deterministic and explainable in one line of a summary:

1. the cost of a directed link i -> j is the time to move one reference payload over it,
   ``RTT_ij + reference_bytes / bandwidth_ij`` in ms (the payload defaults to 1 MiB; the launcher
   passes the model's fp32 size, i.e. one update);
2. a pair's cost is the worse of its two directions (a collective needs both), and never below
   ``floor_ms``: faster links than that are all alike for training purposes, so scheduler noise
   on loopback or in one datacenter cannot split a group;
3. sort the pairs' costs and find the largest ratio between neighbours. If it is below
   ``min_gap``, every link is alike and all peers form one island. Otherwise the links at or
   below the gap are *fast*;
4. islands are the connected components of the fast links (single linkage), each listed in index
   order and ordered by their smallest member; the smallest member is the island's leader.

A missing measurement (``None`` or NaN) is never a fast link and takes no part in finding the gap,
so a peer nobody could measure forms an island of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

Matrix = Sequence[Sequence[float | None]]
Islands = list[list[int]]


@dataclass(frozen=True)
class IslandFormation:
    """The islands and why: the costs they were cut from."""

    islands: Islands
    pair_cost_ms: list[list[float]]  # symmetric, floored; diagonal 0
    fast_max_ms: float | None  # slowest link counted as fast (None: one island, no gap)
    slow_min_ms: float | None  # fastest link counted as slow
    gap: float  # slow_min / fast_max (1.0 when no cut was made)

    def explain(self) -> str:
        if self.fast_max_ms is None:
            return (f"{len(self.islands)} island(s): the measured link costs differ by at most "
                    f"{self.gap:.2g}x, below the gap that separates islands")
        return (f"{len(self.islands)} islands: links costing <= {self.fast_max_ms:.3g} ms are "
                f"fast, >= {self.slow_min_ms:.3g} ms slow ({self.gap:.3g}x gap)")


def link_cost_ms(bandwidth_mbit: float | None, rtt_ms: float | None,
                 reference_bytes: int) -> float:
    """Milliseconds to move ``reference_bytes`` over one direction of a link after a round trip."""
    if bandwidth_mbit is None or rtt_ms is None:
        return math.inf
    if math.isnan(bandwidth_mbit) or math.isnan(rtt_ms) or bandwidth_mbit <= 0:
        return math.inf
    return max(rtt_ms, 0.0) + reference_bytes * 8 / (bandwidth_mbit * 1e6) * 1000


def _check_square(name: str, matrix: Matrix) -> int:
    n = len(matrix)
    if any(len(row) != n for row in matrix):
        raise ValueError(f"{name} must be a square matrix ({n} rows)")
    return n


def form_islands(bandwidth_mbit: Matrix, rtt_ms: Matrix, reference_bytes: int = 1 << 20,
                 floor_ms: float = 5.0, min_gap: float = 4.0) -> IslandFormation:
    """Cluster peers into islands from a measured pairwise matrix (see the module docstring).

    ``bandwidth_mbit[i][j]`` and ``rtt_ms[i][j]`` describe the link from i to j; the diagonal is
    ignored. Raises ValueError on mismatched shapes or meaningless parameters.
    """
    n = _check_square("bandwidth_mbit", bandwidth_mbit)
    if _check_square("rtt_ms", rtt_ms) != n:
        raise ValueError(f"rtt_ms has {len(rtt_ms)} rows, bandwidth_mbit {n}")
    if n == 0:
        raise ValueError("no peers to form islands from")
    if reference_bytes <= 0 or floor_ms < 0 or min_gap <= 1:
        raise ValueError("need reference_bytes > 0, floor_ms >= 0 and min_gap > 1")
    cost = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            c = max(link_cost_ms(bandwidth_mbit[i][j], rtt_ms[i][j], reference_bytes),
                    link_cost_ms(bandwidth_mbit[j][i], rtt_ms[j][i], reference_bytes))
            cost[i][j] = cost[j][i] = max(c, floor_ms)
    finite = sorted(cost[i][j] for i in range(n) for j in range(i + 1, n)
                    if math.isfinite(cost[i][j]))
    best_gap, cut = 1.0, None
    for a, b in pairwise(finite):
        ratio = b / a if a > 0 else (math.inf if b > 0 else 1.0)
        if ratio > best_gap:
            best_gap, cut = ratio, (a, b)
    if cut is None or best_gap < min_gap:  # all measured links alike: they are all fast
        spread = finite[-1] / finite[0] if finite else 1.0
        return IslandFormation(_components(n, cost, math.inf), cost, None, None, spread)
    fast_max, slow_min = cut
    return IslandFormation(_components(n, cost, fast_max), cost, fast_max, slow_min, best_gap)


def _components(n: int, cost: list[list[float]], fast_max: float) -> Islands:
    """Connected components of the links costing at most ``fast_max`` (union-find)."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            if math.isfinite(cost[i][j]) and cost[i][j] <= fast_max:
                ri, rj = root(i), root(j)
                parent[max(ri, rj)] = min(ri, rj)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def parse_islands(text: str, workers: int, what: str = "islands") -> Islands:
    """``"0,1|2,3"`` -> ``[[0, 1], [2, 3]]``: every worker in exactly one group.

    ``what`` names the flag in error messages (``islands`` or ``topology``).
    """
    groups: Islands = []
    seen: dict[int, int] = {}
    for g, part in enumerate(text.split("|")):
        members = []
        for item in part.split(","):
            item = item.strip()
            if not item:
                continue
            try:
                index = int(item)
            except ValueError:
                raise ValueError(f"{what} {text!r}: {item!r} is not a worker index "
                                 "(expected groups like '0,1|2,3')") from None
            if not 0 <= index < workers:
                raise ValueError(f"{what} {text!r}: worker {index} does not exist "
                                 f"(workers are 0..{workers - 1})")
            if index in seen:
                raise ValueError(f"{what} {text!r}: worker {index} is in two groups")
            seen[index] = g
            members.append(index)
        if not members:
            raise ValueError(f"{what} {text!r}: group {g + 1} is empty")
        groups.append(sorted(members))
    missing = sorted(set(range(workers)) - set(seen))
    if missing:
        raise ValueError(f"{what} {text!r}: workers {missing} are in no group "
                         f"(every one of the {workers} workers must be listed once)")
    return sorted(groups, key=lambda g: g[0])


def format_islands(islands: Islands) -> str:
    """``[[0, 1], [2, 3]]`` -> ``"0,1|2,3"`` (the form :func:`parse_islands` reads)."""
    return "|".join(",".join(str(i) for i in group) for group in islands)


def island_of(islands: Islands, index: int) -> int:
    """Position of the island that holds worker ``index``."""
    for k, group in enumerate(islands):
        if index in group:
            return k
    raise ValueError(f"worker {index} is in no island of {format_islands(islands)}")
