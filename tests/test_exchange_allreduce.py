"""The compressed all-reduce (:mod:`farlink.sync.allreduce`) with peers as threads of one process:
bytes per peer per round measured on the wire stay flat from 4 to 32 peers, the result is the
gathered path's within the codec's error and bit-identical on every member, whole-update rules
decide as on the gathered path, and a hostile sender or owner is refused or fails the round."""

from __future__ import annotations

import pytest
import torch

from farlink.codecs import make_compressor
from farlink.comm.inprocess import InProcessGroup
from farlink.robust.aggregators import make_aggregator
from farlink.robust.auth import SharedSecretAuth
from farlink.sync.allreduce import OWNER_NORM_SLACK, RESIDUAL, ShardedReduce, shard_bounds
from farlink.sync.exchange import Exchange
from farlink.testing.faults import FaultyCollective, Faults, InjectedDeath

torch.set_num_threads(1)
SHAPES = {"emb": (256, 96), "w": (4000,), "b": (7,)}
NUMEL = sum(torch.Size(s).numel() for s in SHAPES.values())


#: about the nano preset's parameter count (vocab 4096 x 64 embedding, two 64-wide blocks)
NANO = {"emb": (4096, 64), "blocks": (2, 12, 64, 64), "norm": (64,)}


def updates(members: int, seed: int = 0, shapes=SHAPES) -> list[dict[str, torch.Tensor]]:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(*s, generator=gen) * (1 + 0.1 * r) for k, s in shapes.items()}
            for r in range(members)]


def one_round(members: int, codec: str, path: str, aggregator: str = "mean", data=None,
              weights=None, exchange_class=Exchange, auth=None, rounds: int = 1) -> list:
    """(result, bytes this member sent, its exchange) per member after ``rounds`` rounds."""
    data = data or updates(members)
    weights = weights or [1.0] * members

    def member(rank: int, coll) -> tuple:  # noqa: ANN001
        ex = exchange_class(coll, make_compressor(codec), f"w{rank}",
                            aggregator=make_aggregator(aggregator), path=path,
                            authenticator=auth(rank) if auth else None)
        for r in range(rounds):
            result = ex.average(data[rank], weights[rank], r)
            ok = coll.commit()
        return result, coll.stats.bytes_sent / rounds, ex, ok

    return InProcessGroup(members).run(member, timeout=300)


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[k].reshape(-1) for k in SHAPES])


def test_shards_cover_the_vector_in_whole_blocks() -> None:
    bounds = shard_bounds(1000, 6, 64)
    assert bounds[0][0] == 0 and bounds[-1][1] == 1000
    assert all(a % 64 == 0 for a, _ in bounds)
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(5))
    assert shard_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]


@pytest.mark.parametrize("codec", ["int8+ef", "int4+ef", "fp16"])
def test_bytes_per_peer_stay_flat_from_4_to_32_peers(codec: str) -> None:
    """Measured on the wire (every message's length), not computed from a formula: within 10%
    of 2 (n-1)/n x payload at every n, and at 16 peers int8 sends <= 1/7 of the gathered path."""
    numel = sum(torch.Size(s).numel() for s in NANO.values())
    payload = make_compressor(codec).codec.max_payload_nbytes((numel,))
    sent = {}
    data = updates(32, shapes=NANO)
    for n in (4, 8, 16, 32):
        rows = one_round(n, codec, "auto", data=data[:n])
        assert {ex.last_path for _, _, ex, _ in rows} == {"allreduce"}
        sent[n] = max(b for _, b, _, _ in rows)
        ideal = 2 * (n - 1) / n * payload
        assert ideal <= sent[n] <= 1.10 * ideal, (n, sent[n], ideal)
    assert max(sent.values()) <= 1.10 * 2 * payload  # bounded whatever n: it does not grow
    if codec == "int8+ef":
        gathered = max(b for _, b, _, _ in one_round(16, codec, "gathered", data=data[:16]))
        assert sent[16] <= gathered / 7, (sent[16], gathered)


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int8+ef", "int4", "int4+ef"])
def test_result_is_the_gathered_mean_within_the_codec_error(codec: str) -> None:
    n, weights = 5, [1.0, 2.0, 1.5, 1.0, 2.0]
    data = updates(n, seed=1)
    ar = one_round(n, codec, "allreduce", data=data, weights=weights)
    gathered = one_round(n, codec, "gathered", data=data, weights=weights)
    exact = sum(flat(d) * w for d, w in zip(data, weights)) / sum(weights)
    ar_flat = flat(ar[0][0].tensors)
    gathered_err = float((flat(gathered[0][0].tensors) - exact).norm())
    ar_err = float((ar_flat - exact).norm())
    # the owner's re-encoding is one more rounding of the same codec
    assert ar_err <= 2.5 * gathered_err + 1e-6, (ar_err, gathered_err)
    assert ar[0][0].total_weight == gathered[0][0].total_weight == sum(weights)
    for result, _, _, ok in ar:  # every member holds the same bits and commits
        assert ok and torch.equal(flat(result.tensors), ar_flat)


