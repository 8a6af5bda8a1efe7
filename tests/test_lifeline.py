"""A Lighthouse dies with the process that started it, not with the thread that did (the kernel
sends PR_SET_PDEATHSIG when the forking *thread* exits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from procfs import alive, command_line, descendants

from farlink.train.lighthouse import Lighthouse

START_FROM_A_THREAD = """
import threading, time
from farlink.train.lighthouse import Lighthouse
box = []
t = threading.Thread(target=lambda: box.append(Lighthouse().start()))
t.start(); t.join()
print(box[0].proc.pid, flush=True)
time.sleep(600)
"""


def test_lighthouse_started_from_a_thread_outlives_the_thread() -> None:
    box: list[Lighthouse] = []
    thread = threading.Thread(target=lambda: box.append(Lighthouse().start()))
    thread.start()
    thread.join()
    try:
        time.sleep(1.0)
        assert box[0].proc.poll() is None, "killed when its starting thread ended"
    finally:
        box[0].stop()


def test_lighthouse_dies_with_a_sigkilled_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", START_FROM_A_THREAD],
                              stdout=subprocess.PIPE, text=True)
    try:
        lighthouse = int(parent.stdout.readline())
        assert alive(lighthouse)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while alive(lighthouse) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(lighthouse):
            os.kill(lighthouse, signal.SIGKILL)
            raise AssertionError("the Lighthouse outlived its parent")
    finally:
        parent.kill()


BLOCKED_WORKER = """
import multiprocessing, subprocess, time
from farlink.lifeline import _children, watch_parent

def dht():  # as hivemind's DHT process, which starts p2pd
    subprocess.run(["sleep", "600"])

if __name__ == "__main__":
    watch_parent(grace=1.0)
    helper = multiprocessing.Process(target=dht)
    helper.start()
    while not _children(helper.pid):
        time.sleep(0.05)
    print(helper.pid, _children(helper.pid)[0], flush=True)
    time.sleep(600)  # blocked in a round: never reaches a step boundary
"""

LAUNCHER = """
import os, subprocess, sys, time
from farlink.lifeline import child_env
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, **child_env()},
                          stdout=subprocess.PIPE, text=True)
print(worker.pid, worker.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def test_a_worker_blocked_when_its_launcher_dies_takes_its_subprocesses_with_it() -> None:
    """After the grace period the worker exits without cleanup (``os._exit``); the processes it
    started (a multiprocessing child and that child's own subprocess, as hivemind's DHT process
    and p2pd) must not outlive it."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, BLOCKED_WORKER],
                                stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(p) for p in pids), pids  # worker, DHT, p2pd
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 8  # grace 1 s, then at most 2 s for the subtree
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], "outlived the worker's exit"
    finally:
        launcher.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


HIVEMIND_PEER = """
import time
from farlink.comm.hivemind_backend import HivemindCollective
peer = HivemindCollective("tied")  # on the main thread: its DHT process is tied to this one
print("ready", flush=True)
time.sleep(600)
"""


def test_a_sigkilled_process_takes_its_dht_and_p2pd_along() -> None:
    """A process holding a hivemind peer (as ``farlink swarm join`` and a hivemind worker do)
    killed with SIGKILL: its DHT process (forked, with its p2pd) must not outlive it. An orphaned
    DHT also held the process's output pipes open, so whoever waited for its output waited
    forever. (``farlink swarm join`` itself: test_orphans, with the slow scenarios.)"""
    peer = subprocess.Popen([sys.executable, "-c", HIVEMIND_PEER], stdout=subprocess.PIPE,
                            text=True)
    below: set[int] = set()
    try:
        assert peer.stdout.readline().strip() == "ready"
        below = descendants(peer.pid)
        assert any("p2pd" in command_line(pid) for pid in below), [command_line(p) for p in below]
        peer.send_signal(signal.SIGKILL)
        peer.wait(30)
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [command_line(pid) for pid in below if alive(pid)]
        assert peer.stdout.read() == ""  # no process left holding its output open
    finally:
        peer.kill()
        for pid in below:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
