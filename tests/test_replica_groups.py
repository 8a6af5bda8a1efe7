"""Replica groups of several ranks: FSDP2 (Gloo, CPU) inside each replica group, DiLoCo across,
through torchft.

Real processes throughout: a torchft Lighthouse, each replica group a ``torchrun`` of 2 ranks that
shard a GPT with ``fully_shard``, and the same replicas run unsharded (one process per replica
group) for the comparison. The kill test SIGKILLs one rank of one replica group mid-run; torchrun
restarts that replica group, which resumes from its newest checkpoint while the other replica group
waits for it at its next round.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procfs import replica_group_ranks

pytest.importorskip("torchft")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_replica_groups.py"


def run_replica_groups(workdir: Path, *args: str, timeout: float = 400) -> tuple[list[dict], str]:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--workdir", str(workdir), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return sorted(results, key=lambda r: r["replica_group"]), proc.stdout


@pytest.mark.slow  # through farlink train: test_train_with_two_ranks_per_worker_matches_one_rank
def test_two_replica_groups_of_two_ranks_train_what_unsharded_replica_groups_train(tmp_path):
    steps = ["--replica-groups", "2", "--steps", "30", "--inner-steps", "10", "--batch", "8"]
    sharded, _ = run_replica_groups(tmp_path / "k2", *steps, "--ranks", "2")
    plain, _ = run_replica_groups(tmp_path / "k1", *steps, "--ranks", "1")
    assert [r["ranks"] for r in sharded] == [2, 2] and [r["ranks"] for r in plain] == [1, 1]
    # replicas identical across replica groups, shard by shard
    assert sharded[0]["fingerprints"] == sharded[1]["fingerprints"]
    assert len(set(sharded[0]["fingerprints"])) == 2  # two different shards
    assert plain[0]["fingerprints"] == plain[1]["fingerprints"]
    assert all(r["outer_steps"] == 3 for r in sharded + plain)
    # the same model from the same batches: FSDP2 over 2 ranks changes reduction order only
    heldout_k2, heldout_k1 = sharded[0]["heldout"], plain[0]["heldout"]
    assert abs(heldout_k2 - heldout_k1) <= 1e-4 * heldout_k1, (heldout_k2, heldout_k1)
    # each rank sends only its shard: a replica group moves what one unsharded replica moves
    group_k2 = sharded[0]["replica_group_bytes_sent"]
    group_k1 = plain[0]["replica_group_bytes_sent"]
    assert abs(group_k2 - group_k1) <= 1e-3 * group_k1, (group_k2, group_k1)


@pytest.mark.slow
def test_a_replica_group_whose_rank_is_sigkilled_restarts_and_rejoins(tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--workdir", str(workdir), "--replica-groups", "2",
         "--ranks", "2", "--steps", "60", "--inner-steps", "10", "--max-restarts", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # wait until replica group 1 has committed and checkpointed two rounds (both ranks' parts)
        deadline = time.time() + 240
        marker = workdir / "group1" / "step-0000020"
        while not marker.is_dir():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        victims = replica_group_ranks(proc.pid, b"--replica-group-worker", replica_group=1)
        assert len(victims) == 2, victims
        os.kill(max(victims), signal.SIGKILL)  # one rank of replica group 1, mid-run
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    results = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")),
                     key=lambda r: r["replica_group"])
    survivor, restarted = results
    # the survivor waited for the restarted replica group (min replicas 2, as a real run): every
    # round averaged both replica groups, so the run ends on exactly the model of a run nobody
    # interrupted
    straight = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workdir", str(tmp_path / "straight"),
         "--replica-groups", "2", "--ranks", "2", "--steps", "60", "--inner-steps", "10"],
        capture_output=True, text=True, timeout=400)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    uninterrupted = [json.loads(line) for line in straight.stdout.splitlines()
                     if line.startswith("{")]
    assert survivor["fingerprints"] == uninterrupted[0]["fingerprints"]
    assert restarted["restarts"] == 1 and survivor["restarts"] == 0
    # the restarted replica group resumed from a checkpoint every rank held, not from scratch
    assert restarted["resumed_at"] is not None and restarted["resumed_at"] >= 20
    # nothing committed was lost: every round of the run committed, both replica groups hold the
    # result
    assert survivor["outer_steps"] == restarted["outer_steps"] == 6
    assert survivor["fingerprints"] == restarted["fingerprints"]


# --- farlink train --ranks-per-worker: the launcher starts each worker as a torchrun replica group

GROUP_RUN = {"workers": 2, "steps": 30, "inner_steps": 10, "warmup_steps": 10, "batch_size": 8,
             "vocab_size": 512, "seq_len": 64, "eval_batches": 4, "join_timeout": 10,
             "heartbeat_timeout": 3}
# the default-suite comparisons: the nano GPT for two rounds (the replica groups' processes, not
# the model, are what these tests are about)
SMALL = {"model": "nano", "steps": 20, "eval_batches": 2}


def group_run(tmp_path: Path, cache_dir: Path, name: str,
              **overrides):  # noqa: ANN003, ANN201
    from farlink.config import load_config
    from farlink.train.launcher import launch

    cfg = load_config(None, {**GROUP_RUN, "run_dir": tmp_path / name, "cache_dir": cache_dir,
                             **overrides})
    return cfg, launch(cfg, show_progress=False)


@pytest.fixture(scope="module")
def one_rank_replica_groups(tmp_path_factory, cache_dir):  # noqa: ANN001, ANN201
    """The reference both sharding variants are compared with: the same run, one rank per replica
    group (trained once per module), its workers as threads of this process (launch_in_threads)."""
    from farlink.config import load_config
    from farlink.testing.runs import launch_in_threads

    cfg = load_config(None, {**GROUP_RUN, **SMALL, "cache_dir": cache_dir,
                             "run_dir": tmp_path_factory.mktemp("one-rank") / "k1"})
    return cfg, launch_in_threads(cfg)


@pytest.mark.torchft_threads  # the one-rank reference's workers are threads
def test_train_with_two_ranks_per_worker_matches_one_rank(tmp_path, cache_dir,
                                                          one_rank_replica_groups):
    from safetensors.torch import load_file

    cfg2, groups = group_run(tmp_path, cache_dir, "k2", ranks_per_worker=2, **SMALL)
    cfg1, plain = one_rank_replica_groups
    assert groups.returncodes == [0, 0] and plain.returncodes == [0, 0]
    s2, s1 = groups.summary, plain.summary
    assert s2["final_replicas"]["consistent"] and s2["widest_group"] == 2
    for run in (cfg2.run_dir, cfg1.run_dir):  # one metrics file per worker, not per rank
        assert sorted(p.name for p in (run / "metrics").iterdir()) == ["w0.jsonl", "w1.jsonl"]
    # one checkpoint per step for the whole replica group, each rank's part in it (DCP), all
    # digested
    steps = sorted((cfg2.run_dir / "checkpoints" / "w0").glob("step-*"))
    assert [p.name for p in steps] == ["step-0000010", "step-0000020"]
    for step in steps:
        meta = json.loads((step / "meta.json").read_text())
        assert meta["sharded"] and ".metadata" in meta["sha256"] and len(meta["sha256"]) >= 3
    loss2, loss1 = s2["final_heldout_loss"], s1["final_heldout_loss"]
    assert abs(loss2 - loss1) <= 1e-4 * loss1, (loss2, loss1)
    bytes2 = s2["per_worker"]["w0"]["bytes_sent"]  # both ranks' shards
    bytes1 = s1["per_worker"]["w0"]["bytes_sent"]
    assert abs(bytes2 - bytes1) <= 1e-3 * bytes1, (bytes2, bytes1)
    # the exported model is whole (gathered from the shards), with the unsharded names
    whole, sharded = load_file(str(cfg1.run_dir / "model.safetensors")), \
        load_file(str(cfg2.run_dir / "model.safetensors"))
    assert whole.keys() == sharded.keys()
    assert all(whole[k].shape == sharded[k].shape for k in whole)


@pytest.mark.torchft_threads  # the one-rank reference's workers are threads
def test_ddp_inside_replica_groups_matches_one_rank(tmp_path, cache_dir, one_rank_replica_groups):
    cfg, ddp = group_run(tmp_path, cache_dir, "ddp", ranks_per_worker=2, sharding="ddp",
                         **SMALL)
    cfg1, plain = one_rank_replica_groups
    assert ddp.returncodes == [0, 0] and plain.returncodes == [0, 0]
    s2, s1 = ddp.summary, plain.summary
    assert s2["final_replicas"]["consistent"] and s2["widest_group"] == 2
    # gradients averaged over the replica group's ranks: the same model from the same global batch
    loss2, loss1 = s2["final_heldout_loss"], s1["final_heldout_loss"]
    assert abs(loss2 - loss1) <= 1e-4 * loss1, (loss2, loss1)
    # each rank sends a 1/K slice: a replica group moves what one replica moves
    bytes2, bytes1 = s2["per_worker"]["w0"]["bytes_sent"], s1["per_worker"]["w0"]["bytes_sent"]
    assert abs(bytes2 - bytes1) <= 1e-3 * bytes1, (bytes2, bytes1)
    # every rank ends holding the whole replica: rank 1's slice reached rank 0's export
    from safetensors.torch import load_file

    whole, mine = load_file(str(cfg1.run_dir / "model.safetensors")), \
        load_file(str(cfg.run_dir / "model.safetensors"))
    assert max((whole[k] - mine[k]).abs().max().item() for k in whole) < 1e-3


@pytest.mark.slow
def test_ddp_across_replica_groups_of_two_ranks_matches_one_rank(tmp_path, cache_dir):
    """Every step, rank r of each replica group averages its shard of the gradient with rank r of
    the other replica group, then AdamW steps each shard: the replica groups train what unsharded
    ddp replicas do."""
    _, groups = group_run(tmp_path, cache_dir, "ddp2", ranks_per_worker=2, algorithm="ddp",
                          steps=20)
    _, plain = group_run(tmp_path, cache_dir, "ddp1", algorithm="ddp", steps=20)
    assert groups.returncodes == [0, 0] and plain.returncodes == [0, 0]
    s2, s1 = groups.summary, plain.summary
    assert s2["final_replicas"]["consistent"] and s2["widest_group"] == 2
    assert [step for step, _ in s2["final_replicas"]["states"].values()] == [20, 20]
    loss2, loss1 = s2["final_heldout_loss"], s1["final_heldout_loss"]
    assert abs(loss2 - loss1) <= 1e-4 * loss1, (loss2, loss1)
    bytes2, bytes1 = s2["per_worker"]["w0"]["bytes_sent"], s1["per_worker"]["w0"]["bytes_sent"]
    assert abs(bytes2 - bytes1) <= 1e-3 * bytes1, (bytes2, bytes1)


@pytest.mark.slow
def test_demo_across_replica_groups_of_two_ranks(tmp_path, cache_dir):
    """DeMo on each rank's shard: the replica groups end on one model and train; it is not the
    model of one-rank replicas, since a shard's DCT tiles differ from the whole tensor's where
    FSDP2's split is not a multiple of the chunk (see farlink.sync.demo)."""
    _, groups = group_run(tmp_path, cache_dir, "demo2", ranks_per_worker=2, algorithm="demo",
                          codec="dct_topk", steps=20)
    _, plain = group_run(tmp_path, cache_dir, "demo1", algorithm="demo", codec="dct_topk",
                         steps=20)
    assert groups.returncodes == [0, 0] and plain.returncodes == [0, 0]
    s2, s1 = groups.summary, plain.summary
    assert s2["final_replicas"]["consistent"] and s2["widest_group"] == 2
    assert [step for step, _ in s2["final_replicas"]["states"].values()] == [20, 20]
    metrics = (tmp_path / "demo2" / "metrics" / "w0.jsonl").read_text().splitlines()
    evals = [r["loss"] for r in map(json.loads, metrics) if r["kind"] == "eval"]
    assert len(evals) == 2 and evals[1] < evals[0]  # it trains
    # the sign steps nearly agree (measured: equal to 5 decimals), the tiles do not: a shard
    # tiled by 32 sends more chunks of k coefficients than the whole tensor tiled by 64
    loss2, loss1 = s2["final_heldout_loss"], s1["final_heldout_loss"]
    assert abs(loss2 - loss1) <= 1e-3 * loss1, (loss2, loss1)
    bytes2, bytes1 = s2["per_worker"]["w0"]["bytes_sent"], s1["per_worker"]["w0"]["bytes_sent"]
    assert bytes1 < bytes2 < 1.1 * bytes1, (bytes2, bytes1)