def test_error_feedback_keeps_what_the_peers_own_encoding_dropped() -> None:
    data = updates(4, seed=2)
    rows = one_round(4, "int4+ef", "allreduce", data=data)
    for rank, (_, _, ex, _) in enumerate(rows):
        residual = ex.compressor.residuals[RESIDUAL]
        assert residual.shape == (NUMEL,) and float(residual.abs().max()) > 0
        codec = ex.compressor.codec
        # what was sent (the encoding of each shard) plus the residual is the update itself
        sent = torch.cat([codec.decode(codec.encode(flat(data[rank])[a:b]), (b - a,),
                                       torch.float32) for a, b in shard_bounds(NUMEL, 4, 64)])
        assert torch.allclose(sent + residual, flat(data[rank]), atol=1e-6)


@pytest.mark.parametrize("rule", ["centered_clip", "median", "trimmed_mean", "norm_bounded",
                                  "krum"])
def test_whole_update_rules_decide_as_on_the_gathered_path(rule: str) -> None:
    """With fp32 nothing is lost on the wire: the sharded rule, using per-shard partials for the
    whole update's geometry, gives the gathered path's whole-update result."""
    data = updates(6, seed=3)
    data[5] = {k: v * 50 for k, v in data[5].items()}  # one peer far away
    ar = one_round(6, "fp32", "allreduce", rule, data=data)
    gathered = one_round(6, "fp32", "gathered", rule, data=data)
    assert ar[0][0].path == "allreduce" and gathered[0][0].path == "gathered"
    assert torch.allclose(flat(ar[0][0].tensors), flat(gathered[0][0].tensors), atol=1e-5)
    if rule != "median":
        assert float(flat(ar[0][0].tensors).norm()) < 2 * float(flat(data[0]).norm())


def test_a_nonfinite_sender_is_refused_everywhere_and_the_round_goes_on() -> None:
    """Its bad shard reaches one owner (w0), the only one that can check it: the sender is
    refused everywhere, and the accuser's own update sits the round out."""
    data = updates(5, seed=4)
    data[3]["emb"][0, 0] = float("nan")  # in owner 0's shard only
    rows = one_round(5, "fp16", "allreduce", "mean", data=data)
    exact = sum(flat(d) for i, d in enumerate(data) if i not in (0, 3)) / 3
    for result, _, _, ok in rows:
        assert ok and result.accepted == ["w1", "w2", "w4"]
        assert result.rejected["w3"].startswith("nonfinite")
        assert result.rejected["w0"].startswith("accuser")
    assert float((flat(rows[0][0].tensors) - exact).norm()) < 0.01 * float(exact.norm())


def test_an_update_every_owner_refuses_costs_no_accuser_its_update() -> None:
    data = updates(5, seed=4)
    data[3] = {k: torch.full_like(v, float("inf")) for k, v in data[3].items()}
    for result, _, _, ok in one_round(5, "fp16", "allreduce", "median", data=data):
        assert ok and result.accepted == ["w0", "w1", "w2", "w4"]
        assert result.rejected["w3"].startswith("nonfinite")


def test_an_outsider_without_the_run_secret_is_refused_and_fails_its_shard() -> None:
    """Its shards do not verify (refused everywhere); the shard it owns comes back unsigned, so
    its owner is failed for the round: no member commits it."""
    auth = lambda rank: SharedSecretAuth("outsider" if rank == 2 else "run-secret",  # noqa: E731
                                         peer_id=f"w{rank}")
    rows = one_round(4, "int8+ef", "allreduce", "centered_clip", auth=auth)
    for rank, (result, _, _, ok) in enumerate(rows):
        assert not ok, rank
        if rank != 2:
            assert result.rejected["rank2"].startswith("owner"), result.rejected


