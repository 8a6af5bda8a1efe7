"""Everyday mistakes and faults meet a one-line answer, not a traceback, and nothing is lost.

A binary file given as a config, a float option that is not finite, attackers that name no
worker, a run dir the process cannot write, and ``farlink report`` after the workers were
killed. Each runs the real CLI as a user does, with tiny settings.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from farlink.config import ConfigError, RunConfig, load_config
from farlink.train.launcher import write_run_config
from farlink.train.metrics import read_metrics

from test_run_safety import TINY, farlink_here, snapshot, tiny_flags

BINARY = bytes(range(128, 256)) * 4  # no UTF-8 text starts with a continuation byte


def assert_one_line_error(out: str, *names: str) -> None:
    """``out`` is an ``error:`` line naming ``names``, without a traceback."""
    assert "Traceback" not in out and "─" not in out, out  # rich draws a traceback in a box
    assert out.startswith("error: ") and all(n in out for n in names), out


# --- a binary config file ------------------------------------------------------------------

def test_a_binary_config_file_is_one_line_naming_it(tmp_path: Path) -> None:
    given = tmp_path / "config.toml"
    given.write_bytes(BINARY)
    code, out = farlink_here("train", "-c", str(given), "--run-dir", str(tmp_path / "run"))
    assert code == 2
    assert_one_line_error(out, str(given), "not a text file", "TOML")
    assert not (tmp_path / "run").exists()

    # the saved config.toml that --resume reads, damaged: named, and nothing else touched
    run = tmp_path / "saved"
    write_run_config(load_config(None, {**TINY, "run_dir": run}))
    (run / "config.toml").write_bytes(BINARY)
    before = snapshot(run)
    code, out = farlink_here("train", "--resume", "--run-dir", str(run))
    assert code == 2
    assert_one_line_error(out, str(run / "config.toml"), "not a text file")
    assert snapshot(run) == before

    # the planner's own tables go through the same reader
    code, out = farlink_here("plan", "--model", "tiny", "--workers", "2", "--links-file",
                             str(given))
    assert code != 0
    assert_one_line_error(out, str(given), "not a text file")


# --- floats that are not finite ------------------------------------------------------------

FLOAT_FIELDS = [name for name, field in RunConfig.model_fields.items()
                if "float" in str(field.annotation)]


def test_every_float_option_refuses_inf_and_nan_naming_its_flag() -> None:
    assert len(FLOAT_FIELDS) >= 10 and "outer_lr" in FLOAT_FIELDS  # algorithms' options too
    for name in FLOAT_FIELDS:
        flag = "--" + name.replace("_", "-")
        for value in (math.inf, -math.inf, math.nan):
            with pytest.raises(ConfigError, match=f"{name}: .*{flag} a finite value"):
                load_config(None, {name: value})


def test_outer_lr_inf_is_refused_before_the_run_dir_is_taken(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, out = farlink_here("train", *tiny_flags(), "--outer-lr", "inf", "--run-dir",
                             str(run))
    assert code == 2
    assert_one_line_error(out, "--outer-lr", "finite")
    assert not run.exists()
    given = tmp_path / "inf.toml"  # TOML has inf too
    given.write_text("[train]\nround_timeout = inf\n")
    code, out = farlink_here("train", "-c", str(given), "--run-dir", str(run))
    assert code == 2 and "--round-timeout" in out and not run.exists(), out


# --- attackers that name no worker ---------------------------------------------------------

def test_attackers_outside_the_launched_workers_are_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, out = farlink_here("train", *tiny_flags(workers=4, steps=4), "--attack", "sign_flip",
                             "--attackers", "9", "--run-dir", str(run))
    assert code == 2
    assert_one_line_error(out, "--attackers 9", "0 to 3")
    assert not run.exists()
    with pytest.raises(ConfigError, match="not a worker index"):
        load_config(None, {"attackers": "one"})
    assert load_config(None, {"workers": 4, "attackers": "0, 3"}).is_attacker(3)
    # a joiner may take any index: the run it joins decides what exists
    assert load_config(None, {"workers": 4, "attackers": "9",
                              "lighthouse": "127.0.0.1:1"}).is_attacker(9)


# --- a run dir this process cannot write ---------------------------------------------------

def _can_mount_read_only() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind -o ro / /"],
                           capture_output=True)
    return probe.returncode == 0


# the CLI's app run once per invocation, in one interpreter (typer's runner, as farlink_here),
# each invocation with its own path bind-mounted read-only for its duration: each invocation's
# exit code and output, as JSON
_CLI_INVOCATIONS = """
import json, subprocess, sys
from typer.testing import CliRunner
from farlink.cli import app
answers = []
for read_only, args in json.loads(sys.argv[1]):
    subprocess.run(["mount", "--bind", "-o", "ro", read_only, read_only], check=True)
    try:
        result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    finally:
        subprocess.run(["umount", read_only], check=True)
    out = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        out += f"Traceback: {result.exception!r}"  # what a user would have seen
    answers.append([result.exit_code, out])
