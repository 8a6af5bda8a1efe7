"""The compressed all-reduce on hivemind (real daemons on loopback, members as threads): each
shard is pushed to its owner alone, the members end on the in-process transport's bits at the
measured bytes, and a member that dies while it owns a shard fails that round only: the others
commit the next one without it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hivemind")

from test_hivemind_early_matchmaking import SHORT, in_threads  # noqa: E402

from farlink.codecs import make_compressor  # noqa: E402
from farlink.comm.hivemind_backend import HivemindCollective  # noqa: E402
from farlink.comm.inprocess import InProcessGroup  # noqa: E402
from farlink.sync.allreduce import ShardedReduce  # noqa: E402
from farlink.sync.exchange import Exchange  # noqa: E402

torch.set_num_threads(1)
SHAPES = {"emb": (4096, 64), "blocks": (2, 12, 64, 64)}
NUMEL = sum(torch.Size(s).numel() for s in SHAPES.values())


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[k].reshape(-1) for k in SHAPES])


def update_of(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11 + rank)
    return {k: torch.randn(*s, generator=gen) for k, s in SHAPES.items()}


class DiesOwningAShard(ShardedReduce):
    """Its member leaves (closes its collective) after the reduce-scatter, owning a shard."""

    def return_shard(self, message: bytes, members: int) -> list[bytes]:
        if self.x.sender == "c":
            self.x.collective.close()
            raise SystemExit("killed while owning a shard")
        return super().return_shard(message, members)


class Dying(Exchange):
    def sharded_reduce(self):  # noqa: ANN201
        return DiesOwningAShard(self)


def test_shards_go_to_their_owners_and_a_dead_owner_costs_one_round() -> None:
    opts = dict(target_group_size=3, min_group_size=2, **SHORT)
    a = HivemindCollective("sharded", **opts)
    peers = {"a": a, "b": HivemindCollective("sharded", a.maddrs, **opts),
             "c": HivemindCollective("sharded", a.maddrs, **opts)}
    try:
        def healthy(name: str, coll: HivemindCollective) -> tuple:
            info = coll.begin_round()
            ex = Exchange(coll, make_compressor("int8+ef"), name)
            before = coll.stats.bytes_sent
            result = ex.average(update_of(info.rank), 1.0, info.round_id)
            return info, result, coll.stats.bytes_sent - before, coll.commit()

        first = in_threads(healthy, peers, timeout=120)
        in_process = InProcessGroup(3).run(lambda r, c: Exchange(
            c, make_compressor("int8+ef"), "abc"[r]).average(update_of(r), 1.0, 0))
        payload = make_compressor("int8").codec.max_payload_nbytes((NUMEL,))
        for info, result, sent, ok in first.values():
            assert ok and info.world_size == 3 and result.path == "allreduce"
            assert torch.equal(flat(result.tensors), flat(in_process[info.rank].tensors))
            ideal = 2 * 2 / 3 * payload
            assert ideal <= sent <= 1.10 * ideal, (sent, ideal)

        def dies_then_goes_on(name: str, coll: HivemindCollective) -> list:
            out = []
            for _ in range(2):
                info = coll.begin_round()
                ex = Dying(coll, make_compressor("int4+ef"), name, path="allreduce")
                try:
                    result = ex.average(update_of(info.rank), 1.0, info.round_id)
                except SystemExit:
                    return ["died"]
                out.append((info.world_size, result.path, coll.commit()))
            return out

        rows = in_threads(dies_then_goes_on, peers, timeout=150)
        assert rows["c"] == ["died"]
        for name in "ab":
            (size0, path0, ok0), (size1, path1, ok1) = rows[name]
            assert size0 == 3 and path0 == "allreduce" and not ok0  # failed, not stuck
            assert size1 == 2 and path1 == "allreduce" and ok1  # the next round, without c
    finally:
        for coll in peers.values():
            coll.close()


def test_a_group_with_a_member_behind_nat_goes_through_the_all_gather() -> None:
    """A client-mode member takes no pushes: ``auto`` keeps such a group on the gathered path,
    and a forced compressed all-reduce still ends on the in-process bits."""
    opts = dict(target_group_size=3, min_group_size=3, **SHORT)
    a = HivemindCollective("sharded-nat", **opts)
    peers = {"a": a, "b": HivemindCollective("sharded-nat", a.maddrs, **opts),
             "c": HivemindCollective("sharded-nat", a.maddrs, client_mode=True, **opts)}
    try:
        def both(name: str, coll: HivemindCollective) -> tuple:
            info = coll.begin_round()
            auto = Exchange(coll, make_compressor("int8+ef"), name)
            assert "no all-to-all" in auto.gathered_reason(update_of(info.rank))
            forced = Exchange(coll, make_compressor("int8+ef"), name, path="allreduce")
            result = forced.average(update_of(info.rank), 1.0, info.round_id)
            return info, result, coll.commit()

        rows = in_threads(both, peers, timeout=120)
        in_process = InProcessGroup(3).run(lambda r, c: Exchange(
            c, make_compressor("int8+ef"), "abc"[r]).average(update_of(r), 1.0, 0))
        for info, result, ok in rows.values():
            assert ok and result.path == "allreduce"
            assert torch.equal(flat(result.tensors), flat(in_process[info.rank].tensors))
    finally:
        for coll in peers.values():
            coll.close()
