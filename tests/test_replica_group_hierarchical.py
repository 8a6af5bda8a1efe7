"""Hierarchical DiLoCo across replica groups of several ranks: the replica groups are real
processes.

Three workers, each a ``torchrun`` replica group of 2 ranks (FSDP2 over Gloo on CPU), in the forced
islands ``0,1|2``: an island Lighthouse per island and the main one for the leaders (replica groups
0 and 2). Every rank holds an island Manager (its replica group is the torchft replica group) and,
on a leader replica group, a global one, so rank r exchanges only its own shard with rank r of the
other replica groups on both tiers and receives its shard of the hand-off. The same run with one
rank per worker (its workers as threads) is the reference. Slow ones: ``--overlap-global``,
time-budgeted rounds, and a member replica group SIGKILLed mid-run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytest.importorskip("torchft")

RUN = {"model": "nano",
       "workers": 3, "algorithm": "hierarchical_diloco", "islands": "0,1|2", "steps": 20,
       "inner_steps": 10, "island_steps": 5, "warmup_steps": 5, "batch_size": 8,
       "vocab_size": 512, "seq_len": 64, "eval_batches": 4, "join_timeout": 10,
       "heartbeat_timeout": 3}
# the comparison with one-rank replica groups: smaller batches of shorter sequences, fewer held-out
# batches (the rounds, the islands and the bytes, set by the model's size, stay as they are)
LIGHT = {"batch_size": 4, "seq_len": 32, "eval_batches": 2}


def hier_run(tmp_path: Path, cache_dir: Path, name: str, **overrides):  # noqa: ANN003, ANN201
    from farlink.config import load_config
    from farlink.train.launcher import launch

    cfg = load_config(None, {**RUN, "run_dir": tmp_path / name, "cache_dir": cache_dir,
                             **overrides})
    return cfg, launch(cfg, show_progress=False)


def finals(run_dir: Path) -> list[dict]:
    return [load_file(str(p)) for p in sorted((run_dir / "final").glob("w*.safetensors"))]


def end_records(run_dir: Path) -> dict[str, dict]:
    """Each worker's last end record (a worker killed before its end has none)."""
    out = {}
    for path in sorted((run_dir / "metrics").glob("w*.jsonl")):
        ends = [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "end"]
        if ends:
            out[path.stem] = ends[-1]
    return out


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory, cache_dir):  # noqa: ANN001, ANN201
    """The reference: the same runs with one rank per worker (made once per overlap mode), its
    workers as threads of this process (launch_in_threads; the replica groups are processes)."""
    from farlink.config import load_config
    from farlink.testing.runs import launch_in_threads

    made: dict[bool, dict] = {}

    def run(overlap: bool) -> dict:
        if overlap not in made:
            tmp = tmp_path_factory.mktemp("one-rank")
            result = launch_in_threads(load_config(None, {
                **RUN, **LIGHT, "run_dir": tmp / "k1", "cache_dir": cache_dir,
                "overlap_global": overlap}))
            assert result.returncodes == [0, 0, 0]
            made[overlap] = result.summary
        return made[overlap]

    return run


@pytest.mark.torchft_threads  # the one-rank reference's workers are threads
@pytest.mark.parametrize("sharding,overlap", [
    ("fsdp", False), pytest.param("ddp", False, marks=pytest.mark.slow),
    pytest.param("fsdp", True, marks=pytest.mark.slow)], ids=["fsdp", "ddp", "fsdp-overlapped"])
def test_replica_groups_of_two_ranks_in_islands_train_what_one_rank_replica_groups_train(
        tmp_path, cache_dir, one_rank_runs, sharding, overlap):
    cfg2, groups = hier_run(tmp_path, cache_dir, "k2", ranks_per_worker=2, sharding=sharding,
                            overlap_global=overlap, **LIGHT)
    assert groups.returncodes == [0, 0, 0]
    s2, s1 = groups.summary, one_rank_runs(overlap)
    assert s2["network"]["islands"] == [[0, 1], [2]] and s2["network"]["source"] == "forced"
    # every replica group ends on the same state, shard by shard (the fingerprint covers every
    # rank's)
    ends = end_records(cfg2.run_dir)
    assert len(ends) == 3, ends
    assert all(e["finished"] and e["outer_step"] == 2 for e in ends.values()), ends
    assert len({e["fingerprint"] for e in ends.values()}) == 1, ends
    assert s2["final_replicas"]["consistent"]
    # each gathered from its replica group's shards (fsdp), rank 0's (ddp)
    whole = finals(cfg2.run_dir)
    assert len(whole) == 3
    assert all((f[k] == whole[0][k]).all() for f in whole[1:] for k in whole[0])
    # the same model from the same global batches: the replica group changes reduction order only
    # (ddp: rank 0's whole replica holds the slices rank 1 averaged in every island round)
    loss2, loss1 = s2["final_heldout_loss"], s1["final_heldout_loss"]
    assert abs(loss2 - loss1) <= 1e-4 * loss1, (loss2, loss1)
    # only the leader replica groups crossed islands, each with what one unsharded leader sends
    per2, per1 = s2["per_worker"], s1["per_worker"]
    assert per2["w1"]["inter_bytes"] == 0 and per2["w1"]["intra_bytes"] > 0
    for leader in ("w0", "w2"):
        k2, k1 = per2[leader]["inter_bytes"], per1[leader]["inter_bytes"]
        assert k1 > 0 and abs(k2 - k1) <= 1e-3 * k1, (leader, k2, k1)
    # and the island tier: a replica group's ranks together move what one unsharded member moves
    k2, k1 = per2["w1"]["intra_bytes"], per1["w1"]["intra_bytes"]
    assert abs(k2 - k1) <= 1e-3 * k1, (k2, k1)