print(json.dumps(answers))
"""


def farlink_read_only(*invocations: tuple[Path, list[str]]) -> list[tuple[int, str]]:
    """The CLI in a mount namespace of its own (as for root a chmod does not stop writes); the
    namespace ends with the process. Each of ``invocations`` is a path and one command line,
    run in turn in that one process while that path is a read-only mount."""
    proc = subprocess.run(["unshare", "-m", sys.executable, "-c", _CLI_INVOCATIONS,
                           json.dumps([[str(path), list(args)] for path, args in invocations])],
                          env={**os.environ, "COLUMNS": "200"}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [(code, out) for code, out in json.loads(proc.stdout.strip().splitlines()[-1])]


@pytest.mark.skipif(not _can_mount_read_only(), reason="needs unshare and mount (root)")
def test_a_read_only_run_dir_is_refused_naming_it(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own notes")
    run = mine / "run"  # a saved run in it, for --resume and --overwrite
    write_run_config(load_config(None, {**TINY, "run_dir": run}))
    before = snapshot(mine)
    answers = farlink_read_only(
        # a new run dir inside the read-only dir, the read-only dir itself, a joiner's run dir
        # inside it
        (mine, ["train", *tiny_flags(), "--run-dir", str(mine / "new")]),
        (mine, ["train", *tiny_flags(), "--run-dir", str(mine)]),
        (mine, ["join", "--lighthouse", "http://127.0.0.1:9", "--index", "0", "--run-dir",
                str(mine / "new")]),
        # the saved run read-only: --resume; its parent read-only: --overwrite (which moves
        # the run aside in the parent)
        (run, ["train", *tiny_flags(), "--resume", "--run-dir", str(run)]),
        (mine, ["train", *tiny_flags(), "--overwrite", "--run-dir", str(run)]))
    for code, out in answers[:2]:
        assert code == 2
        assert_one_line_error(out, str(mine), "read-only", "--run-dir")
    code, out = answers[2]
    assert code == 2
    assert_one_line_error(out, str(mine), "read-only")
    code, out = answers[3]
    assert code == 2
    assert_one_line_error(out, str(run), "read-only")
    code, out = answers[4]
    assert code == 2
    assert_one_line_error(out, str(mine), "read-only")
    assert snapshot(mine) == before
    assert not (mine / "new").exists()


# --- farlink report after a crash ----------------------------------------------------------

def _records(run: Path, worker: str, kind: str) -> list[dict]:
    return [r for r in read_metrics(run / "metrics" / f"{worker}.jsonl") if r["kind"] == kind]


def test_report_after_a_crash_lists_every_worker_that_trained(tmp_path: Path,
                                                              cache_dir: Path) -> None:
    """Both workers are SIGKILLed mid-run (no end record): the report still lists each, as
    "did not finish", with the step and tokens of its last record. The workers are processes
    started as ``farlink train`` starts them (its ``spawn_worker``), against a Lighthouse this
    test runs, so that SIGKILL is real; the report is the CLI's."""
    from farlink.data import prepare_data
    from farlink.train.launcher import _stop_all, spawn_worker
    from farlink.train.lighthouse import Lighthouse

    run = tmp_path / "run"
    cfg = load_config(None, {**TINY, "steps": 2000, "log_every": 1, "checkpoint_every": 1000,
                             "run_dir": run, "cache_dir": cache_dir})
    write_run_config(cfg)
    prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    lighthouse = Lighthouse(min_replicas=cfg.min_replicas, join_timeout=cfg.join_timeout).start()
    workers = [spawn_worker(cfg, i, lighthouse.address, resume=False) for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while not all((run / "metrics" / f"w{i}.jsonl").is_file()
                      and len(_records(run, f"w{i}", "step")) >= 3 for i in range(2)):
            assert all(w.poll() is None for w in workers), "a worker ended early"
            assert time.monotonic() < deadline, "the workers never trained"
            time.sleep(0.3)
        for i in range(2):
            os.kill(_records(run, f"w{i}", "start")[-1]["pid"], signal.SIGKILL)
        for worker in workers:
            assert worker.wait(timeout=120) == -signal.SIGKILL
    finally:
        _stop_all(workers)
        lighthouse.stop()
    assert not _records(run, "w0", "end") and not _records(run, "w1", "end")

    code, out = farlink_here("report", str(run))
    assert code == 0, out
    lasts = {name: [r for r in read_metrics(run / "metrics" / f"{name}.jsonl")
                    if "tokens" in r][-1] for name in ("w0", "w1")}
    for name, last in lasts.items():
        row = next((line for line in out.splitlines() if f" {name} " in line), "")
        assert f"{last['tokens']:,}" in row and "did not finish" in row, out
        assert f"did not finish (last step {last['step']})" in out, out
    from farlink.train.report import report

    rows = report(run, plot=False)["workers"]
    assert sorted(rows) == ["w0", "w1"]
    for name, row in rows.items():
        assert row["tokens"] == lasts[name]["tokens"] > 0 and row["step"] == lasts[name]["step"]
