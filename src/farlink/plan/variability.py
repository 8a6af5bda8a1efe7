"""What makes a real round slower than the mean worker and the nominal link: stragglers, uneven
links and churn.

Every synchronous collective waits for the slowest participant, so the planner needs expectations
of a *maximum* (slowest worker) or a *minimum* (slowest link) over n draws. Those have no handy
closed form for lognormal speeds, so they are estimated by Monte Carlo with a fixed seed: the same
scenario always gets the same answer, and 20k draws keep the estimate within ~0.5%.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

DRAWS = 20_000


@lru_cache(maxsize=256)
def straggler_factor(n: int, sigma: float, seed: int = 0) -> float:
    """E[max_i X_i] for n worker time-multipliers X_i ~ lognormal with mean 1 and log-sd sigma.

    Mean 1 keeps the *average* worker at the nominal step time, so utilization (the average
    worker's compute over the round's wall-clock) falls only through waiting for the slowest.
    """
    if n <= 1 or sigma <= 0:
        return 1.0
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(mean=-0.5 * sigma * sigma, sigma=sigma, size=(DRAWS, n))
    return float(draws.max(axis=1).mean())


@lru_cache(maxsize=256)
def slowest_link_factor(n: int, min_over_max: float | None, seed: int = 0) -> float:
    """E[B_max / min_i B_i] for n links drawn log-uniformly in [B_min, B_max].

    Multiplying the transfer time at B_max by this factor gives the expected transfer time of a
    collective paced by its slowest link (a ring moves at the speed of its narrowest hop; a
    butterfly round ends when the slowest peer has sent its shards). A log-uniform range is
    scale-free, so the factor depends only on B_min / B_max (which also lets it be cached while
    the bandwidth solver moves the nominal rate).
    """
    if min_over_max is None or min_over_max >= 1 or n < 1:
        return 1.0
    if min_over_max <= 0:
        raise ValueError(f"bandwidth min/max ratio must be positive, got {min_over_max}")
    rng = np.random.default_rng(seed)
    slowest = np.exp(rng.uniform(math.log(min_over_max), 0.0, size=(DRAWS, n)).min(axis=1))
    return float((1.0 / slowest).mean())


def churn_factor(n: int, failures_per_hour: float, round_seconds: float,
                 exposed_comm_seconds: float, rejoin_seconds: float) -> float:
    """Share of worker-time that survives failures arriving as a Poisson process.

    ``failures_per_hour`` is per worker. In farlink a failed round leaves the shared parameters
    untouched and the survivors' local work carries into the next round, so a failure costs
    (a) the failed worker its partial round (T/2 on average) plus its rejoin/heal time, and
    (b) if it lands inside a blocking exchange (probability e/T), every worker half that exchange
    on average before the retry. Per worker and per second of wall-clock this is
    lambda*(T/2 + R) + n*lambda*e^2/(2T), with lambda in failures per second.
    """
    if failures_per_hour <= 0 or round_seconds <= 0:
        return 1.0
    lam = failures_per_hour / 3600.0
    lost = lam * (round_seconds / 2 + rejoin_seconds)
    lost += n * lam * exposed_comm_seconds**2 / (2 * round_seconds)
    return max(0.0, 1.0 - lost)