# each rank's MAC, codec and aggregator on its own shard: tests/test_replica_group_launch.py
# (test_replica_groups_with_a_secret_a_lossy_codec_and_a_robust_aggregator, on the torchrun
# replica groups that run the launcher's worker)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_a_replica_group_stopped_and_resumed_ends_bit_exact(tmp_path, cache_dir, sharding):
    _, straight = group_run(tmp_path, cache_dir, "straight", ranks_per_worker=2,
                            sharding=sharding)
    cfg, _ = group_run(tmp_path, cache_dir, "resumed", ranks_per_worker=2, sharding=sharding,
                       stop_at_step=15)
    from farlink.train.launcher import launch

    resumed = launch(cfg.model_copy(update={"resume": True, "stop_at_step": None}),
                     show_progress=False)
    assert resumed.returncodes == [0, 0]
    assert (resumed.summary["final_replicas"]["states"]
            == straight.summary["final_replicas"]["states"])


def test_ranks_per_worker_refuses_what_cannot_run_on_shards():
    from farlink.config import RunConfig

    with pytest.raises(ValueError, match="cannot take its islands from the emulated WAN "
                       r"\(--topology\).*Give the islands with --islands"):
        RunConfig(algorithm="hierarchical_diloco", ranks_per_worker=2, topology="0,1|2,3")
    # forced (or measured) islands run on replica groups: tests/test_replica_group_hierarchical.py
    RunConfig(algorithm="hierarchical_diloco", ranks_per_worker=2, islands="0,1|2,3")
    with pytest.raises(ValueError, match="demo on replica groups of several ranks runs on FSDP2"):
        RunConfig(algorithm="demo", codec="dct_topk", ranks_per_worker=2, sharding="ddp")
    with pytest.raises(ValueError, match="runs on the torchft backend .* or on hivemind"):
        RunConfig(backend="inprocess", ranks_per_worker=2)
    # hivemind runs replica groups: each one member of every averaging group
    assert RunConfig(backend="hivemind", workers=2, ranks_per_worker=2).ranks_per_worker == 2
    with pytest.raises(ValueError, match="batch_size=9 does not split"):
        RunConfig(batch_size=9, ranks_per_worker=2)
    with pytest.raises(ValueError, match="use --sharding fsdp"):
        RunConfig(algorithm="streaming_diloco", ranks_per_worker=2, sharding="ddp")
    with pytest.raises(ValueError, match="run the replica groups with --sharding fsdp"):
        RunConfig(algorithm="ddp", ranks_per_worker=2, sharding="ddp")
    with pytest.raises(ValueError, match="give --device cuda"):
        RunConfig(device="cuda:1", ranks_per_worker=2)


