"""Replica groups started by a standard launcher: ``torchrun -m farlink.worker`` with torchft's
variables.

Real processes: a torchft Lighthouse, and two replica groups, each a real ``torchrun`` of 2 ranks
(replica group 0 plain torchrun, replica group 1 through ``farlink.parallel.replica_group_agent``,
which binds its store) with its own run dir (as two nodes would have), told the Lighthouse and
their replica group only through ``TORCHFT_LIGHTHOUSE`` and ``REPLICA_GROUP_ID``. The two-node
recipe of docs/guides/gpus.md is this command. The recipe runs once, with a run secret, int4 with
error feedback and the median (the worker ``farlink train --ranks-per-worker 2`` starts, so its
replica groups' trust is checked on the same run), and two tests read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

RUN_FLAGS = ["--model", "nano",
             "--workers", "2", "--steps", "30", "--inner-steps", "10", "--warmup-steps", "10",
             "--batch-size", "8", "--vocab-size", "512", "--seq-len", "64",
             "--eval-batches", "4"]


def replica_group_command(run_dir: Path, cache_dir: Path, *extra: str,
                          bound: bool = False) -> list[str]:
    """The recipe of docs/guides/gpus.md: plain torchrun, or (``bound``) farlink's replica group
    agent, which is torchrun with the replica group's store on ``--host`` only."""
    launcher = (["-m", "farlink.parallel.replica_group_agent", "--host", "127.0.0.1"] if bound
                else ["-m", "torch.distributed.run", "--standalone"])
    return [sys.executable, *launcher, "--nproc-per-node", "2", "-m", "farlink.worker",
            "--run-dir", str(run_dir), "--cache-dir", str(cache_dir), *RUN_FLAGS, *extra]


def records(path: Path, kind: str) -> list[dict]:
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def start_replica_groups(tmp_path: Path, cache_dir: Path, lighthouse: str,
                         flags_of=lambda index: [],  # noqa: ANN001
                         extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    groups = []
    for index in range(2):
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "REPLICA_GROUP_ID": str(index),
               "OMP_NUM_THREADS": "1", **(extra_env or {})}
        log = open(tmp_path / f"group{index}.log", "wb")
        argv = replica_group_command(tmp_path / f"group{index}", cache_dir, *flags_of(index),
                                     bound=index == 1)  # both launchers of the recipe
        groups.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    return groups


def wait_all(tmp_path: Path, groups: list[subprocess.Popen], timeout: float = 300) -> None:
    try:
        for index, proc in enumerate(groups):
            code = proc.wait(timeout=timeout)
            log = (tmp_path / f"group{index}.log").read_text()[-4000:]
            assert code == 0, f"replica group {index} exited {code}:\n{log}"
    finally:
        for proc in groups:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


#: each rank MACs, compresses and aggregates its own shard (the launcher's workers take the secret
#: from the same variable)
TRUST_FLAGS = ["--auth", "secret", "--codec", "int4+ef", "--aggregator", "median"]
RUN_SECRET = "the-run-secret"


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory, cache_dir):  # noqa: ANN001, ANN201
    """The recipe, run once: its directory (a run dir per replica group) and the Lighthouse's
    address (gated by the run secret, as ``farlink train --auth secret`` gates its own)."""
    from farlink.data import prepare_data
    from farlink.robust.auth import SECRET_ENV, make_authenticator
    from farlink.train.lighthouse import Lighthouse

    tmp_path = tmp_path_factory.mktemp("recipe")
    prepare_data("kjv", 512, cache_dir)  # the tokenizer once, not by four ranks at a time
    gate = make_authenticator("secret", secret=RUN_SECRET, peer_id="lighthouse-gate")
    lighthouse = Lighthouse(min_replicas=2, join_timeout=10, heartbeat_timeout=3,
                            log_path=tmp_path / "lighthouse.log", authenticator=gate).start()
    try:
        wait_all(tmp_path, start_replica_groups(tmp_path, cache_dir, lighthouse.address,
                                                lambda index: TRUST_FLAGS,
                                                extra_env={SECRET_ENV: RUN_SECRET}))
    finally:
        lighthouse.stop()
    return tmp_path, lighthouse.address