@pytest.mark.slow
def test_time_budgeted_islands_of_replica_groups_end_on_one_model(tmp_path, cache_dir):
    """Island and global rounds on deadlines: the ranks of each replica group settle every round's
    end together (each reads its own clock), and the replica groups end on one model."""
    cfg, run = hier_run(tmp_path, cache_dir, "timed", ranks_per_worker=2, steps=30,
                        round_seconds=4.0, island_seconds=2.0)
    assert run.returncodes == [0, 0, 0]
    ends = end_records(cfg.run_dir)
    assert len(ends) == 3, ends
    assert all(e["finished"] and e["outer_step"] == 3 for e in ends.values()), ends
    assert len({e["fingerprint"] for e in ends.values()}) == 1, ends
    whole = finals(cfg.run_dir)
    assert len(whole) == 3
    assert all((f[k] == whole[0][k]).all() for f in whole[1:] for k in whole[0])


@pytest.mark.slow
def test_a_member_replica_group_sigkilled_mid_run_leaves_the_others_on_one_model(
        tmp_path, cache_dir):
    """One rank of the member replica group w1 is SIGKILLed after the first global round: torchrun
    ends that replica group, its island's next quorum leaves it out (the leader replica group goes
    on alone in it), and the two surviving replica groups (one per island) commit every later
    global round together and end on one model: nothing committed is lost, no round is applied by
    one replica group and not the other."""
    import os
    import signal
    import threading
    import time

    from procfs import replica_group_ranks

    from farlink.bench.churn import committed_outer_steps
    from farlink.config import load_config
    from farlink.train.launcher import launch
    from farlink.train.metrics import read_metrics

    cfg = load_config(None, {**RUN, "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                             "ranks_per_worker": 2, "steps": 60, "pace_seconds": 0.1,
                             "round_timeout": 10, "quorum_timeout": 30})
    outcome: dict = {}
    launcher = threading.Thread(target=lambda: outcome.update(
        result=launch(cfg, show_progress=False)), daemon=True)
    launcher.start()
    deadline = time.time() + 300
    while committed_outer_steps(cfg.run_dir) < 1:
        assert time.time() < deadline and launcher.is_alive(), "no global round committed"
        time.sleep(0.2)
    victims = replica_group_ranks(os.getpid(), b"farlink.worker", replica_group=1)
    assert len(victims) == 2, victims
    os.kill(max(victims), signal.SIGKILL)
    launcher.join(timeout=400)
    assert not launcher.is_alive(), "the run did not end"
    result = outcome["result"]
    assert result.returncodes[0] == 0 and result.returncodes[2] == 0, result.returncodes
    assert result.returncodes[1] != 0, result.returncodes
    syncs = {w: [r for r in read_metrics(cfg.run_dir / "metrics" / f"{w}.jsonl")
                 if r["kind"] == "sync" and r["committed"]] for w in ("w0", "w2")}
    for w, records in syncs.items():  # every global round, in order, each committed once
        assert [r["outer_step"] for r in records] == list(range(1, 7)), (w, records)
    for mine, theirs in zip(syncs["w0"], syncs["w2"]):
        assert mine["fingerprint"] == theirs["fingerprint"]
    ends = end_records(cfg.run_dir)
    assert sorted(ends) == ["w0", "w2"], ends
    assert ends["w0"]["fingerprint"] == ends["w2"]["fingerprint"], ends
    assert ends["w0"]["finished"] and ends["w2"]["finished"], ends
    whole = {p.stem: load_file(str(p)) for p in (cfg.run_dir / "final").glob("w*.safetensors")}
    assert sorted(whole) == ["w0", "w2"]
    assert all((whole["w0"][k] == whole["w2"][k]).all() for k in whole["w0"])
