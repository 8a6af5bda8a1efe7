"""The test process's own exit: a session that leaves torchft/Gloo work in threads still reports
its status (CI once saw every test pass and the process die with SIGABRT at interpreter exit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LEAKY_TEST = '''
import datetime, threading
import torch, torch.distributed as dist

GROUPS = {}  # module state, torn down by the interpreter at exit with a receive still pending


def test_leaves_a_process_group_waiting():
    store = dist.HashStore()
    def make(rank):
        GROUPS[rank] = dist.ProcessGroupGloo(dist.PrefixStore("x", store), rank, 2,
                                             datetime.timedelta(seconds=60))
    makers = [threading.Thread(target=make, args=(rank,)) for rank in range(2)]
    [t.start() for t in makers]
    [t.join() for t in makers]
    receive = GROUPS[1].recv([torch.zeros(4)], 0, 0)
    threading.Thread(target=receive.wait, daemon=True, name="waits-forever").start()
    assert OUTCOME
'''


@pytest.mark.parametrize(("outcome", "status"), [("True", 0), ("False", 1)])
def test_a_session_leaving_a_process_group_waiting_exits_with_its_own_status(
        tmp_path: Path, outcome: str, status: int) -> None:
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST.replace("OUTCOME", outcome))
    # the session loads this suite's conftest (whose exit is the subject) and none of the
    # installed pytest plugins, whose imports would be most of its start
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         "test_leaky.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == status, done.stdout[-2000:] + done.stderr[-2000:]
    assert "threads still alive at exit: waits-forever" in done.stderr
