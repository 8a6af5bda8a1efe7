"""Community mode as volunteers live it: ``farlink swarm start --config run.toml`` serves a run,
volunteers with nothing in common but the bootstrap peer's address join with the printed command,
train the run together on shards of their own and end on one state; a restarted volunteer resumes
from its own run dir; a peer without the run secret, or pinned to another digest, is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from swarm_output import stop

from farlink.swarm.definition import digest_of, make_definition
from farlink.comm.swarm_shards import owners, preference
from farlink.train.metrics import read_metrics

SECRET = "volunteer-secret-7f3a9c"
RUN = """[train]
vocab_size = 512
seq_len = 64
batch_size = 4
eval_batches = 2
workers = 2
steps = 60
inner_steps = 10
warmup_steps = 5
auth = "secret"
quorum_timeout = 300
"""


def farlink(*args: str, secret: str | None = SECRET) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "FARLINK_SECRET"}
    if secret is not None:
        env["FARLINK_SECRET"] = secret
    return subprocess.Popen([sys.executable, "-m", "farlink.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def read_join_command(proc: subprocess.Popen, timeout: float = 300) -> list[str]:
    """The arguments of the ``farlink swarm join ...`` line the bootstrap peer prints."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline().strip()
        if line.startswith("farlink swarm join "):
            return line.split()[1:]
        if proc.poll() is not None:
            break
    raise AssertionError(f"no join command printed; stderr: {proc.stderr.read()}")


def metrics_of(run_dir: Path) -> list[dict]:
    return [r for path in sorted((run_dir / "metrics").glob("w*.jsonl"))
            for r in read_metrics(path)]


def wait_for(predicate, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow  # a bootstrap peer, two training volunteers, a restart: minutes on 2 cores
def test_volunteers_train_one_run_resume_and_outsiders_are_refused(tmp_path: Path,
                                                                    cache_dir: Path) -> None:
    (tmp_path / "run.toml").write_text(RUN)
    boot = farlink("swarm", "start", "--config", str(tmp_path / "run.toml"), "--run-dir",
                   str(tmp_path / "boot"), "--cache-dir", str(cache_dir))
    volunteers: dict[str, subprocess.Popen] = {}
    outsiders: list[subprocess.Popen] = []
    try:
        command = read_join_command(boot)
        assert command[:4] == ["swarm", "join", "--initial-peers", command[3]]
        assert "--auth" in command and SECRET not in " ".join(command)
        printed_digest = command[command.index("--digest") + 1]

        def volunteer(name: str) -> subprocess.Popen:  # own run dir, own cache: nothing shared
            return farlink(*command, "--run-dir", str(tmp_path / name), "--cache-dir",
                           str(tmp_path / f"cache-{name}"))

        volunteers = {name: volunteer(name) for name in ("a", "b")}
        # while they train: a peer without the secret, one with a wrong one, one pinned to
        # another run's digest
        no_secret = [a for a in command if a not in ("--auth", "secret")]
        outsiders = [
            farlink(*no_secret, "--run-dir", str(tmp_path / "o1"), secret=None),
            farlink(*command, "--run-dir", str(tmp_path / "o2"), secret="guessed"),
            farlink(*[("0" * 64 if a == printed_digest else a) for a in command], "--run-dir",
                    str(tmp_path / "o3")),
        ]
        results = [p.communicate(timeout=300) for p in outsiders]
        (_, err1), (_, err2), (_, err3) = results
        assert outsiders[0].returncode == 3, err1
        assert "members only" in err1 and "--auth secret" in err1 and "FARLINK_SECRET" in err1
        assert outsiders[1].returncode == 3, err2
        assert "wrong run secret" in err2
        assert outsiders[2].returncode == 2, err3
        assert "another run" in err3
        assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
        assert not (tmp_path / "o3").exists()

        # volunteer a leaves (Ctrl-C) after a committed round, and comes back with the same dir
        a_dir = tmp_path / "a"
        wait_for(lambda: any(r["kind"] == "sync" and r["committed"] and r["step"] >= 20
                             for r in metrics_of(a_dir)), "a committed round of volunteer a")
        shard_before = json.loads((a_dir / "swarm.json").read_text())["shard"]
        volunteers["a"].send_signal(signal.SIGINT)
        out, err = volunteers["a"].communicate(timeout=120)
        assert volunteers["a"].returncode == 0, err[-3000:]
        volunteers["a"] = volunteer("a")
        outputs = {}
        for name, proc in volunteers.items():
            outputs[name] = proc.communicate(timeout=600)
            assert proc.returncode == 0, (name, outputs[name][0], outputs[name][1][-3000:])
        assert "resuming its checkpoints" in outputs["a"][0], outputs["a"]
    finally:
        for proc in [*volunteers.values(), *outsiders]:
            stop(proc)
        stop(boot)

    a_records, b_records = metrics_of(tmp_path / "a"), metrics_of(tmp_path / "b")
    shards = {json.loads((tmp_path / n / "swarm.json").read_text())["shard"] for n in "ab"}
    assert shards == {0, 1}  # two volunteers, two different shards of the corpus
    assert json.loads((tmp_path / "a" / "swarm.json").read_text())["shard"] == shard_before
    resumes = [r for r in a_records if r["kind"] == "resume"]
    assert resumes and resumes[-1]["path"] is not None and resumes[-1]["outer_step"] >= 2
    ends = {name: [r for r in records if r["kind"] == "end"][-1]
            for name, records in (("a", a_records), ("b", b_records))}
    assert ends["a"]["finished"] and ends["b"]["finished"], ends
    assert ends["a"]["fingerprint"] == ends["b"]["fingerprint"], ends
    assert ends["a"]["outer_step"] == ends["b"]["outer_step"] == 6
    committed = [r for r in a_records + b_records if r["kind"] == "sync" and r["committed"]]
    assert committed and all(r["world_size"] == 2 for r in committed)

    # what was served: the definition the printed digest names, without the secret
    served = (tmp_path / "a" / "definition.json").read_bytes()
    assert digest_of(served) == printed_digest
    assert (tmp_path / "b" / "definition.json").read_bytes() == served
    body = json.loads(served)
    assert body["config"]["auth"] == "secret"
    assert "secret" not in body["config"] and "secret_file" not in body["config"]
    for name in ("boot", "a", "b"):
        for path in (tmp_path / name).rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), path


