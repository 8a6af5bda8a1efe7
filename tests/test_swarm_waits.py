"""Waits that a person can end: a peer waiting for a group that never forms leaves within a
second or so of Ctrl-C or SIGTERM, says it was interrupted and what it waited for, and says
what it waits for while the wait lasts."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time

import pytest
from forked import start_child

from farlink import interrupt


def lonely_peer(say) -> None:
    """A lone peer of a run whose rounds need two: it waits up to round_timeout (10 min) for a
    group. It says "waiting" once it looks, then how its wait ended."""
    from farlink.comm.hivemind_backend import HivemindCollective

    interrupt.install(raise_now=False)  # as a training worker: the handler only sets the flag
    coll = HivemindCollective("lonely", [], min_group_size=2, matchmaking_time=1.0,
                              request_timeout=0.5, round_timeout=600.0)
    say.send("waiting")
    try:
        coll.begin_round()
        say.send("formed a group")
    except KeyboardInterrupt as exc:
        say.send(f"stopped: {exc}")
        sys.exit(130)
    finally:
        coll.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_peer_waiting_for_a_group_leaves_promptly_on_a_stop_request(sig) -> None:
    # a real process and a real signal; forked with torch and hivemind already imported
    proc, said = start_child(lonely_peer)
    try:
        assert said.poll(120) and said.recv() == "waiting"
        time.sleep(1.5)  # inside its matchmaking (windows of 1 s)
        sent = time.monotonic()
        os.kill(proc.pid, sig)
        proc.join(30)
        took = time.monotonic() - sent
        out = said.recv() if said.poll(1) else "(nothing)"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert "stopped: interrupted while waiting for a group of >= 2 peers for run 'lonely'" \
        in out, out
    assert proc.exitcode == 130, out
    assert took < 10.0, f"took {took:.1f} s to leave after {sig.name}"


def test_wait_future_ends_on_the_stop_flag_and_says_what_it_waits_for(caplog) -> None:
    future: concurrent.futures.Future = concurrent.futures.Future()
    log = logging.getLogger("test.wait")
    threading.Timer(1.0, interrupt.STOP.set).start()
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, "test.wait"), \
                pytest.raises(KeyboardInterrupt, match="interrupted while waiting for a thing"):
            interrupt.wait_future(future, 60.0, lambda: "a thing", log, poll=0.1, every=0.3)
    finally:
        interrupt.STOP.clear()
    assert time.monotonic() - start < 2.0
    said = [r.getMessage() for r in caplog.records]
    assert said and all(m.startswith("waiting for a thing (") for m in said), said
    # without a stop request: the result, or TimeoutError naming what was awaited
    future.set_result(7)
    assert interrupt.wait_future(future, 1.0, lambda: "x", log) == 7
    with pytest.raises(TimeoutError, match="no a thing within 0 s"):
        interrupt.wait_future(concurrent.futures.Future(), 0.3, lambda: "a thing", log, poll=0.1)
    # a future that fails with a TimeoutError of its own (torchft's quorum attempt) is that
    # failure at once, not a slice to wait again until the whole timeout has passed
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(TimeoutError("attempt expired"))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="attempt expired"):
        interrupt.wait_future(failed, 5.0, lambda: "x", log, poll=0.1)
    assert time.monotonic() - start < 1.0
