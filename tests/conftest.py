"""Shared fixtures: one tokenizer/data cache for the whole session (training it once)."""

from __future__ import annotations

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "torchft_threads: runs torchft (Managers, Gloo, an in-process Lighthouse) in "
        "the test process; such tests run after all others")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that ran torchft in this process run last: a process that did must not fork
    afterwards (hivemind's DHT forks its process, and the child crashes on what torchft's
    threads left behind); the other tests keep their order."""
    items.sort(key=lambda item: item.get_closest_marker("torchft_threads") is not None)


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