def test_definition_holds_no_secret_and_no_paths_of_the_starting_machine(
        tmp_path: Path, cache_dir: Path) -> None:
    from farlink.config import load_config
    from farlink.data import prepare_data

    cfg = load_config(None, {"vocab_size": 512, "workers": 2, "backend": "hivemind",
                             "auth": "secret", "secret": SECRET, "run_dir": tmp_path / "run",
                             "cache_dir": cache_dir, "log_to": "tensorboard"})
    data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    blob = make_definition(cfg, data)
    assert SECRET.encode() not in blob
    body = json.loads(blob)
    for field in ("secret", "secret_file", "run_dir", "cache_dir", "key_file", "host", "log_to"):
        assert field not in body["config"], field
    # where the organizer's metrics go is its machine's: volunteers choose their own --log-to
    assert make_definition(cfg.model_copy(update={"log_to": ""}), data) == blob
    assert str(tmp_path).encode() not in blob and str(cache_dir).encode() not in blob
    assert body["config"]["workers"] == 2 and body["data"]["train_tokens"] == len(data.train)
    assert make_definition(cfg, data) == blob  # one run, one digest
    other = make_definition(cfg.model_copy(update={"seed": 1}), data)
    assert digest_of(other) != digest_of(blob)


def test_shard_preference_and_ownership() -> None:
    order = preference("peerA", 3, 5)
    assert sorted(order) == list(range(5))
    assert preference("peerA", 3, 5) == order  # derived, never drawn at random
    assert preference("peerA", 3, 5, previous=order[2])[0] == order[2]  # a restart keeps it
    starts = {preference(f"peer{i}", 0, 8)[0] for i in range(40)}
    assert len(starts) > 4  # identities spread over the shards
    assert {preference("peerA", r, 97)[0] for r in range(10)} != {order[0]}  # and join rounds
    # the oldest claim holds a shard; a tie goes to the smaller peer id
    claims = {"p2": (1, 10.0, 0), "p1": (1, 12.0, 0), "p3": (0, 5.0, 4), "p0": (0, 5.0, 4)}
    assert owners(claims) == {1: "p2", 0: "p0"}


