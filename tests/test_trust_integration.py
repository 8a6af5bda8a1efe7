"""Trust with real workers (threads of this process behind a real gated Lighthouse; `farlink
join` through typer's runner in this process; processes for hivemind): a peer holding the wrong run secret (or a key the run never
listed) is refused at the Lighthouse gate and never enters a round, and a peer sending NaN/huge
updates is rejected by the honest peers, who keep agreeing and learning."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from join_scenario import two_workers_then_join_in_threads

from farlink.config import load_config
from farlink.robust.auth import run_authenticator
from farlink.robust.keys import generate_keypair
from farlink.train.audit import audit_run
from farlink.train.launcher import _stop_all, spawn_worker, summarize, write_run_config
from farlink.train.lighthouse import Lighthouse
from farlink.train.metrics import read_metrics

BASE = {"model": "nano",
        "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2, "workers": 3,
        "steps": 30, "inner_steps": 10, "warmup_steps": 5, "join_timeout": 10,
        "auth": "secret", "codec": "int8"}


def gated_lighthouse(cfg, log_path: Path | None = None) -> Lighthouse:
    return Lighthouse(min_replicas=3, join_timeout=10, log_path=log_path,
                      authenticator=run_authenticator(cfg, "gate", verifier=True)).start()


def honest_fingerprints(run_dir: Path, workers: list[str]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for w in workers:
        for r in read_metrics(run_dir / "metrics" / f"{w}.jsonl"):
            if r["kind"] == "sync" and r["committed"]:
                out.setdefault(r["outer_step"], set()).add(r["fingerprint"])
    return out


def run_in_threads(configs: dict, lighthouse: Lighthouse) -> dict:
    """Worker ``i`` of ``configs[i]`` for every ``i`` at once, as threads against
    ``lighthouse`` (stopped at the end); each one's exit code, or the AdmissionError that
    refused it (what ``farlink worker`` prints before exiting non-zero)."""
    import threading

    from farlink.robust.gate import AdmissionError
    from farlink.testing import in_threads
    from farlink.train.worker import Worker

    building = threading.Lock()  # a worker seeds the process's RNG, then builds its model

    def work(index: int, cfg) -> object:  # noqa: ANN001
        try:
            with building:
                worker = Worker(cfg, index, lighthouse.address)
            try:
                return worker.run()
            finally:
                worker.close()
        except AdmissionError as exc:
            return exc

    try:
        return in_threads(work, configs, timeout=300)
    finally:
        lighthouse.stop()


@pytest.mark.torchft_threads
def test_wrong_secret_peer_is_refused_at_the_gate(tmp_path: Path, cache_dir: Path) -> None:
    """Workers as threads behind the gated Lighthouse (a process); the fourth holds a wrong
    secret."""
    from farlink.data import prepare_data

    cfg = load_config(None, {**BASE, "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                             "secret": "the-run-secret"})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    wrong = cfg.model_copy(update={"secret": "a-wrong-secret"})
    codes = run_in_threads({0: cfg, 1: cfg, 2: cfg, 3: wrong},
                           gated_lighthouse(cfg, cfg.run_dir / "lighthouse.log"))
    assert [codes[i] for i in range(3)] == [0, 0, 0]
    refusal = str(codes[3])  # refused: a clear error, not a hang
    assert "refused this peer" in refusal and "wrong run secret" in refusal and "Fix:" in refusal
    assert not (cfg.run_dir / "metrics" / "w3.jsonl").exists()  # never trained, never synced
    gate_log = (cfg.run_dir / "gate.log").read_text()
    assert "refused" in gate_log and "'w3'" in gate_log
    honest = ["w0", "w1", "w2"]
    syncs = [r for w in honest for r in read_metrics(cfg.run_dir / "metrics" / f"{w}.jsonl")
             if r["kind"] == "sync"]
    assert syncs and all(r["committed"] and r["world_size"] == 3 for r in syncs)
    fps = honest_fingerprints(cfg.run_dir, honest)
    assert len(fps) == 3 and all(len(f) == 1 for f in fps.values())  # replicas agree
    ledger = json.loads((cfg.run_dir / "ledger" / "w0.json").read_text())["peers"]
    assert set(ledger) == {"w0", "w1", "w2"}  # the ledger books the members only
    assert all(p["updates_accepted"] == 3 and p["updates_rejected"] == 0 for p in ledger.values())
    assert summarize(cfg)["evals"][-1]["loss"] < 6.0


@pytest.mark.torchft_threads  # the joiner's worker starts in this process
def test_unlisted_key_is_refused_by_farlink_join(tmp_path: Path, cache_dir: Path) -> None:
    """ed25519: a joiner whose key is valid but not in the run's --allowed-keys gets a clear
    error and a non-zero exit from `farlink join`, within a bounded time. The command runs in
    this process (typer's runner): its message and exit code are the subject, not a process."""
    import signal

    from typer.testing import CliRunner

    from farlink.cli import app
    from farlink.data import prepare_data

    members = tmp_path / "members"
    generate_keypair(members / "alice.key")
    generate_keypair(tmp_path / "mallory.key")
    run_cfg = load_config(None, {**BASE, "auth": "ed25519", "allowed_keys": members,
                                 "run_dir": tmp_path / "run", "cache_dir": cache_dir})
    prepare_data(run_cfg.corpus, run_cfg.vocab_size, run_cfg.cache_dir)
    # mallory's own config lists her own key, so her side raises no local complaint
    impostor = load_config(None, {**BASE, "auth": "ed25519",
                                  "key_file": tmp_path / "mallory.key",
                                  "allowed_keys": tmp_path / "mallory.key.pub",
                                  "run_dir": tmp_path / "mallory", "cache_dir": cache_dir})
    write_run_config(impostor)
    lighthouse = gated_lighthouse(run_cfg, tmp_path / "lighthouse.log")
    # a worker sets its own Ctrl-C handling (stop between steps): this process's is kept
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        start = time.monotonic()
        proc = CliRunner().invoke(
            app, ["join", "--lighthouse", lighthouse.address,
                  "--config", str(impostor.run_dir / "config.toml"), "--index", "3"])
        elapsed = time.monotonic() - start
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        refusals = lighthouse.gate.refusals if lighthouse.gate else []
        lighthouse.stop()
    assert proc.exit_code != 0, proc.output
    assert "not a member of this run" in proc.stderr and "--allowed-keys" in proc.stderr
    assert elapsed < 60
    assert len(refusals) == 1 and "unknown key" in refusals[0][1]


@pytest.mark.torchft_threads
def test_member_joins_mid_run_and_heals_through_gates(tmp_path: Path, cache_dir: Path) -> None:
    """With --auth the healing transfer also goes through gates: a member that joins late
    downloads the live peers' state through their checkpoint gates and then contributes.
    Workers as threads (the gated Lighthouse a process); `farlink join` itself: the refusal
    above, and test_join's run without --auth."""
    from farlink.data import prepare_data

    cfg = load_config(None, {**BASE, "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                             "secret": "the-run-secret", "steps": 80, "eval_every": 10,
                             "min_replicas": 2, "join_timeout": 5})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    lighthouse = Lighthouse(min_replicas=2, join_timeout=5, log_path=cfg.run_dir / "lh.log",
                            authenticator=run_authenticator(cfg, "gate", verifier=True)).start()
    two_workers_then_join_in_threads(cfg, lighthouse)


@pytest.mark.slow  # about 50 s: three worker processes, each with its own p2p daemon
def test_hivemind_wrong_secret_peer_is_refused(tmp_path: Path, cache_dir: Path) -> None:
    """Community mode: two members train; a third peer with the wrong secret is refused by the
    swarm's DHT at bootstrap (clear error, non-zero exit) and never appears in a group."""
    from farlink.comm.hivemind_admission import RunAuthorizer
    from farlink.comm.hivemind_net import start_bootstrap_peer
    from farlink.data import prepare_data

    cfg = load_config(None, {**BASE, "backend": "hivemind", "workers": 2, "min_replicas": 2,
                             "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                             "secret": "the-run-secret"})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    boot, maddrs = start_bootstrap_peer(
        authorizer=RunAuthorizer(run_authenticator(cfg, "bootstrap")))
    peers = ",".join(maddrs)
    procs = [spawn_worker(cfg, i, peers, False) for i in range(2)]
    procs.append(spawn_worker(cfg, 2, peers, False, {"FARLINK_SECRET": "a-wrong-secret"}))
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        _stop_all(procs)
        boot.shutdown()
    codes = [p.returncode for p in procs]
    assert codes[:2] == [0, 0] and codes[2] != 0, codes
    log = (cfg.run_dir / "logs" / "w2.log").read_text()
    assert "wrong run secret" in log and "Fix:" in log
    assert not (cfg.run_dir / "metrics" / "w2.jsonl").exists()
    syncs = [r for w in ("w0", "w1") for r in read_metrics(cfg.run_dir / "metrics" / f"{w}.jsonl")
             if r["kind"] == "sync"]
    assert syncs and all(r["committed"] and r["world_size"] == 2 for r in syncs)
    assert audit_run(cfg.run_dir)["consistent"]


@pytest.mark.torchft_threads
def test_nan_and_scaled_attackers_are_screened(tmp_path: Path, cache_dir: Path) -> None:
    """Workers as threads behind the launcher's gated Lighthouse (a quorum of all three)."""
    from farlink.testing.runs import launch_in_threads

    cfg = load_config(None, {**BASE, "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                             "secret": "s", "attack": "scale:1000", "attackers": "2",
                             "min_replicas": 3})
    assert launch_in_threads(cfg).returncodes == [0, 0, 0]
    ledger = json.loads((cfg.run_dir / "ledger" / "w0.json").read_text())["peers"]
    assert ledger["w2"]["updates_rejected"] == 3 and ledger["w2"]["updates_accepted"] == 0
    assert audit_run(cfg.run_dir)["consistent"]
