"""Islands from measured links: the clustering rule on hand-made matrices, and real TCP probes
through emulated per-pair links on loopback."""

from __future__ import annotations

import random

import pytest

from farlink.comm.islands import form_islands, format_islands, link_cost_ms, parse_islands
from farlink.comm.linkprobe import ProbeServer, measure_links, probe_pair, round_robin
from farlink.emulate.pairwise import GroupLinks, PairwiseNetwork, ShapedRelay
from farlink.links import LinkProfile

DC, XR, IC = (10_000, 1.0), (1_000, 80.0), (200, 240.0)  # (Mbit/s, RTT ms) of three classes


def matrix(n: int, link, noise: float = 0.0, seed: int = 0):
    """Directed bandwidth and RTT matrices from ``link(i, j) -> (mbit, rtt)``, with +-noise."""
    rng = random.Random(seed)
    bw = [[None] * n for _ in range(n)]
    rtt = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                mbit, ms = link(i, j)
                bw[i][j] = mbit * (1 + rng.uniform(-noise, noise))
                rtt[i][j] = ms * (1 + rng.uniform(-noise, noise))
    return bw, rtt


def by_group(groups, within=DC, between=IC):
    where = {i: k for k, g in enumerate(groups) for i in g}
    return lambda i, j: within if where[i] == where[j] else between


def test_link_cost_is_rtt_plus_payload_time() -> None:
    assert link_cost_ms(200, 240, 1_000_000) == pytest.approx(240 + 40)
    assert link_cost_ms(None, 1, 10) == float("inf")
    assert link_cost_ms(float("nan"), 1, 10) == float("inf")


def test_two_islands_from_noisy_measurements() -> None:
    groups = [[0, 1], [2, 3]]
    bw, rtt = matrix(4, by_group(groups), noise=0.3)
    formed = form_islands(bw, rtt)
    assert formed.islands == groups
    assert formed.gap > 10 and "2 islands" in formed.explain()


def test_interleaved_islands_are_found_by_links_not_by_index() -> None:
    groups = [[0, 2, 5], [1, 3], [4]]
    bw, rtt = matrix(6, by_group(groups), noise=0.2, seed=3)
    assert form_islands(bw, rtt).islands == groups


def test_three_islands_when_one_pair_of_sites_is_closer() -> None:
    # islands A={0,1}, B={2,3}, C={4,5}; A-B cross-region, A-C and B-C intercontinental: the
    # largest gap is between datacenter links and everything else, so three islands
    site = {0: "A", 1: "A", 2: "B", 3: "B", 4: "C", 5: "C"}

    def link(i: int, j: int):
        if site[i] == site[j]:
            return DC
        return XR if {site[i], site[j]} == {"A", "B"} else IC

    bw, rtt = matrix(6, link, noise=0.1)
    assert form_islands(bw, rtt).islands == [[0, 1], [2, 3], [4, 5]]


def test_one_island_when_all_links_are_alike() -> None:
    bw, rtt = matrix(5, lambda i, j: DC, noise=0.5, seed=1)
    formed = form_islands(bw, rtt)
    assert formed.islands == [[0, 1, 2, 3, 4]] and formed.fast_max_ms is None
    assert "1 island(s)" in formed.explain()
    # ... also when they are all slow: alike is alike
    bw, rtt = matrix(3, lambda i, j: IC, noise=0.2)
    assert form_islands(bw, rtt).islands == [[0, 1, 2]]


def test_asymmetric_links_count_by_their_worse_direction() -> None:
    groups = [[0, 1], [2, 3]]
    bw, rtt = matrix(4, by_group(groups))
    bw[0][1] = 2_000  # one direction of an intra link measured 5x slower: still an island
    bw[2][0], bw[0][2] = 5_000, 200  # fast one way, slow the other: the pair is slow
    assert form_islands(bw, rtt).islands == groups


