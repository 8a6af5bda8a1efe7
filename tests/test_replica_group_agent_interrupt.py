"""A Ctrl-C at a replica group started by ``run_as_replica_group`` (``farlink join
--ranks-per-worker K``) reaches its ranks too (one process group); they stop at their next step
with their state written, and the command waits for that instead of killing their torchrun and
printing a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

RANK = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    rank = os.environ["RANK"]
    stop = []
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    (out / f"started-{rank}").touch()
    while not stop:
        time.sleep(0.05)
    time.sleep(2.0)  # the step in progress and the checkpoint
    (out / f"stopped-{rank}").touch()
""")


def test_ctrl_c_at_a_replica_group_waits_for_its_ranks_to_stop(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys; "
         "from farlink.parallel.replica_group_agent import run_as_replica_group;"
         f" sys.exit(run_as_replica_group('127.0.0.1', 2, [{str(script)!r}, {str(tmp_path)!r}]))"],
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
            assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read()
            time.sleep(0.1)
        os.killpg(parent.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = parent.communicate(timeout=60)
        stopped = [(tmp_path / f"stopped-{r}").exists() for r in (0, 1)]
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
    assert stopped == [True, True], err  # it returned only once both ranks had stopped
    assert "Traceback" not in err, err
