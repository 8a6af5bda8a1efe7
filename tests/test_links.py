"""One link table: the link a run emulates is the link the planner prices.

``--emulate-link home`` (in-process: every collective held for its bytes and latency),
``--inter-link home`` (per-pair relays of a topology), the namespace emulator and
``farlink plan --profile home`` must all describe the same link.
"""

from __future__ import annotations

import pytest
from torch import nn

import farlink
from farlink.emulate.topology import Topology
from farlink.plan import Scenario, plan
from farlink.train.network import NetworkPlan


@pytest.mark.parametrize("name", ["home", "intercontinental", "cross-region", "datacenter"])
def test_emulated_and_priced_link_are_one(name: str) -> None:
    priced = plan(Scenario(n_params=1e9, n_workers=4, gpu="h100", profile=name)).link
    shaped = Topology(2, name).profile(0)  # what the namespaces' tc and delayer are set to
    relayed = NetworkPlan(4, [[0, 1], [2, 3]], "forced", [[0, 1], [2, 3]],
                          inter_link=name).collective_link([0, 2])  # --inter-link NAME
    assert shaped is priced and relayed is priced
    # --emulate-link NAME on an in-process run: held for what the planner charges a hop
    sync = farlink.Optimizer(nn.Linear(4, 4), backend="inprocess", algorithm="diloco",
                             inner_steps=2, steps=4, warmup_steps=1, emulate_link=name)
    try:
        held = sync.collective.emulated_link
        assert held.bandwidth_bytes_per_s * 8 == pytest.approx(priced.bandwidth_bps)
        assert held.latency_s == pytest.approx(priced.latency_s + priced.jitter_s)
    finally:
        sync.close()


def test_home_is_one_asymmetric_jittery_link() -> None:
    """The figures the two tables used to disagree on (downlink, jitter) agree everywhere."""
    priced = plan(Scenario(n_params=1e9, n_workers=4, gpu="h100", profile="home")).link
    topo = Topology(2, "home")
    assert priced.bandwidth_bps == 50e6 and priced.jitter_ms == 10
    assert topo.expected_throughput_mbit(0, 1) == 50  # upload-bound between two homes
    assert topo.profile(0).jitter_ms == priced.jitter_ms
    # the downlink the namespace emulator shapes is the one the planner's table holds
    assert topo.profile(1).download_mbit == priced.download_mbit == 200


def test_loopback_is_priced_but_not_shaped() -> None:
    priced = plan(Scenario(n_params=1e9, n_workers=4, gpu="h100", profile="loopback")).link
    assert priced.bandwidth_bps > 0
    assert Topology(2, "loopback").expected_throughput_mbit(0, 1) is None  # left alone
    sync = farlink.Optimizer(nn.Linear(4, 4), backend="inprocess", inner_steps=2, steps=4, warmup_steps=1,
                             emulate_link="loopback")
    try:
        assert sync.collective.emulated_link is None
    finally:
        sync.close()


def test_a_latency_spread_keeps_every_path_in_its_range() -> None:
    from farlink.links import get_profile, latency_spread, path_latency_ms

    homes = latency_spread("home", 4, 50, 150)
    assert [p.latency_ms for p in homes] == pytest.approx([50, 250 / 3, 350 / 3, 150])
    home = get_profile("home")
    assert all((p.up_mbit, p.down_mbit, p.jitter_ms) == (home.up_mbit, home.down_mbit, 10)
               for p in homes)
    paths = [path_latency_ms(a, b) for a in homes for b in homes if a is not b]
    assert (min(paths), max(paths)) == pytest.approx([(50 + 250 / 3) / 2, (350 / 3 + 150) / 2])
    assert all(50 <= d <= 150 for d in paths)
    assert latency_spread("home", 1, 50, 150)[0].latency_ms == 50