@pytest.mark.slow
def test_bench_replica_groups_reports_per_rank_throughput_and_load(tmp_path, cache_dir):
    from farlink.bench.replica_groups import run

    result = run(tmp_path, steps=20, model="tiny", ranks=2, batch_size=4, cache_dir=cache_dir)
    saved = json.loads((tmp_path / "replica_groups.json").read_text())
    assert [r["config"] for r in saved["rows"]] == [
        "plain torch", "farlink, 1 rank", "farlink, 2 ranks fsdp", "farlink, 2 ranks ddp"]
    for row in saved["rows"]:
        assert row["replica_group_tokens_per_s"] > 0 and row["load_before"] >= 0
        assert row["tokens_per_s_per_rank"] == pytest.approx(
            row["replica_group_tokens_per_s"] / row["ranks"], abs=0.1)
    assert saved["rows"][1]["per_rank_vs_one_rank"] == 1.0
    assert set(result["median_per_rank_vs_one_rank"]) == {"farlink, 2 ranks ddp",
                                                          "farlink, 2 ranks fsdp"}
    assert (tmp_path / "replica_groups.png").is_file()


def test_bench_sites_is_still_the_replica_groups_benchmark() -> None:
    """``farlink bench sites`` (its name before "replica group") runs the same command."""
    from typer.testing import CliRunner

    from farlink.cli import app

    helps = [CliRunner().invoke(app, ["bench", name, "--help"], env={"COLUMNS": "200"})
             for name in ("replica-groups", "sites")]
    assert [h.exit_code for h in helps] == [0, 0], [h.output for h in helps]
    assert "Tokens/s per rank of a replica group" in helps[0].output
    options = [[line for line in h.output.splitlines() if "Usage:" not in line] for h in helps]
    assert options[0] == options[1]
