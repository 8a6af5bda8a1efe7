"""Hierarchical DiLoCo against a hand-computed reference: two islands of two, threads as peers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from farlink.codecs import make_compressor
from farlink.comm.inprocess import InProcessCollective, InProcessGroup
from farlink.compose import build_handoff
from farlink.config import RunConfig
from farlink.robust.aggregators import make_aggregator
from farlink.robust.auth import make_authenticator
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange
from farlink.sync.hierarchical import HierarchicalDiLoCo

from island_threads import run_islands

ISLANDS = [[0, 1], [2, 3]]


def make_hier(island, upper, secret: str | None = None, global_codec: str = "none",
              global_aggregator: str = "mean", **overrides) -> HierarchicalDiLoCo:
    """With ``secret``, every exchange (island, hand-off, global) signs with it; the global
    exchange uses ``global_codec`` and ``global_aggregator``."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    values = {"algorithm": "hierarchical_diloco", "steps": 100, "warmup_steps": 0,
              "inner_steps": 2, "island_steps": 1}
    cfg = RunConfig(**{**values, **overrides})

    def auth(peer: str):  # noqa: ANN202
        kind = "none" if secret is None else "secret"
        return make_authenticator(kind, secret=secret, peer_id=peer)

    exchange = Exchange(island, make_compressor("none"), sender=f"i{id(island)}",
                        authenticator=auth(f"i{id(island)}"))
    top = None if upper is None else Exchange(upper, make_compressor(global_codec),
                                              sender=f"g{id(upper)}",
                                              aggregator=make_aggregator(global_aggregator),
                                              authenticator=auth(f"g{id(upper)}"))
    return algorithm_class("hierarchical_diloco")(model, cfg, island, exchange,
                                                  global_exchange=top,
                                                  **build_handoff(HierarchicalDiLoCo, exchange))


# Worker w's local parameters and tokens before island round 1 and 2 (global round at 2).
LOCAL = {0: ([0.0, 1.0], [0.0, 0.75]), 1: ([1.0, 0.0], [0.5, 0.75]),
         2: ([2.0, 2.0], [1.0, 3.0]), 3: ([0.0, 4.0], [1.0, 3.0])}
TOKENS = {0: (300, 100), 1: (100, 100), 2: (100, 100), 3: (100, 100)}
# By hand, theta0 = [1, 2]. Round 1 (island only): island 0 deltas [1, 1] (300 tokens) and
# [0, 2] (100) -> mean [0.75, 1.25] -> theta_I0 = [0.25, 0.75]; island 1 deltas [-1, 0] and
# [1, -2] (100 each) -> [0, -1] -> theta_I1 = [1, 3]. Round 2: island 0 deltas from its anchor
# [0.25, 0] and [-0.25, 0] -> theta_I0 = [0.25, 0.75] (600 tokens since the start); island 1
# -> [1, 3] (400 tokens). Global: pseudo-gradients [0.75, 1.25] x 600 and [0, -1] x 400 ->
# g = [0.45, 0.35]; first Nesterov step theta1 = theta0 - 0.7 (g + 0.9 g) = [0.4015, 1.5345].
THETA_I = {0: torch.tensor([[0.25, 0.75]]), 1: torch.tensor([[1.0, 3.0]])}
THETA1 = torch.tensor([[1.0 - 1.33 * 0.45, 2.0 - 1.33 * 0.35]])


def _round(algo: HierarchicalDiLoCo, worker: int, k: int):
    with torch.no_grad():
        algo.params[0].copy_(torch.tensor([LOCAL[worker][k]]))
    return algo.step(TOKENS[worker][k])  # no gradients: the inner AdamW step changes nothing


@pytest.mark.parametrize(("fail", "secret"), [(None, None), ({2}, None), (None, "s3cret")],
                         ids=["clean", "island-commit-fails-after-global", "authenticated"])
