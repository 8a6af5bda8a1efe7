"""Rollout workers as processes over real sockets: one SIGKILLed mid-run, a trainer restarted.

The subject here is the process (a kill, a restart, a reconnect), so workers are real
``farlink rl-worker`` processes on TCP; the algorithm's own tests (tests/test_rl.py) use threads.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from farlink.data.tokenizer import train_tokenizer
from farlink.model.config import GPTConfig
from farlink.model.gpt import GPT
from farlink.rl.base import TextCodec
from farlink.rl.loop import run_group
from farlink.rl.tasks import Addition, CallableTask, demonstrations
from farlink.rl.trainer import RLConfig
from farlink.robust.keys import key_id, load_private_key
from farlink.train.rl import Base, make_session, serve, spawn_workers

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _even_task() -> CallableTask:
    return CallableTask("even", lambda rng: (f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", "4"),
                        lambda prompt, answer, completion: sum(map(ord, completion)) % 2 == 0)


def test_a_sigkilled_worker_process_costs_no_step_and_the_run_goes_on(monkeypatch,
                                                                      tmp_path) -> None:
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    torch.manual_seed(0)
    codec = TextCodec(train_tokenizer(demonstrations(Addition(2), 200, 0.5), 257))
    model = GPT(GPTConfig(vocab_size=257, n_layer=1, n_head=2, d_model=32, d_ff=64, seq_len=32))
    cfg = RLConfig(group_size=4, groups_per_step=2, deadline_s=20.0, fingerprint_every=2,
                   max_staleness=4)
    session = make_session(Base(model.eval(), codec, _even_task(), []), cfg, workers=0, lr=1e-2)
    server = serve(session, "int4")
    children = spawn_workers(server.address, 2, pace_seconds=0.05, identity_dir=tmp_path)
    killed_at: list[int] = []
    # a worker process is named by its key id; its label is what it was started as
    key_of = {label: key_id(load_private_key(tmp_path / f"{label}.key").public_key())
              for label in ("proc-0", "proc-1")}

    def issued_to_0() -> int:
        return sum(job.worker == key_of["proc-0"] for job in list(session.board.jobs.values()))

    def on_step(log) -> None:  # noqa: ANN001
        if log.step >= 2 and not killed_at and issued_to_0() > 0:  # running: it took a job
            os.kill(children[0].pid, signal.SIGKILL)
            killed_at.append(issued_to_0())

    def accepted(worker: str) -> int:
        ledger = session.trainer.ledger
        return ledger.get(worker).updates_accepted if worker in ledger.peers() else 0

    try:
        # both processes started (their imports take seconds on a busy machine) before the
        # run: a worker 0 that took no job before the last step would never be killed
        started = time.monotonic() + 120
        while not (set(key_of.values()) <= {job.worker for job in list(
                session.board.jobs.values())}) and time.monotonic() < started:
            time.sleep(0.1)
        logs = run_group(session.trainer, [], 8, on_step, max_wall_s=240, remote=True)
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=30)
        server.close()
    assert children[0].returncode == -signal.SIGKILL
    # the server kept where each worker's requests came from (both local here)
    assert server.worker_hosts == {key_of["proc-0"]: {"127.0.0.1"},
                                   key_of["proc-1"]: {"127.0.0.1"}}
    assert server.worker_labels == {key: label for label, key in key_of.items()}
    assert [log.step for log in logs] == list(range(8)) and session.publisher.version == 8
    assert session.trainer.rejections == []
    # the dead worker asked for nothing more (one request may have been on the wire); what it
    # handed in before counted, its open job expired, and the living one carried the run
    assert killed_at and issued_to_0() <= killed_at[0] + 1
    assert accepted(key_of["proc-0"]) + accepted(key_of["proc-1"]) == 16
    assert accepted(key_of["proc-1"]) >= 16 - issued_to_0() > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_restarted_trainer_process_resumes_and_its_worker_processes_carry_on(tmp_path) -> None:
    """`farlink rl --listen` SIGKILLed after a few committed steps, then started again: it
    resumes after its last checkpoint, the same two worker processes reconnect (refetching
    the policy in full: the new trainer's versions are its own), no committed step is lost
    and no honest worker is blamed for a hand-in the old trainer issued."""
    port = _free_port()
    out = tmp_path / "run"
    trainer_cmd = [sys.executable, "-m", "farlink.cli", "rl", "--workers", "0", "--listen",
                   f"127.0.0.1:{port}", "--steps", "12", "--pretrain-steps", "20",
                   "--group-size", "4", "--groups-per-step", "2", "--max-staleness", "4",
                   "--deadline", "20", "--out", str(out)]
    first = subprocess.Popen(trainer_cmd, env=ENV, stdout=subprocess.PIPE, text=True)
    workers = [subprocess.Popen([sys.executable, "-m", "farlink.train.rl_worker", "--connect",
                                 f"127.0.0.1:{port}", "--name", f"w{i}", "--identity",
                                 str(tmp_path / f"w{i}.key"), "--pace-seconds", "0.1",
                                 "--reconnect-s", "300"], env=ENV, stdout=subprocess.PIPE,
                                text=True)
               for i in range(2)]
    try:
        deadline = time.monotonic() + 400
        # any committed step from the third on (two are kept: at a few steps a second,
        # step 3's checkpoint may be pruned before a poll sees it)
        while not any(int(p.name.split("-")[1]) >= 3
                      for p in (out / "checkpoints").glob("step-*")):
            assert first.poll() is None and time.monotonic() < deadline, "no third step"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert all(w.poll() is None for w in workers)  # waiting to reconnect
        second = subprocess.run(trainer_cmd, env=ENV, capture_output=True, text=True,
                                timeout=600)
        assert second.returncode == 0, second.stderr[-3000:]
        resumed = [line for line in second.stdout.splitlines() if line.startswith("resuming")]
        assert resumed and int(resumed[0].split()[-1]) >= 3, second.stdout
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 12 and summary["rejections"] == []
        accepted = summary["groups_accepted"]  # by key id; the labels name them
        assert {summary["worker_labels"][key] for key in accepted} == {"w0", "w1"}
        assert len(accepted) == 2 and sum(accepted.values()) >= 2 * 12
    finally:
        for proc in [first, *workers]:
            proc.kill()
            proc.wait(timeout=30)