def test_two_torchrun_replica_groups_train_one_model_from_torchft_variables(recipe_run):
    tmp_path, address = recipe_run
    ends = [records(tmp_path / f"group{i}" / "metrics" / f"w{i}.jsonl", "end")[-1]
            for i in range(2)]
    assert all(e["finished"] and e["outer_step"] == 3 for e in ends), ends
    # every round averaged both replica groups
    assert all(e["widest_group"] == 2 for e in ends), ends
    # one model, held by both replica groups
    assert ends[0]["fingerprint"] == ends[1]["fingerprint"]
    for index in range(2):
        run = tmp_path / f"group{index}"
        saved = json.loads((run / "config.json").read_text())
        assert saved["ranks_per_worker"] == 2  # from WORLD_SIZE, not repeated as a flag
        assert saved["lighthouse"] == address  # from TORCHFT_LIGHTHOUSE
        # one metrics file per replica group, one checkpoint per step (the ranks' parts), ledgers
        # by rank
        assert [p.name for p in (run / "metrics").iterdir()] == [f"w{index}.jsonl"]
        assert (run / "checkpoints" / f"w{index}" / "step-0000030" / ".metadata").is_file()
        assert sorted(p.name for p in (run / "ledger").iterdir()) == \
            [f"w{index}.json", f"w{index}.rank1.json"]
        assert (run / "tokenizer.json").is_file()  # rank 0 wrote the run's shared files
        assert (run / "final" / f"w{index}.safetensors").is_file()


def test_replica_groups_with_a_secret_a_lossy_codec_and_a_robust_aggregator(recipe_run):
    """Each rank MACs, compresses (int4 with error feedback) and aggregates (median) its own shard;
    the replica groups still end on one model, and every rank's ledger accepted every update."""
    tmp_path, _ = recipe_run  # both replica groups exited 0 (the fixture checks)
    ends = [records(tmp_path / f"group{i}" / "metrics" / f"w{i}.jsonl", "end")[-1]
            for i in range(2)]
    assert all(e["widest_group"] == 2 for e in ends), ends
    assert ends[0]["fingerprint"] == ends[1]["fingerprint"], ends  # one model
    for index in range(2):  # one ledger per rank, each listing both replica groups
        saved = json.loads((tmp_path / f"group{index}" / "config.json").read_text())
        assert (saved["auth"], saved["codec"], saved["aggregator"]) == \
            ("secret", "int4+ef", "median"), saved
        for name in (f"w{index}.json", f"w{index}.rank1.json"):
            peers = json.loads((tmp_path / f"group{index}" / "ledger" / name).read_text())["peers"]
            assert sorted(peers) == ["w0", "w1"], (name, peers)
            assert all(p["updates_accepted"] == 3 and p["updates_rejected"] == 0
                       for p in peers.values()), (name, peers)


