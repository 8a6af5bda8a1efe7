"""Shared fixtures: one tokenizer/data cache for the whole session (training it once)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# CI replays the same examples every run (a failure is reproducible, never a coin toss);
# HYPOTHESIS_PROFILE=explore searches fresh examples each time.
settings.register_profile("default", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("farlink-cache")


DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--write-durations", action="store_true",
                     help=f"record each test's seconds (setup, call, teardown) in {DURATIONS.name}, "
                          "which orders the next runs longest first")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that ran torchft in this process run last: a process that did must not fork
    afterwards (hivemind's DHT forks its process, and the child crashes on what torchft's
    threads left behind).

    Under ``-n`` (in each xdist worker, whose collection the scheduler follows) the longest
    tests of each part go first (seconds recorded in durations.json; a test not there counts as
    short), so the run does not end with one worker on a minute-long test while the others
    idle. The scheduler hands out two tests at a time (``--maxschedchunk 2`` in the default
    options): its default first hands each worker a quarter of its share in one consecutive
    block, which would give one worker all the longest tests. Each worker still takes tests in
    this order, so the torchft tests stay last on every worker (work stealing would break that:
    a worker that ran them could take another worker's forking tests). A run without ``-n`` keeps the files' order: the slow scenarios run serially before a
    deadline, where short ones first get more of them done."""
    parallel = hasattr(config, "workerinput")
    seconds = json.loads(DURATIONS.read_text()) if parallel and DURATIONS.exists() else {}
    items.sort(key=lambda item: (item.get_closest_marker("torchft_threads") is not None,
                                 -seconds.get(item.nodeid, 0.0)))


class DurationRecorder:
    """``--write-durations``: each test's seconds (its phases added up), written once the run
    ends. Registered only in the process that reports (xdist's controller sees every worker's
    reports), never in a worker."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        """Tests this run did not run keep their recorded seconds; tests under 2 s are left
        out (they count as short anyway), which keeps the file small."""
        known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        known.update({k: round(v, 1) for k, v in self.seconds.items()})
        longer = {k: v for k, v in sorted(known.items()) if v >= 2.0}
        DURATIONS.write_text(json.dumps(longer, indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "torchft_threads: runs torchft (Managers, Gloo, an in-process Lighthouse) in "
        "the test process; such tests run after all others")
    if config.getoption("write_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(), "farlink-durations")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a session without xdist loads this file too
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the cores. Many tests spend part of their time waiting
    (a timeout that is their subject, a peer's start, a round over loopback), so with one worker
    per core a quarter of the CPU sat idle; the extra worker fills it."""
    return (os.cpu_count() or 1) + 1


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``FARLINK_SLOW_DEADLINE`` (seconds since the epoch; CI sets it): a slow scenario that
    would start after it is skipped, saying so, instead of starting and being killed by the run's
    time limit (a killed run reports nothing about the scenarios it had finished)."""
    deadline = os.environ.get("FARLINK_SLOW_DEADLINE")
    if deadline and item.get_closest_marker("slow") and time.time() > float(deadline):
        pytest.skip("slow scenario not started: the run's time budget for them is spent "
                    "(FARLINK_SLOW_DEADLINE)")


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The test process ends without the interpreter's teardown, once pytest has reported.

    Tests run torchft's Managers and Gloo process groups in threads of this process; when the
    interpreter finalizes, a thread still inside such native code that takes the GIL back is
    unwound by force, and a C++ ``catch (...)`` on its stack turns that into ``FATAL: exception
    not rethrown`` and SIGABRT: a run whose every test passed would exit 134. The workers'
    ``exit_process`` leaves the same way for the same reason. Threads still alive are named first,
    so a test that leaks one is visible."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:
        return  # pytest stopped before the session ran (usage error, --help): its own exit
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        sys.stderr.write(f"conftest: {len(alive)} threads still alive at exit: "
                         f"{', '.join(sorted(alive)[:20])}\n")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

