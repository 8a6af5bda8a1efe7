"""Rollout workers behind emulated links (in-process, :mod:`farlink.rl.linked`): every job
costs its round trips and its bytes on the worker's own access link, and the run is otherwise
the same run (same verification, same bytes)."""

from __future__ import annotations

import time

import torch

from farlink.data.tokenizer import train_tokenizer
from farlink.links import get_profile
from farlink.model.config import GPTConfig
from farlink.model.gpt import GPT
from farlink.rl.base import TextCodec
from farlink.rl.loop import run_group
from farlink.rl.tasks import Addition, CallableTask, demonstrations
from farlink.rl.trainer import RLConfig
from farlink.train.rl import Base, make_session


def _even_task() -> CallableTask:
    return CallableTask("even", lambda rng: (f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", "4"),
                        lambda prompt, answer, completion: sum(map(ord, completion)) % 2 == 0)


def test_workers_on_home_links_pay_round_trips_and_bytes_and_still_verify() -> None:
    torch.manual_seed(0)
    codec = TextCodec(train_tokenizer(demonstrations(Addition(2), 200, 0.5), 257))
    model = GPT(GPTConfig(vocab_size=257, n_layer=1, n_head=2, d_model=32, d_ff=64, seq_len=32))
    cfg = RLConfig(group_size=4, groups_per_step=2, deadline_s=30.0, fingerprint_every=2,
                   max_staleness=4, verify_fraction=1.0)
    session = make_session(Base(model.eval(), codec, _even_task(), []), cfg, workers=2,
                           lr=1e-2, worker_link="home")
    started = time.monotonic()
    logs = run_group(session.trainer, session.workers, 3, max_wall_s=120)
    wall = time.monotonic() - started
    assert [log.step for log in logs] == [0, 1, 2] and session.trainer.rejections == []
    home = get_profile("home")
    hop = home.hop_latency_ms / 1000
    full = len(session.publisher.snapshot().blob)
    for worker in session.workers:
        clock = session.links[worker.name]
        assert worker.jobs_done >= 1 and clock.bytes_up > 0
        # every job: request and version check (a round trip each), hand-in (one way)
        assert clock.seconds >= worker.jobs_done * 5 * hop
        # the first fetch was the whole policy, at the download rate
        assert worker.replica.full_fetches >= 1 and clock.bytes_down >= full
        assert clock.bytes_down == worker.replica.bytes_received  # every fetched byte crossed
        assert clock.seconds >= clock.bytes_down * 8 / (home.down_mbit * 1e6)
        assert wall >= clock.seconds * 0.95  # the worker really waited for its link