@pytest.mark.slow  # the torchrun replica groups above run by default; this adds keys and trimming
def test_replica_groups_signing_with_their_own_ed25519_keys_and_trimming(tmp_path, cache_dir):
    """Each replica group signs with its own key (every rank of a replica group with the replica
    group's key); every rank checks the other replica group's signature on its shard and aggregates
    with a trimmed mean."""
    from farlink.data import prepare_data
    from farlink.robust.auth import make_authenticator
    from farlink.robust.keys import generate_keypair, load_allowed_keys
    from farlink.train.lighthouse import Lighthouse

    members = tmp_path / "members"
    keys = [members / f"group{i}.key" for i in range(2)]
    for key in keys:
        generate_keypair(key)
    ids = sorted(load_allowed_keys(members))
    prepare_data("kjv", 512, cache_dir)
    gate = make_authenticator("ed25519", allowed_keys=members, peer_id="lighthouse-gate")
    lighthouse = Lighthouse(min_replicas=2, join_timeout=10, heartbeat_timeout=3,
                            log_path=tmp_path / "lighthouse.log", authenticator=gate).start()
    try:
        def flags(index: int) -> list[str]:
            return ["--steps", "20", "--auth", "ed25519", "--key-file", str(keys[index]),
                    "--allowed-keys", str(members), "--aggregator", "trimmed_mean"]

        wait_all(tmp_path, start_replica_groups(tmp_path, cache_dir, lighthouse.address, flags))
    finally:
        lighthouse.stop()
    ends = [records(tmp_path / f"group{i}" / "metrics" / f"w{i}.jsonl", "end")[-1]
            for i in range(2)]
    assert all(e["finished"] and e["outer_step"] == 2 for e in ends), ends
    assert ends[0]["fingerprint"] == ends[1]["fingerprint"]
    for index in range(2):
        for name in (f"w{index}.json", f"w{index}.rank1.json"):
            ledger = tmp_path / f"group{index}" / "ledger" / name
            peers = json.loads(ledger.read_text())["peers"]
            assert sorted(peers) == ids, (name, peers)  # named by their keys
            assert all(p["updates_accepted"] == 2 and p["updates_rejected"] == 0
                       for p in peers.values()), (name, peers)


def test_a_replica_group_without_its_variables_is_told_what_to_set(tmp_path):
    """The refusals are the command's messages: ``farlink worker`` (``python -m farlink.worker``
    given flags only, the same command) runs in this process; the launched replica groups above
    run the module itself."""
    from typer.testing import CliRunner

    from farlink.cli import app

    unset = {"REPLICA_GROUP_ID": None, "TORCHFT_LIGHTHOUSE": None}
    args = ["worker", "--run-dir", str(tmp_path / "r")]
    run = CliRunner().invoke(app, args, env=unset)
    assert run.exit_code == 2 and "REPLICA_GROUP_ID" in run.stderr, run.output
    run = CliRunner().invoke(app, args, env={**unset, "REPLICA_GROUP_ID": "1"})
    assert run.exit_code == 2 and "TORCHFT_LIGHTHOUSE" in run.stderr, run.output
    run = CliRunner().invoke(app, ["worker", "--index", "0", *args[1:]],
                             env={"REPLICA_GROUP_ID": "1", "TORCHFT_LIGHTHOUSE": "http://h:1"})
    assert run.exit_code == 2 and "--index 0 but REPLICA_GROUP_ID=1" in run.stderr, run.output
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_the_launchers_worker_takes_the_lighthouse_from_torchft_lighthouse(tmp_path, capsys,
                                                                           monkeypatch):
    """``python -m farlink.worker RUN_DIR INDEX`` (the launcher's form) as its ``main`` reads
    it, in this process."""
    from farlink.worker import main

    argv = [str(tmp_path / "none"), "0"]
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(SystemExit) as without:
        main(argv)
    err = capsys.readouterr().err
    assert without.value.code == 2 and "--lighthouse" in err, err
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    # past the arguments: it went on to read the run dir's config (absent here)
    with pytest.raises(FileNotFoundError, match="config.json"):
        main(argv)
    assert "--lighthouse" not in capsys.readouterr().err


def test_only_a_replica_groups_rank_0_writes_the_run_dirs_shared_files(tmp_path, cache_dir):
    from farlink.config import load_config
    from farlink.worker import prepare_run_dir

    cfg = load_config(None, {"run_dir": tmp_path / "run", "cache_dir": cache_dir,
                             "vocab_size": 512, "lighthouse": "http://127.0.0.1:1",
                             "ranks_per_worker": 2})
    prepare_run_dir(cfg, rank=1)
    assert not (tmp_path / "run").exists()
    prepare_run_dir(cfg, rank=0)
    assert {"config.json", "config.toml", "tokenizer.json"} <= \
        {p.name for p in (tmp_path / "run").iterdir()}
    before = (tmp_path / "run" / "config.json").stat().st_mtime_ns
    prepare_run_dir(cfg, rank=0)  # a restarted rank 0 keeps the run's config as it is
    assert (tmp_path / "run" / "config.json").stat().st_mtime_ns == before
