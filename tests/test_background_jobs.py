"""``farlink.state.background.Background``: a job submitted by the training thread while another
thread (a delayed outer round's, whose ``before_round`` waits for the checkpoint write) waits
for the previous one."""

from __future__ import annotations

import threading
import time

import pytest

from farlink.state import background
from farlink.state.background import Background


class _SlowToStart(threading.Thread):
    """A thread that takes 0.3 s to start: the moment between a job's thread being created and
    running, which a busy machine stretches, made long enough to land a wait in it."""

    def start(self) -> None:
        time.sleep(0.3)
        super().start()


def test_a_wait_from_another_thread_while_a_job_starts_waits_for_that_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    writes = Background("checkpoint")
    ran = threading.Event()
    outcome: list[object] = []

    def round_thread() -> None:  # a round's before_round, while the submit is under way
        time.sleep(0.1)
        try:
            writes.wait()
            outcome.append(ran.is_set())
        except BaseException as exc:  # noqa: BLE001 - what the wait ended with
            outcome.append(exc)

    waiter = threading.Thread(target=round_thread)
    waiter.start()
    monkeypatch.setattr(background.threading, "Thread", _SlowToStart)  # the job's thread
    writes.submit(ran.set)
    waiter.join(timeout=10)
    # it waited for the job (which ran) instead of failing on a thread not yet started
    assert outcome == [True]
    writes.wait()
    assert writes.jobs == 1
