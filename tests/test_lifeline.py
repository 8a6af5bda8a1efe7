"""A Lighthouse dies with the process that started it, not with the thread that did (the kernel
sends PR_SET_PDEATHSIG when the forking *thread* exits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from procfs import alive

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
