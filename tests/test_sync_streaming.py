"""Streaming DiLoCo: fragment schedule, agreement after each fragment round, real overlap."""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from farlink.codecs import make_compressor
from farlink.comm.base import RoundInfo
from farlink.comm.inprocess import InProcessGroup, LinkModel
from farlink.config import RunConfig
from farlink.robust.heal import state_fingerprint
from farlink.sync.exchange import Exchange
from farlink.sync.streaming import StreamingDiLoCo, assign_fragments, fragment_shift


class Blocks(nn.Module):
    def __init__(self, n: int = 4, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(width, width, bias=False)
        self.blocks = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def test_fragment_schedule_is_staggered_and_avoids_h_boundaries() -> None:
    shifts = [fragment_shift(f, 4, 40) for f in range(4)]
    assert shifts == [5, 15, 25, 35]  # p*H/P + H/(2P)
    assert all(s % 40 != 0 for s in shifts)
    names = ["embed.weight"] + [f"blocks.{i}.weight" for i in range(4)]
    assignment = assign_fragments(names, [64] * 5, 2)
    assert assignment[1:] == [0, 1, 0, 1]  # blocks dealt out strided
    assert assignment[0] in (0, 1)


def _run(n: int, cfg: RunConfig, link: LinkModel | None, steps: int):  # noqa: ANN202
    group = InProcessGroup(n, link)
    init_lock = threading.Lock()  # the global RNG is shared by threads: seed+init atomically

    def member(rank: int, coll):  # noqa: ANN001, ANN202
        with init_lock:
            model = Blocks()
        ex = Exchange(coll, make_compressor(cfg.codec), sender=f"p{rank}")
        algo = StreamingDiLoCo(model, cfg, coll, ex)
        gen = torch.Generator().manual_seed(rank + 1)
        snapshots, compute, comm = [], 0.0, 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            x = torch.randn(16, 8, generator=gen)
            loss = (model(x) - x).pow(2).mean()
            loss.backward()
            time.sleep(0.01)  # a step of "compute"
            outcome = algo.step(16)
            comm += outcome.comm_seconds
            compute += time.perf_counter() - t0 - outcome.comm_seconds
            if outcome.synced:
                snapshots.append([g.clone() for g in algo.global_params])
        algo.finish()
        return snapshots, compute, comm, coll.stats.bytes_sent

    return group.run(member, timeout=120)


def test_replicas_agree_on_global_fragments_after_every_round() -> None:
    cfg = RunConfig(algorithm="streaming_diloco", inner_steps=8, fragments=2, overlap_steps=1,
                    steps=32, warmup_steps=0, codec="int8+ef")
    results = _run(3, cfg, None, 32)
    rounds = len(results[0][0])
    assert rounds == 32 // 8 * 2  # every fragment synced every H steps
    for r in range(rounds):
        for other in results[1:]:
            for a, b in zip(results[0][0][r], other[0][r]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_communication_overlaps_compute() -> None:
    # A dense round over 2 peers costs 2*(n-1) latencies = 50 ms on this link; tau = 5 steps of
    # >= 10 ms compute hides it. 48 steps / H=12 * 2 fragments = 8 rounds = 0.4 s if exposed.
    link = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.025)
    common = dict(inner_steps=12, fragments=2, steps=48, warmup_steps=0)
    overlapped = _run(2, RunConfig(algorithm="streaming_diloco", overlap_steps=5, **common),
                      link, 48)
    _, compute, comm, _ = overlapped[0]
    assert comm < 0.5 * 8 * 0.05, comm
    assert compute / (compute + comm) > 0.8


def _hand_run(overlap_steps: int, alpha: float, steps: int) -> list[list[torch.Tensor]]:
    """Two workers, one fragment synced at step 2 of every H = 4; no gradients, so the inner
    optimizer leaves the parameters where the test puts them."""
    cfg = RunConfig(algorithm="streaming_diloco", inner_steps=4, fragments=1, steps=8,
                    warmup_steps=0, overlap_steps=overlap_steps, mix_alpha=alpha)
    local = {0: torch.tensor([[0.0, 1.0]]), 1: torch.tensor([[1.0, 0.0]])}

    def member(rank: int, coll):  # noqa: ANN001, ANN202
        model = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        algo = StreamingDiLoCo(model, cfg, coll, Exchange(coll, make_compressor("none"),
                                                          sender=f"p{rank}"))
        after = []
        for t in range(1, steps + 1):
            if t == 2:
                with torch.no_grad():
                    algo.params[0].copy_(local[rank])
            algo.step(16)
            after.append(algo.params[0].detach().clone())
        algo.finish()
        return after

    return InProcessGroup(2).run(member, timeout=60)


def test_tau_zero_applies_the_outer_update_in_the_step_it_is_launched() -> None:
    alpha = 0.25  # not 0.5, which would hide a swapped local/global mix
    # By hand: theta0 = [1, 2]; deltas [1, 1] and [0, 2], equal tokens: g = [0.5, 1.5];
    # first Nesterov step (lr 0.7, momentum 0.9): theta1 = theta0 - 0.7 * 1.9 * g
    theta1 = torch.tensor([[1.0, 2.0]]) - 0.7 * 1.9 * torch.tensor([[0.5, 1.5]])
    local = {0: torch.tensor([[0.0, 1.0]]), 1: torch.tensor([[1.0, 0.0]])}
    for rank, after in enumerate(_hand_run(0, alpha, 3)):
        mixed = alpha * local[rank] + (1 - alpha) * theta1
        torch.testing.assert_close(after[1], mixed)  # right after step 2, its launch step
        torch.testing.assert_close(after[2], mixed)
    for rank, after in enumerate(_hand_run(1, alpha, 3)):  # tau = 1: one step later
        torch.testing.assert_close(after[1], local[rank])
        torch.testing.assert_close(after[2], alpha * local[rank] + (1 - alpha) * theta1)


def test_with_rounds_in_flight_for_a_period_the_served_state_has_every_landed_round() -> None:
    # --outer-overlap delayed: rounds land and wait for their step, while later rounds run. A
    # peer healing in a round fetches this replica's state some time after the fingerprint
    # announced at the quorum; the training thread may have applied landed rounds meanwhile.
    # Both must be one state: θ with every landed round applied, however many were applied.
    cfg = RunConfig(algorithm="streaming_diloco", inner_steps=4, fragments=4, steps=16,
                    warmup_steps=0, outer_overlap="delayed")

    def member(rank: int, coll):  # noqa: ANN001, ANN202
        model = Blocks()
        algo = StreamingDiLoCo(model, cfg, coll, Exchange(coll, make_compressor("none"),
                                                          sender=f"p{rank}"))
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):  # rounds of 4 fragments launched, none landed at its step yet
            x = torch.randn(16, 8, generator=gen)
            (model(x) - x).pow(2).mean().backward()
            algo.step(16)
        for r in algo._queue:
            r.future.result()  # landed, waiting for their step
        served = algo.shared_state()
        algo.finish()  # the training thread applies them
        return served, algo.shared_state()

    served, applied = InProcessGroup(1).run(member, timeout=60)[0]
    assert state_fingerprint(served) == state_fingerprint(applied)
    for name, tensor in applied.items():
        assert torch.equal(served[name], tensor), name


