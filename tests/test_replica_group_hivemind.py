"""Replica groups of several ranks on the hivemind backend: through ``farlink train``, and the
collective.

Real processes: a bootstrap DHT peer, each replica group a ``torchrun`` of 2 ranks that shard a GPT
with ``fully_shard`` over Gloo, every rank with its own p2p daemon; the replica group's rank 0
matchmakes and votes, and rank r exchanges its shard with rank r of the other replica group. The
same run with one rank per replica group is the reference: same batches, same arithmetic (the
gathered path decodes the same bytes on every replica group), so FSDP2 changes only the order of
floating-point reductions inside a step, which is why the held-out losses agree to 1e-4 as on
torchft. Both runs use ``--auth secret``: every rank proves membership to its counterparts and MACs
its own shard's update.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from replica_group_ledgers import assert_every_rank_accepted

pytest.importorskip("hivemind")

GROUP_RUN = {"workers": 2, "steps": 20, "inner_steps": 10, "warmup_steps": 10, "batch_size": 8,
             "vocab_size": 512, "seq_len": 64, "eval_batches": 4, "backend": "hivemind",
             "auth": "secret", "secret": "the-run-secret"}


def group_run(tmp_path: Path, cache_dir: Path, name: str, **overrides):
    from farlink.config import load_config
    from farlink.train.launcher import launch

    cfg = load_config(None, {**GROUP_RUN, "run_dir": tmp_path / name, "cache_dir": cache_dir,
                             **overrides})
    return cfg, launch(cfg, show_progress=False)


def test_two_replica_groups_of_two_ranks_on_hivemind_match_one_rank_replica_groups(
        tmp_path, cache_dir):
    from safetensors.torch import load_file

    cfg2, n_groups = group_run(tmp_path, cache_dir, "k2", ranks_per_worker=2)
    assert n_groups.returncodes == [0, 0]
    # every rank checked every update it took: one ledger per rank, each replica group's accepted
    # twice
    assert_every_rank_accepted(cfg2.run_dir, updates=2)
    _, plain = group_run(tmp_path, cache_dir, "k1")
    assert plain.returncodes == [0, 0]
    s2, s1 = n_groups.summary, plain.summary
    # each replica group one member of every group: both rounds averaged the two replica groups,
    # never 4 peers
    assert s2["widest_group"] == 2 and s2["final_replicas"]["consistent"], s2["final_replicas"]
    assert [s[0] for s in s2["final_replicas"]["states"].values()] == [2, 2]
    # every rank of both replica groups holds the same shards: the whole models gathered from them
    # agree
    a, b = (load_file(str(cfg2.run_dir / "final" / f"w{i}.safetensors")) for i in range(2))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    loss2, loss1 = s2["final_heldout_loss"], s1["final_heldout_loss"]
    assert abs(loss2 - loss1) <= 1e-4 * loss1, (loss2, loss1)
    # each rank sends only its shard: a replica group moves what a one-rank replica group moves, up
    # to each rank's messages carrying their own headers (tensor names and shapes), MACs and, on
    # the compressed all-reduce that --auth takes, its owner's signed reports (~2.4 kB a rank a
    # round)
    for worker in ("w0", "w1"):
        bytes2 = s2["per_worker"][worker]["bytes_sent"]
        bytes1 = s1["per_worker"][worker]["bytes_sent"]
        assert abs(bytes2 - bytes1) <= 2e-3 * bytes1, (worker, bytes2, bytes1)


# --- the collective alone: two replica groups of two ranks, one of them behind --------------------

N = 300  # elements each rank reduces (its "shard")


def _replica_group_rank(index: int, rank: int, port: int, bootstrap: list[str], plan: dict,
                        q) -> None:
    """One rank of a replica group: ``plan["committed"][index]`` rounds done,
    ``plan["rounds"]`` rounds to run; the rank in ``plan["stateless"]`` (replica group, rank)
    registers no state before its second round, so it cannot heal in the first."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from farlink.comm.errors import CommError
    from farlink.comm.hivemind_backend import HivemindCollective
    from farlink.comm.hivemind_replica_group import HivemindReplicaGroupCollective
    from farlink.parallel.sharding import ReplicaGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    coll = HivemindReplicaGroupCollective(
        ReplicaGroup(rank=rank, size=2, replica_index=index),
        lambda: HivemindCollective(plan["run"], bootstrap, min_group_size=2, target_group_size=2,
                                   matchmaking_time=1.0, request_timeout=1.0,
                                   round_timeout=plan.get("round_timeout", 60.0),
                                   allreduce_timeout=2.0, gather_timeout=4.0, commit_timeout=4.0,
                                   state_timeout=20.0))
    committed = plan["committed"][index]
    # this rank's shard of the replica's state: different on every rank of the up-to-date replica
    # group
    state = {"w": torch.full((8,), 10.0 * rank + 1.0 if committed else -1.0)}

    def register() -> None:
        coll.register_state(lambda: {"w": state["w"].clone()},
                            lambda s: state.update(w=s["w"].clone()))

    stateless = tuple(plan.get("stateless", ())) == (index, rank)
    if not stateless:
        register()
    coll.load_committed_step(committed)
    reports = []
    for _ in range(plan["rounds"]):
        try:
            info = coll.begin_round()
        except CommError as exc:  # no group: every rank of the replica group says why
            reports.append({"error": type(exc).__name__, "message": str(exc)})
            break
        tensors = [torch.full((N,), float((index + 1) * (rank + 1)))]
        before = coll.stats.bytes_sent
        coll.all_reduce_sum(tensors)
        reduce_bytes = coll.stats.bytes_sent - before
        gathered = coll.all_gather_bytes(f"group{index}-rank{rank}".encode())
        ok = coll.commit()
        reports.append({"round_id": info.round_id, "world": info.world_size,
                        "healed": info.healed, "w": state["w"].tolist(),
                        "sums": tensors[0].tolist(), "reduce_bytes": reduce_bytes,
                        "shards": list(coll.last_shards), "gathered": gathered, "ok": ok,
                        "committed_after": coll.peer.round_id})
        if stateless:
            register()
    q.put({"replica_group": index, "rank": rank, "rounds": reports,
           "peer": str(coll.peer.peer_id)})
    coll.close()
    dist.destroy_process_group()