def test_two_islands_match_hand_computed_reference(fail: set[int] | None,
                                                   secret: str | None) -> None:
    def member(worker: int, island, upper):
        algo = make_hier(island, upper, secret)
        assert algo.handoff_exchange.dense == (secret is None)  # signed when the run is
        first = _round(algo, worker, 0)
        assert not first.synced and algo.outer_step == 0
        after_island = algo.params[0].detach().clone()
        second = _round(algo, worker, 1)
        assert second.synced and second.committed and second.outer_step == 1
        return algo, after_island, island.stats.bytes_sent

    results = run_islands(member, fail)
    for worker, (algo, after_island, _) in enumerate(results):
        torch.testing.assert_close(after_island, THETA_I[worker // 2])
        torch.testing.assert_close(algo.params[0].detach(), THETA1)
        torch.testing.assert_close(algo.global_params[0], THETA1)
        buf = algo.outer_opt.state[algo.global_params[0]]["momentum_buffer"]
        torch.testing.assert_close(buf, torch.tensor([[0.45, 0.35]]))
        assert algo.island_tokens == 0 and algo.outer_step == 1 and not algo.handoff_pending
    # bit-identical committed state on every replica, leaders and members alike
    states = [r[0].shared_state() for r in results]
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        for name in state:
            if not name.startswith("schedule."):
                assert torch.equal(state[name], states[0][name]), name
    assert len({r[0].fingerprint() for r in results}) == 1
    # only leaders crossed islands; every worker talked inside its island
    traffic = [r[0].traffic() for r in results]
    assert traffic[0]["inter_bytes"] > 0 and traffic[2]["inter_bytes"] > 0
    assert traffic[1]["inter_bytes"] == 0 and traffic[3]["inter_bytes"] == 0
    assert all(t["intra_bytes"] > 0 for t in traffic)
    if fail:  # the retried round re-sent the hand-off but applied the outer step only once
        assert results[0][0].outer_opt.state[results[0][0].global_params[0]]["momentum_buffer"] \
            .eq(torch.tensor([[0.45, 0.35]])).all()


def test_global_round_is_weighted_by_island_tokens_not_island_size() -> None:
    """A one-worker island that processed as many tokens as a two-worker one counts as much."""
    def member(worker: int, island, upper):
        algo = make_hier(island, upper, inner_steps=1)
        target = {0: [0.0, 0.0], 1: [0.0, 0.0], 2: [2.0, 2.0], 3: [2.0, 2.0]}[worker]
        tokens = {0: 50, 1: 50, 2: 100, 3: 0}[worker]
        with torch.no_grad():
            algo.params[0].copy_(torch.tensor([target]))
        algo.step(tokens)
        return algo

    results = run_islands(member)
    # island pseudo-gradients [1, 2] and [-1, 0], 100 tokens each -> g = [0, 1];
    # theta1 = [1, 2] - 1.33 * [0, 1]
    for algo in results:
        torch.testing.assert_close(algo.params[0].detach(), torch.tensor([[1.0, 2.0 - 1.33]]))


def test_members_keep_the_island_average_when_the_global_round_fails() -> None:
    class NoCommit(InProcessCollective):
        def commit(self) -> bool:
            self.group.barrier.wait()
            return False

    def member(worker: int, island, upper):
        if upper is not None:
            upper = NoCommit(upper.group, upper.rank)
        algo = make_hier(island, upper, inner_steps=1, round_retries=0)
        with torch.no_grad():
            algo.params[0].copy_(torch.tensor([LOCAL[worker][0]]))
        outcome = algo.step(TOKENS[worker][0])
        return algo, outcome

    for worker, (algo, outcome) in enumerate(run_islands(member)):
        assert outcome.synced and not outcome.committed and algo.outer_step == 0
        torch.testing.assert_close(algo.params[0].detach(), THETA_I[worker // 2])
        torch.testing.assert_close(algo.global_params[0], torch.tensor([[1.0, 2.0]]))
        assert algo.island_tokens == (400 if worker < 2 else 200)


def test_schedule_and_state_round_trip() -> None:
    def member(worker: int, island, upper):
        algo = make_hier(island, upper)
        _round(algo, worker, 0)
        state = algo.state_dict()
        fresh = make_hier(island, None if upper is None else upper)
        fresh.load_state_dict(state)
        assert fresh.fingerprint() == algo.fingerprint()
        assert fresh.island_tokens == algo.island_tokens and fresh.inner_steps_done == 1
        return True

    assert all(run_islands(member))


# Per round r and worker w: the delta d (anchor - local params) and the tokens behind it.
DELTAS = {0: ([1.0, 1.0], [0.2, 0.0], [0.0, -0.4]), 1: ([0.0, 2.0], [0.2, 0.4], [0.4, 0.0]),
          2: ([-1.0, 0.0], [0.0, 0.6], [0.2, 0.2]), 3: ([1.0, -2.0], [0.4, 0.0], [0.2, 0.2])}
ROUND_TOKENS = {0: (300, 100, 100), 1: (100, 100, 300), 2: (100, 200, 100), 3: (100, 200, 100)}


def reference_three_rounds() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Outer Nesterov by hand over three global rounds of token-weighted island deltas."""
    theta, buf, thetas = torch.tensor([1.0, 2.0]), torch.zeros(2), []
    for r in range(3):
        island_delta, island_tokens = [], []
        for members in ISLANDS:
            w = torch.tensor([float(ROUND_TOKENS[m][r]) for m in members])
            d = torch.stack([torch.tensor(DELTAS[m][r]) for m in members])
            island_delta.append((w[:, None] * d).sum(0) / w.sum())
            island_tokens.append(w.sum())
        w = torch.stack(island_tokens)
        g = (w[:, None] * torch.stack(island_delta)).sum(0) / w.sum()
        buf = 0.9 * buf + g
        theta = theta - 0.7 * (g + 0.9 * buf)
        thetas.append(theta.clone())
    return thetas, buf


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_three_global_rounds_match_reference_with_and_without_overlap(overlap: bool) -> None:
    """Deltas are given relative to the island's anchor, so a one-round-delayed (overlapped)
    outer step whose result is rebased onto the island's progress ends where the synchronous one
    does; in between, overlapped replicas share θ_g while their working copies differ."""
    def member(worker: int, island, upper):
        algo = make_hier(island, upper, inner_steps=1, steps=3, overlap_global=overlap)
        seen = []
        for r in range(3):
            with torch.no_grad():
                algo.params[0].copy_(algo.anchor[0] - torch.tensor([DELTAS[worker][r]]))
            outcome = algo.step(ROUND_TOKENS[worker][r])
            seen.append((outcome.synced, outcome.outer_step, algo.fingerprint(),
                         algo.params[0].detach().clone()))
        return algo, seen

    results = run_islands(member)
    thetas, buf = reference_three_rounds()
    for worker, (algo, seen) in enumerate(results):
        torch.testing.assert_close(algo.params[0].detach()[0], thetas[2])
        torch.testing.assert_close(
            algo.outer_opt.state[algo.global_params[0]]["momentum_buffer"][0], buf)
        assert algo.outer_step == 3 and algo.finished()
        if overlap:  # round 1 only starts a global round; rounds 2 and 3 deliver one each
            assert [s[0] for s in seen] == [False, True, True]
            assert [s[1] for s in seen] == [0, 1, 3]
            # after round 2: θ_g = θ1 everywhere, the working copy is θ1 - the island's delta
            torch.testing.assert_close(algo.global_params[0][0], thetas[2])
            members = ISLANDS[worker // 2]
            w = torch.tensor([float(ROUND_TOKENS[m][1]) for m in members])
            d = torch.stack([torch.tensor(DELTAS[m][1]) for m in members])
            torch.testing.assert_close(seen[1][3][0], thetas[0] - (w[:, None] * d).sum(0) / w.sum())
        else:
            assert [s[0] for s in seen] == [True, True, True]
            assert [s[1] for s in seen] == [1, 2, 3]
            torch.testing.assert_close(seen[0][3][0], thetas[0])
    # the global state is bit-identical on every replica after every outer round
    for r in range(3):
        assert len({seen[r][2] for _, seen in results}) == 1
    assert len({algo.fingerprint() for algo, _ in results}) == 1


def test_an_outsiders_handoff_is_dropped_like_its_updates() -> None:
    """Island 1's leader signs with a key that is not the run's: its members drop its island
    update and its hand-off of the global state (they keep their own island average), where a
    raw all-reduce would have handed its state to them unchecked."""
    def member(worker: int, island, upper):
        algo = make_hier(island, upper, "outsider" if worker == 2 else "s3cret")
        _round(algo, worker, 0)
        outcome = _round(algo, worker, 1)
        return algo, outcome

    results = run_islands(member)
    member3, outcome3 = results[3]
    assert not outcome3.committed and member3.outer_step == 0  # no global state adopted
    assert list(member3.last_exchange.rejected) and member3.last_exchange.accepted == [
        member3.exchange.sender]
    torch.testing.assert_close(member3.global_params[0], torch.tensor([[1.0, 2.0]]))


@pytest.mark.parametrize(("codec", "aggregator"), [("int4", "mean"), ("none", "median")])
def test_the_global_tier_is_diloco_through_the_exchange(codec: str, aggregator: str) -> None:
    """The leaders' round is plain DiLoCo between the island averages: with a lossy codec or a
    robust aggregator on the global exchange, the leaders end on the same θ_g and momentum and
    send the same bytes as two DiLoCo workers that hold θ_I and the islands' tokens, and the
    result is not the fp32 mean's (the codec or the rule was applied)."""
    def member(worker: int, island, upper):
        algo = make_hier(island, upper, global_codec=codec, global_aggregator=aggregator)
        _round(algo, worker, 0)
        assert _round(algo, worker, 1).committed
        return algo

    leaders = [algo for algo in run_islands(member) if algo.leader]

    def flat(rank: int, collective):  # noqa: ANN001, ANN202
        model = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        cfg = RunConfig(algorithm="diloco", steps=100, warmup_steps=0)
        exchange = Exchange(collective, make_compressor(codec), sender=f"g{id(collective)}",
                            aggregator=make_aggregator(aggregator))
        algo = algorithm_class("diloco")(model, cfg, collective, exchange)
        with torch.no_grad():
            algo.params[0].copy_(THETA_I[rank])
        algo.tokens_since_sync = (600, 400)[rank]  # the islands' tokens since θ_0
        assert algo.sync().committed
        return algo

    reference = InProcessGroup(2).run(flat)
    for leader, plain in zip(leaders, reference):
        torch.testing.assert_close(leader.global_params[0], plain.global_params[0])
        torch.testing.assert_close(
            leader.outer_opt.state[leader.global_params[0]]["momentum_buffer"],
            plain.outer_opt.state[plain.global_params[0]]["momentum_buffer"])
        assert leader.traffic()["inter_bytes"] == plain.collective.stats.bytes_sent > 0
        assert not torch.allclose(leader.global_params[0], THETA1)