def test_a_member_at_another_fragment_of_the_same_round_fails_it_cleanly_and_heals() -> None:
    # --outer-overlap delayed: a member left out of a round that then failed on the others
    # meets their next fragment's round under the same round id. Here member 2 skips
    # fragment 0 in the second period, so its round of fragment 1 meets the others' round of
    # fragment 0. Summing them would fail in the collective (other sizes); the members
    # compare fragments first, fail that round everywhere, and member 2 heals in its retry.
    cfg = RunConfig(algorithm="streaming_diloco", inner_steps=4, fragments=4, steps=16,
                    warmup_steps=0, outer_overlap="delayed")
    init_lock = threading.Lock()

    def member(rank: int, coll):  # noqa: ANN001, ANN202
        with init_lock:
            model = Blocks()
        algo = StreamingDiLoCo(model, cfg, coll, Exchange(coll, make_compressor("none"),
                                                          sender=f"p{rank}"))
        rounds = []
        begin_round = coll.begin_round

        def recorded(*args, **kwargs) -> RoundInfo:
            info = begin_round(*args, **kwargs)
            rounds.append((info.round_id, info.healed))
            return info

        coll.begin_round = recorded
        gen = torch.Generator().manual_seed(rank + 1)
        while not algo.finished():
            x = torch.randn(16, 8, generator=gen)
            (model(x) - x).pow(2).mean().backward()
            algo.step(16)
            if rank == 2 and algo.inner_steps_done == 4:
                algo.launched_in_period = 1  # fragment 0 is skipped in the next period
        algo.finish()
        return (algo.fingerprint(), algo.outer_step, algo.inner_steps_done, rounds,
                coll.stats.failed_rounds, [g.clone() for g in algo.global_params])

    results = InProcessGroup(3).run(member, timeout=60)
    fingerprint, outer_step, _, _, _, committed = results[0]
    assert [healed for _, healed in results[2][3]].count(True) == 1, results[2][3]
    assert (4, True) in results[2][3], results[2][3]  # healed in the failed round's retry
    for rank, (fp, step, inner, _, failed, params) in enumerate(results):
        assert failed == 1, (rank, failed)
        assert (fp, step, inner) == (fingerprint, outer_step, 16), rank
        for a, b in zip(params, committed):
            assert torch.equal(a, b), rank


def test_a_members_tag_that_names_no_fragment_is_left_out_of_the_comparison() -> None:
    """A tag is a peer's word: one that is not a fragment of this run (garbage, out of range)
    neither raises in the round's thread nor fails the round; the members that name real
    fragments are compared."""
    cfg = RunConfig(algorithm="streaming_diloco", inner_steps=4, fragments=4, steps=16,
                    warmup_steps=0, outer_overlap="delayed")
    coll = InProcessGroup(1).member(0)
    algo = StreamingDiLoCo(Blocks(), cfg, coll, Exchange(coll, make_compressor("none"),
                                                         sender="w0"))
    for tags in (["0", "x9", None], ["0", "99", "0"], ["0", "-1", ""]):
        info = RoundInfo(round_id=3, rank=0, world_size=3, healed=False, tags=tags)
        assert algo._round_fragment(0, info) == 0, tags