def test_signed_rounds_cost_little_more_than_plain_ones() -> None:
    auth = lambda rank: SharedSecretAuth("run-secret", peer_id=f"w{rank}")  # noqa: E731
    plain = one_round(16, "int8+ef", "allreduce")
    robust = one_round(16, "int8+ef", "allreduce", "centered_clip", auth=auth)
    assert all(ok for *_, ok in robust) and not robust[0][0].rejected
    assert robust[0][1] <= 1.20 * plain[0][1], (robust[0][1], plain[0][1])


class CheatingOwner(ShardedReduce):
    def return_shard(self, message: bytes, members: int) -> list[bytes]:
        if self.x.sender != "w1":
            return super().return_shard(message, members)
        return [self.cheat(message)] * members

    def cheat(self, message: bytes) -> bytes:
        return message


class ScalingOwner(CheatingOwner):
    """Owner w1 returns its aggregate shard scaled up, re-signed as itself."""

    def _aggregate(self, stack, w, norms, accepted):  # noqa: ANN001, ANN202
        shard = super()._aggregate(stack, w, norms, accepted)
        return shard * (3 * OWNER_NORM_SLACK * len(accepted)) if self.x.sender == "w1" else shard


class EquivocatingOwner(CheatingOwner):
    """Owner w1 sends member 0 a different aggregate than the others."""

    def return_shard(self, message: bytes, members: int) -> list[bytes]:
        out = super().return_shard(message, members)
        if self.x.sender == "w1":
            changed = bytearray(message)
            changed[-1] ^= 1
            out[0] = bytes(changed)
        return out


class AccusingOwner(CheatingOwner):
    """Owner w1 refuses every other member's shard, as if each were bad."""

    def _open_shards(self, *args):  # noqa: ANN002, ANN202
        senders = super()._open_shards(*args)
        if self.x.sender == "w1":
            for k, s in enumerate(senders):
                if k != 1:
                    s.verdict, s.why = "nonfinite", "claimed by w1"
        return senders


@pytest.mark.parametrize("cheat", [ScalingOwner, EquivocatingOwner, AccusingOwner])
def test_a_cheating_owner_fails_the_round_and_is_named(cheat: type) -> None:
    class Cheats(Exchange):
        def sharded_reduce(self):  # noqa: ANN202
            return cheat(self)

    rows = one_round(4, "int8+ef", "allreduce", exchange_class=Cheats)
    for result, _, _, ok in rows:
        assert not ok
        assert result.tensors == {}
        assert result.rejected.get("w1", "").startswith(
            "accuser" if cheat is AccusingOwner else "owner"), result.rejected


def test_auto_keeps_tiny_updates_on_the_gathered_path_and_sparse_codecs_too() -> None:
    tiny = [{"x": torch.ones(3)} for _ in range(3)]

    def member(rank: int, coll) -> tuple:  # noqa: ANN001
        small = Exchange(coll, make_compressor("int8"), f"w{rank}")
        sparse = Exchange(coll, make_compressor("topk:0.1"), f"w{rank}")
        a = small.average(tiny[rank], 1.0, 0)
        b = sparse.average(updates(3)[rank], 1.0, 0)
        return a.path, b.path, sparse.gathered_reason()

    for small_path, sparse_path, why in InProcessGroup(3).run(member):
        assert (small_path, sparse_path) == ("gathered", "gathered")
        assert "sparse" in why


def test_error_feedback_carries_both_encodings_across_rounds() -> None:
    """Ten rounds of the same updates: with error feedback (the peers' and the owners') the sum
    of the aggregates tracks ten times the exact mean far closer than without."""
    data = updates(4, seed=5)
    exact = sum(flat(d) for d in data) / 4

    def drift(codec: str) -> float:
        def member(rank: int, coll) -> torch.Tensor:  # noqa: ANN001
            ex = Exchange(coll, make_compressor(codec), f"w{rank}", path="allreduce")
            total = torch.zeros(NUMEL)
            for r in range(10):
                total += flat(ex.average(data[rank], 1.0, r).tensors)
                assert coll.commit()
            return total

        return float((InProcessGroup(4).run(member)[0] - 10 * exact).norm())

    with_ef, without = drift("int4+ef"), drift("int4")
    assert with_ef < 0.3 * without, (with_ef, without)