def run_replica_groups(plan: dict, n_groups: int = 2) -> dict[tuple[int, int], dict]:
    """``n_groups`` replica groups of two ranks, each rank its own process and hivemind peer;
    their reports."""
    import multiprocessing as mp
    import socket

    from farlink.comm.hivemind_net import start_bootstrap_peer

    bootstrap, maddrs = start_bootstrap_peer("127.0.0.1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = []
    for _ in range(n_groups):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    procs = [ctx.Process(target=_replica_group_rank,
                         args=(index, rank, ports[index], maddrs, plan, q))
             for index in range(n_groups) for rank in range(2)]
    try:
        for p in procs:
            p.start()
        reports = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        bootstrap.shutdown()
    return {(r["replica_group"], r["rank"]): r for r in reports}


@pytest.mark.slow  # about 20-25 s: four hivemind peers of two replica groups
def test_a_behind_replica_group_heals_rank_by_rank_and_ranks_reduce_with_their_counterparts():
    """Replica group 0 has committed 3 rounds, replica group 1 none: one round later every rank of
    replica group 1 holds the state of the same rank of replica group 0 (not rank 0's, not a mix),
    each rank's all-reduce and all-gather ran with its counterpart only, and both replica groups
    committed round 3 together."""
    by = run_replica_groups({"run": "heal", "committed": [3, 0], "rounds": 1})
    first = {key: r["rounds"][0] for key, r in by.items()}
    assert all(r["ok"] and r["round_id"] == 3 and r["world"] == 2 for r in first.values()), by
    assert all(r["committed_after"] == 4 for r in first.values())
    assert [first[(1, r)]["healed"] for r in range(2)] == [True, True]
    assert [first[(0, r)]["healed"] for r in range(2)] == [False, False]
    for rank in range(2):
        # rank r of the behind replica group got rank r's shard of the state, nobody else's
        assert first[(1, rank)]["w"] == first[(0, rank)]["w"] == [10.0 * rank + 1.0] * 8
        for index in range(2):
            mine = first[(index, rank)]
            # the sum over the replica groups' rank r only: (1 + 2) * (rank + 1), never rank 0's
            # numbers
            assert mine["sums"] == pytest.approx([3.0 * (rank + 1)] * N)
            assert sorted(mine["gathered"]) == [f"group{s}-rank{rank}".encode() for s in range(2)]
            # the butterfly's bytes for a group of 2 (module formula 4 * ((N - e) + (2-1) * e)):
            # this rank's N elements, not the replica group's 2N
            assert sum(mine["shards"]) == N and mine["reduce_bytes"] == 4 * N, mine
    # four distinct peers: each rank its own link
    assert len({r["peer"] for r in by.values()}) == 4


def test_a_replica_group_alone_times_out_on_every_rank():
    """Rank 0 finds no group to join (the other replica group never comes): every rank of the
    replica group raises RoundTimeout saying so, none waits for its rank 0 forever."""
    by = run_replica_groups({"run": "alone", "committed": [0], "rounds": 1, "round_timeout": 2.0},
                            n_groups=1)
    errors = [by[(0, rank)]["rounds"][0] for rank in range(2)]
    assert [e.get("error") for e in errors] == ["RoundTimeout", "RoundTimeout"], errors
    assert "no group of at least 2 peers" in errors[0]["message"]
    assert errors[1]["message"].startswith("rank 0 of this replica group: no group of at least 2")


@pytest.mark.slow  # about 25-37 s: four hivemind peers of two replica groups
def test_a_replica_group_half_healed_sits_the_round_out_and_heals_whole_next_round():
    """Rank 1 of the behind replica group cannot heal in the first round (no state to load into)
    while its rank 0 can: the replica group votes no, so neither replica group commits, and rank 0
    keeps the replica group's old round count although it loaded round 3's state. In the second
    round the replica group is behind as a whole again, both ranks heal, and both replica groups
    commit round 3."""
    by = run_replica_groups({"run": "halfheal", "committed": [3, 0], "rounds": 2,
                             "stateless": [1, 1]})
    first = {key: r["rounds"][0] for key, r in by.items()}
    second = {key: r["rounds"][1] for key, r in by.items()}
    assert not any(r["ok"] for r in first.values()), first
    assert first[(1, 0)]["healed"] and not first[(1, 1)]["healed"]
    assert [first[(s, r)]["committed_after"] for s in range(2) for r in range(2)] == [3, 3, 0, 0]
    assert all(r["ok"] and r["round_id"] == 3 for r in second.values()), second
    assert [second[(1, r)]["healed"] for r in range(2)] == [True, True]
    assert all(r["committed_after"] == 4 for r in second.values())
    for rank in range(2):
        assert second[(1, rank)]["w"] == second[(0, rank)]["w"] == [10.0 * rank + 1.0] * 8


@pytest.mark.slow
def test_streaming_diloco_with_a_lossy_codec_and_a_robust_aggregator_across_hivemind_replica_groups(
        tmp_path, cache_dir):
    """Streaming DiLoCo's fragment rounds (in the background, overlapping training), int4 with
    error feedback and the median, each rank on its own shard: the replica groups still end on one
    model, and every rank's ledger accepted every update."""
    cfg, run = group_run(tmp_path, cache_dir, "stream", ranks_per_worker=2, steps=40,
                         algorithm="streaming_diloco", fragments=2, overlap_steps=2,
                         codec="int4+ef", aggregator="median")
    assert run.returncodes == [0, 0]
    states = run.summary["final_replicas"]["states"]
    assert run.summary["final_replicas"]["consistent"] and run.summary["widest_group"] == 2
    assert [s[0] for s in states.values()] == [8, 8], states  # 4 syncs x 2 fragments
    for name in sorted(p.name for p in (cfg.run_dir / "ledger").iterdir()):
        peers = json.loads((cfg.run_dir / "ledger" / name).read_text())["peers"]
        assert sorted(peers) == ["w0", "w1"], (name, peers)
        assert all(p["updates_rejected"] == 0 and p["updates_accepted"] > 0
                   for p in peers.values()), (name, peers)