def test_shard_claims_in_a_real_dht_are_distinct_full_and_freed_when_a_volunteer_leaves(
        tmp_path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from farlink.comm.hivemind_net import dht_options, identity_key, start_dht, tcp_maddr
    from farlink.comm.swarm_shards import ShardClaim, SwarmFull

    keys = [str(tmp_path / f"identity{i}.key") for i in range(3)]
    first = start_dht([], **dht_options([tcp_maddr("127.0.0.1")], identity_path=keys[0]))
    dhts = [first]
    try:
        peers = [str(m) for m in first.get_visible_maddrs()]
        dhts += [start_dht(peers, **dht_options([tcp_maddr("127.0.0.1")], identity_path=key))
                 for key in keys[1:]]
        claims = [ShardClaim(d, "run_shards", 2, identity_key(key), ttl=8.0, settle=1.5)
                  for d, key in zip(dhts, keys)]
        with ThreadPoolExecutor(2) as pool:  # two volunteers claim at the same moment
            taken = list(pool.map(lambda c: c.acquire(), claims[:2]))
        assert sorted(taken) == [0, 1], taken
        # each holder counts the live volunteers (the swarm's size) by its next refresh
        wait_for(lambda: claims[0].live == claims[1].live == 2, "both holders counting 2", 10)
        with pytest.raises(SwarmFull, match="room for 2"):
            claims[2].acquire()
        claims[0].release()  # the first volunteer leaves: its claim is no longer refreshed
        # its claim expires (within the 8 s TTL): the one holder left counts itself at its next
        # refresh (every TTL / 3)
        wait_for(lambda: claims[1].live == 1, "the holder left counting 1", 20)
        assert claims[2].acquire() == taken[0]  # and its shard is picked up
        assert claims[1].shard == taken[1]
        assert claims[2].live == 2
    finally:
        for claim in locals().get("claims", []):
            claim.release()
        for dht in dhts:
            dht.shutdown()


def test_a_taken_over_shard_continues_at_its_last_holders_committed_position(tmp_path) -> None:
    """Real DHTs: a volunteer trains its shard, commits a round after 7 batches and draws 2
    more, then leaves. The newcomer that claims the freed shard draws the 8th batch next: the
    7 committed batches are not trained again, the 2 uncommitted ones (lost with their holder)
    are."""
    import numpy as np

    from farlink.comm.hivemind_net import dht_options, identity_key, start_dht, tcp_maddr
    from farlink.comm.swarm_shards import ShardClaim
    from farlink.data import ShardSampler

    tokens = np.arange(4000, dtype=np.int64) % 500

    def sampler() -> ShardSampler:
        return ShardSampler(tokens, shard=0, num_shards=1, seq_len=16, batch_size=4, seed=3)

    keys = [str(tmp_path / f"identity{i}.key") for i in range(2)]
    first = start_dht([], **dht_options([tcp_maddr("127.0.0.1")], identity_path=keys[0]))
    second = start_dht([str(m) for m in first.get_visible_maddrs()],
                       **dht_options([tcp_maddr("127.0.0.1")], identity_path=keys[1]))
    claims: list[ShardClaim] = []
    try:
        leaving = ShardClaim(first, "run_shards", 1, identity_key(keys[0]), ttl=6.0, settle=1.0)
        claims.append(leaving)
        assert leaving.acquire() == 0
        assert leaving.committed_position() is None  # a new shard starts at its beginning
        old = sampler()
        drawn = [old.next_batch()[0] for _ in range(7)]
        leaving.record(round_id=3, sampler_state=old.state_dict())  # round 3 committed here
        lost = [old.next_batch()[0] for _ in range(2)]  # trained, never committed
        leaving.release()  # leaves; its claim expires, its position stays
        newcomer = ShardClaim(second, "run_shards", 1, identity_key(keys[1]), ttl=6.0,
                              settle=1.0)
        claims.append(newcomer)
        deadline = time.monotonic() + 30
        while True:  # the shard is free once the leaver's claim has expired
            try:
                assert newcomer.acquire() == 0
                break
            except Exception:  # noqa: BLE001 - SwarmFull until the claim expires
                assert time.monotonic() < deadline, "the departed volunteer's shard never freed"
                time.sleep(1.0)
        taken = newcomer.committed_position()
        assert taken is not None and taken["round"] == 3
        new = sampler()
        assert new.advance_to(taken["sampler"])
        assert torch.equal(new.next_batch()[0], lost[0])  # the first batch after the commit
        assert not new.advance_to(sampler().state_dict())  # never moves back
        fresh = sampler()
        assert torch.equal(fresh.next_batch()[0], drawn[0])  # without it: trained again
    finally:
        for claim in claims:
            claim.release()
        second.shutdown()
        first.shutdown()