def dying_round(members: int, victims: set[int], rule: str = "mean", codec: str = "int8+ef",
                data=None, rounds: int = 1) -> list:  # noqa: ANN001
    """``one_round`` where each of ``victims`` dies (its collective closes) as it enters the
    return of the aggregate shards in round 0: after the reduce-scatter, while it owns a shard
    whose parts only it holds."""
    data = data or updates(members, seed=6)
    faults = Faults()
    for v in victims:
        faults.die_at_all_to_all(v, round=0, call=1)

    def member(rank: int, coll) -> tuple:  # noqa: ANN001
        coll = FaultyCollective(coll, faults, rank)
        ex = Exchange(coll, make_compressor(codec), f"w{rank}", aggregator=make_aggregator(rule),
                      path="allreduce")
        out = []
        for r in range(rounds):
            coll.begin_round()
            try:
                result = ex.average(data[rank], 1.0, r)
            except InjectedDeath:
                return [("died", r)]
            out.append((result, coll.commit()))
        return out

    rows = InProcessGroup(members).run(member, timeout=300)
    assert sorted(r for r, _, what in faults.fired if what == "death") == sorted(victims)
    return rows


@pytest.mark.parametrize("rule", ["mean", "centered_clip", "trimmed_mean", "norm_bounded",
                                  "krum"])
def test_an_owner_dying_mid_round_has_its_shard_redone_and_the_round_commits(rule: str) -> None:
    """w2 dies after the reduce-scatter, holding every member's part of shard 2: w3 (the next
    live member) gets the live members' parts again, aggregates them, and the round commits on
    every survivor with the same bits. Every other shard is the aggregate of all five updates;
    shard 2 is the rule over the four live members' parts (w2's own part died with it), with
    the round's whole-update decision (clip factors, norm bound, Krum's pick)."""
    n, data = 5, updates(5, seed=6)
    rows = dying_round(n, {2}, rule, data=data)
    assert rows[2] == [("died", 0)]
    survivors = [rows[k][0] for k in (0, 1, 3, 4)]
    first = flat(survivors[0][0].tensors)
    for result, ok in survivors:
        assert ok and result.reassigned == {"w2": "w3"}
        assert result.accepted == ["w0", "w1", "w2", "w3", "w4"]
        assert torch.equal(flat(result.tensors), first)
    a, b = shard_bounds(NUMEL, n, make_compressor("int8+ef").codec.block)[2]
    reference = one_round(n, "int8+ef", "allreduce", rule, data=data)
    whole = flat(reference[0][0].tensors)
    outside = torch.cat([first[:a], first[b:]])
    assert torch.equal(outside, torch.cat([whole[:a], whole[b:]]))  # untouched by the death
    live_mean = sum(flat(data[k])[a:b] for k in (0, 1, 3, 4)) / 4
    if rule == "krum":  # the same pick (a live member), whose part the new owner holds
        assert torch.equal(first[a:b], whole[a:b])
        return
    if rule == "mean":  # the live members' mean, within int8's error
        err = float((first[a:b] - live_mean).norm())
        assert err < 0.02 * float(live_mean.norm()), err
    assert float((first[a:b] - live_mean).norm()) < 0.5 * float(live_mean.norm())


def test_two_owners_dying_leave_no_majority_to_redo_and_the_round_fails_cleanly() -> None:
    """Of four members two die owning shards: two of four is no majority (the other half of a
    split could commit too), so the survivors fail the round instead of redoing."""
    rows = dying_round(4, {1, 2})
    for k in (0, 3):
        (result, ok), = rows[k]
        assert not ok and result.tensors == {} and not result.reassigned
        assert "too few to redo" in result.rejected["round"]


def test_two_owners_dying_among_seven_have_both_shards_redone() -> None:
    rows = dying_round(7, {3, 4})
    results = [rows[k][0] for k in (0, 1, 2, 5, 6)]
    for result, ok in results:
        assert ok and result.reassigned == {"w3": "w5", "w4": "w5"}
        assert torch.equal(flat(result.tensors), flat(results[0][0].tensors))
