"""DiLoCo / local SGD / DDP outer steps against hand-computed references (threads as peers)."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from farlink.codecs import make_compressor
from farlink.comm.inprocess import InProcessGroup
from farlink.config import RunConfig
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange


def run_members(n: int, fn):  # noqa: ANN001, ANN201
    """Run fn(rank, collective) in n threads; re-raise the first failure."""
    return InProcessGroup(n).run(fn)


def make_algo(name: str, collective, codec: str = "none", **overrides):  # noqa: ANN001, ANN201
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    cfg = RunConfig(algorithm=name, codec=codec, steps=100, warmup_steps=0, **overrides)
    exchange = Exchange(collective, make_compressor(codec), sender=f"r{id(collective)}")
    return algorithm_class(name)(model, cfg, collective, exchange)


@pytest.mark.parametrize("codec", ["none", "fp32+ef"])
def test_diloco_outer_step_matches_hand_computed_nesterov(codec: str) -> None:
    # Two workers drift to different local params with different token counts.
    local = {0: [[0.0, 1.0], [0.5, 1.0]], 1: [[1.0, 0.0], [1.0, 2.0]]}
    tokens = {0: 300, 1: 100}

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = make_algo("diloco", collective, codec=codec)
        out = []
        for rnd in range(2):
            with torch.no_grad():
                algo.params[0].copy_(torch.tensor([local[rank][rnd]]))
            algo.tokens_since_sync = tokens[rank]
            outcome = algo.sync()
            assert outcome.committed and outcome.outer_step == rnd + 1
            out.append(algo.params[0].detach().clone())
        return out

    results = run_members(2, member)
    # By hand: theta0 = [1, 2]. Round 1: deltas d0 = [1, 1], d1 = [0, 2]; token-weighted mean
    # (3*d0 + d1)/4 = [0.75, 1.25]. Nesterov SGD (lr .7, mom .9), first step buf = g:
    # theta1 = theta0 - .7 * (g + .9 g) = [1 - 0.9975, 2 - 1.6625] = [0.0025, 0.3375].
    theta1 = torch.tensor([[0.0025, 0.3375]])
    # Round 2: d0 = theta1 - [0.5, 1.0] = [-0.4975, -0.6625]; d1 = theta1 - [1, 2] =
    # [-0.9975, -1.6625]; g = (3 d0 + d1)/4 = [-0.6225, -0.9125]; buf = .9*[.75,1.25] + g =
    # [0.0525, 0.2125]; theta2 = theta1 - .7 * (g + .9 buf) = theta1 - .7*[-0.57525, -0.72125]
    theta2 = theta1 - 0.7 * torch.tensor([[-0.57525, -0.72125]])
    for per_rank in results:
        torch.testing.assert_close(per_rank[0], theta1)
        torch.testing.assert_close(per_rank[1], theta2)


def test_a_joiner_from_its_own_checkpoint_moves_to_the_rounds_end() -> None:
    """Rank 1 restarts at the round boundary the others are syncing in (no healing needed): it
    joins with zero weight and must then stand at the same inner step as rank 0."""
    h = 5

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = make_algo("diloco", collective, inner_steps=h)
        algo.inner_steps_done, algo.tokens_since_sync = (h, 100) if rank == 0 else (0, 0)
        outcome = algo.sync() if rank == 0 else algo.join()
        assert outcome.committed
        return algo.outer_step, algo.inner_steps_done, algo.params[0].detach().clone()

    (o0, i0, p0), (o1, i1, p1) = run_members(2, member)
    assert (o0, i0) == (o1, i1) == (1, h)
    torch.testing.assert_close(p0, p1)


def test_after_a_round_everyone_gave_up_joiners_and_those_they_heal_keep_the_schedule() -> None:
    """A round every member gave up moves the inner steps a round past the outer steps (seen
    in the long churn: inner 60 at outer 5). Rank 0 restarts from its checkpoint at inner 2h,
    up to date (outer 1), and joins the round rank 1 reaches at inner 3h; rank 2, behind (outer
    0), heals in that round from rank 0. All three must then stand at 3h: one round behind, a
    worker finishes a round after the others and the run ends on two states (before: rank 0
    at 2h, from its outer steps, and rank 2 at 2h, rank 0's place when the round began)."""
    h = 5

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = make_algo("diloco", collective, inner_steps=h)
        if rank < 2:  # both committed round 1; rank 0 restarted after the given-up round
            collective.committed_rounds, algo.outer_step = 1, 1
        algo.inner_steps_done, algo.tokens_since_sync = {0: (2 * h, 0), 1: (3 * h, 100),
                                                          2: (h, 100)}[rank]
        outcome = algo.join() if rank == 0 else algo.sync()
        assert outcome.committed
        return algo.outer_step, algo.inner_steps_done, algo.last_round.healed

    results = run_members(3, member)
    assert [steps for _, steps, _ in results] == [3 * h, 3 * h, 3 * h], results
    assert [outer for outer, _, _ in results] == [2, 2, 2]
    assert [healed for _, _, healed in results] == [False, False, True]


def test_local_sgd_is_plain_token_weighted_averaging() -> None:
    local = {0: [0.0, 1.0], 1: [1.0, 0.0]}

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = make_algo("local_sgd", collective)
        with torch.no_grad():
            algo.params[0].copy_(torch.tensor([local[rank]]))
        algo.tokens_since_sync = 100
        algo.sync()
        return algo.params[0].detach().clone()

    for result in run_members(2, member):
        torch.testing.assert_close(result, torch.tensor([[0.5, 0.5]]))


def test_ddp_averages_gradients_and_replicas_stay_identical() -> None:
    grads = {0: [1.0, -1.0], 1: [3.0, 1.0]}

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = make_algo("ddp", collective, grad_clip=0.0, weight_decay=0.0, lr=0.1)
        algo.params[0].grad = torch.tensor([grads[rank]])
        outcome = algo.step(tokens=10)
        assert outcome.committed
        return algo.params[0].detach().clone()

    a, b = run_members(2, member)
    torch.testing.assert_close(a, b)
    # Averaged grad [2, 0]: AdamW's first step moves each coordinate with nonzero grad by lr.
    torch.testing.assert_close(a, torch.tensor([[1.0 - 0.1, 2.0]]), atol=1e-6, rtol=0)


def test_bytes_sent_matches_ring_formula_for_dense_and_gathered_paths() -> None:
    from farlink.codecs import envelope
    from farlink.robust.equivocation import SLOT_DIGEST

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = make_algo("diloco", collective)
        algo.tokens_since_sync = 10
        algo.sync()
        dense = collective.stats.bytes_sent
        gathered = make_algo("diloco", collective, codec="fp32+ef")
        gathered.tokens_since_sync = 10
        before = collective.stats.bytes_sent
        gathered.sync()
        message = envelope.pack(gathered.exchange.sender, 1, 10.0, {"weight": b"\0" * 8},
                                {"weight": (1, 2)}, {"weight": torch.float32})
        return dense, collective.stats.bytes_sent - before, len(message)

    for dense, gathered, message_len in run_members(3, member):
        # 2 params + 1 weight, fp32, ring all-reduce over 3 peers: 2*(3-1)/3 * 12 bytes.
        assert dense == (2 * 2 * 12) // 3
        # ring all-gather: each peer forwards (n-1) messages of its own size, then (n-1)
        # reports of what it received (one SLOT_DIGEST per member, compared for equivocation)
        assert gathered == 2 * message_len + 2 * 3 * SLOT_DIGEST


def test_time_budgeted_round_ends_at_the_step_boundary_nearest_its_deadline() -> None:
    from farlink.sync.base import nearest_step_boundary

    # 4 s steps, a 20 s budget: after 4 steps (16 s) the next boundary (20 s) is nearer: go on
    assert not nearest_step_boundary(now=16.0, started=0.0, steps=4, deadline=20.0)
    assert nearest_step_boundary(now=20.0, started=0.0, steps=5, deadline=20.0)
    # 3 s steps: at 18 s (2 s short) the next boundary, 21 s (1 s over), is nearer: go on
    assert not nearest_step_boundary(now=18.0, started=0.0, steps=6, deadline=20.0)
    # 7 s steps: at 14 s (6 s short) 21 s is nearer: go on; at 21 s the deadline has passed
    assert not nearest_step_boundary(now=14.0, started=0.0, steps=2, deadline=20.0)
    assert nearest_step_boundary(now=21.0, started=0.0, steps=3, deadline=20.0)
    # one 19 s step: stopping 1 s short beats overshooting by 18 s
    assert nearest_step_boundary(now=19.0, started=0.0, steps=1, deadline=20.0)
