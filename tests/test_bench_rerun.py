"""A benchmark run again into the same output directory measures again: the earlier runs are
moved aside, never deleted, and never stop the new invocation at its first run dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from farlink.bench.runner import set_aside_earlier_runs


def test_earlier_runs_move_aside_whole_and_a_second_time_too(tmp_path: Path) -> None:
    assert set_aside_earlier_runs(tmp_path) is None  # nothing yet: nothing moved
    for round_ in (1, 2):
        (tmp_path / "runs" / "k1-0").mkdir(parents=True)
        (tmp_path / "runs" / "k1-0" / "summary.json").write_text(f'{{"round": {round_}}}')
        moved = set_aside_earlier_runs(tmp_path)
        assert moved is not None and moved.name.startswith("runs.old-")
        assert not (tmp_path / "runs").exists()
        assert json.loads((moved / "k1-0" / "summary.json").read_text()) == {"round": round_}
    assert len(list(tmp_path.glob("runs.old-*"))) == 2  # the first set-aside was not replaced


@pytest.mark.slow  # two benchmark invocations, about 30 s
def test_bench_overhead_twice_into_one_directory(tmp_path: Path) -> None:
    # the subject is the output directory, not the measurement: the smallest model, and the
    # fewest steps the benchmark takes (one round of its 50 inner steps)
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "farlink.cli", "bench", "overhead", "--out", str(out),
               "--steps", "50", "--repeats", "1", "--model", "nano"]
    for attempt in (1, 2):
        run = subprocess.run(command, capture_output=True, text=True, timeout=300,
                             cwd=tmp_path, check=False)
        assert run.returncode == 0, (attempt, run.stdout[-2000:], run.stderr[-2000:])
        assert (out / "runs" / "farlink-0" / "summary.json").is_file()
    kept = list(out.glob("runs.old-*/farlink-0/summary.json"))
    assert len(kept) == 1, kept  # the first invocation's run, whole