def test_a_noisy_loopback_cannot_split_an_island_below_the_floor() -> None:
    # pairs differ 8x, but every one moves 1 MiB in well under the 5 ms floor: all alike
    bw, rtt = matrix(4, lambda i, j: (40_000 if i // 2 == j // 2 else 5_000, 0.05))
    assert form_islands(bw, rtt).islands == [[0, 1, 2, 3]]
    # without the floor the same numbers would be cut in two
    assert len(form_islands(bw, rtt, floor_ms=0.0).islands) > 1


def test_unmeasured_pairs_are_slow_links() -> None:
    groups = [[0, 1], [2, 3]]
    bw, rtt = matrix(4, by_group(groups))
    bw[0][2] = rtt[2][0] = None
    assert form_islands(bw, rtt).islands == groups
    nothing = [[None] * 3 for _ in range(3)]
    assert form_islands(nothing, nothing).islands == [[0], [1], [2]]


def test_bad_matrices_are_refused() -> None:
    with pytest.raises(ValueError, match="square"):
        form_islands([[None, 1.0]], [[None, 1.0]])
    with pytest.raises(ValueError, match="rows"):
        form_islands([[None]], [[None, 1.0], [1.0, None]])
    with pytest.raises(ValueError, match="min_gap"):
        form_islands([[None]], [[None]], min_gap=1.0)


@pytest.mark.parametrize("text,message", [
    ("0,1|1,2,3", "worker 1 is in two groups"),
    ("0,1|2", "workers \\[3\\] are in no group"),
    ("0,1||2,3", "group 2 is empty"),
    ("0,1|2,x", "'x' is not a worker index"),
    ("0,1|2,3,4", "worker 4 does not exist"),
])
def test_parse_islands_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_islands(text, 4)


def test_parse_and_format_round_trip() -> None:
    assert parse_islands(" 3,2 | 1,0 ", 4) == [[0, 1], [2, 3]]
    assert format_islands(parse_islands("0,2|1,3", 4)) == "0,2|1,3"


def test_round_robin_covers_every_pair_once_in_disjoint_rounds() -> None:
    for n in (2, 3, 4, 5, 8):
        rounds = round_robin(n)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == [(i, j) for i in range(n) for j in range(i + 1, n)]
        for r in rounds:
            peers = [x for p in r for x in p]
            assert len(peers) == len(set(peers))


# measured rates through a user-space relay: the relay's threads keep the shaped rate only on an
# otherwise idle machine (under -n, 106 Mbit/s was measured for 160), so these run in CI's
# serial pass of slow scenarios, one at a time
@pytest.mark.slow
@pytest.mark.serial
def test_probe_measures_a_shaped_asymmetric_link() -> None:
    up = LinkProfile(bandwidth_mbit=40, latency_ms=15.0, name="up")
    down = LinkProfile(bandwidth_mbit=160, latency_ms=15.0, name="down")
    with ProbeServer() as server:
        relay = ShapedRelay(server.address, up, down)
        try:
            sample = probe_pair(relay.address, pings=4, bulk_bytes=1 << 20)
        finally:
            relay.close()
    assert 28 <= sample.rtt_ms <= 60  # 2 x 15 ms one way, plus scheduling
    assert 30 <= sample.up_mbit <= 44
    assert 120 <= sample.down_mbit <= 176


# measured rates through a user-space relay: the relay's threads keep the shaped rate only on an
# otherwise idle machine (under -n, 106 Mbit/s was measured for 160), so these run in CI's
# serial pass of slow scenarios, one at a time
@pytest.mark.slow
@pytest.mark.serial
def test_measured_emulated_topology_gives_its_islands() -> None:
    groups = [[0, 2], [1, 3]]  # interleaved on purpose: islands come from links, not indices
    with PairwiseNetwork(GroupLinks.of(groups, "datacenter", "intercontinental")) as net:
        measured = measure_links(4, net.route, pings=2, bulk_bytes=1 << 20)
    assert measured.rtt_ms[0][1] == pytest.approx(240, rel=0.2)
    assert measured.bandwidth_mbit[1][0] == pytest.approx(200, rel=0.25)
    assert measured.rtt_ms[0][2] < 20 and measured.bandwidth_mbit[0][2] > 1000
    formed = form_islands(measured.bandwidth_mbit, measured.rtt_ms, reference_bytes=4 << 20)
    assert formed.islands == groups


def test_unreachable_peer_is_left_unmeasured() -> None:
    with ProbeServer() as server:
        live = server.address
    dead = live  # closed: nothing listens there any more
    measured = measure_links(2, lambda i, j: dead, pings=1, bulk_bytes=1 << 17, timeout_s=2)
    assert measured.rtt_ms[0][1] is None and measured.bandwidth_mbit[1][0] is None
