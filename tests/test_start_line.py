"""The workers one launch starts meet in their first round, however late one of them is ready.

Real torchft Managers as threads (``farlink.testing``) and torchft's real Lighthouse served
in-process with ``min_replicas`` 1 (the elastic default); one peer gets its collective up 4 s
after the other, as a worker still loading its data on a busy machine does."""

from __future__ import annotations

import pytest
import time
from pathlib import Path

import torch

from farlink.comm.torchft_backend import TorchftCollective
from farlink.testing import in_threads, lighthouse_server
from farlink.train.start_line import LINE_ENV, PEERS_ENV, StartLine

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

LATE_S = 4.0
torch.set_num_threads(1)


def _peer(index: int, address: str, line: str | None) -> tuple[int, float]:
    if index == 1:
        time.sleep(LATE_S)  # the slow starter
    coll = TorchftCollective(f"p{index}", address, min_replicas=1, round_timeout=20,
                             join_timeout=20)
    coll.register_state(lambda: {"x": torch.zeros(1)}, lambda s: None)
    try:
        waited = StartLine(2, Path(line)).wait(index, timeout=30) if line else 0.0
        info = coll.begin_round()
        coll.all_reduce_sum([torch.ones(1)])
        coll.commit()
        return info.world_size, waited
    finally:
        coll.close()


def first_round_groups(line: StartLine | None) -> dict[int, tuple[int, float]]:
    path = str(line.path) if line else None
    with lighthouse_server(min_replicas=1, join_timeout_s=20) as address:
        return in_threads(lambda i, _: _peer(i, address, path), {0: None, 1: None}, timeout=120)


def test_without_a_start_line_the_first_worker_commits_alone() -> None:
    """The situation the start line exists for really arises: the early peer's first quorum
    holds only itself."""
    results = first_round_groups(None)
    assert results[0][0] == 1, results


def test_start_line_puts_every_worker_in_the_first_round(tmp_path: Path) -> None:
    line = StartLine(2)
    try:
        results = first_round_groups(line)
    finally:
        line.remove()
    assert not line.path.exists()
    assert results[0][0] == 2 and results[1][0] == 2, results
    assert results[0][1] >= LATE_S - 1  # the early peer waited for the late one


def test_start_line_is_read_once_from_the_launchers_environment(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    line = StartLine(3, tmp_path)
    for key, value in line.env().items():
        monkeypatch.setenv(key, value)
    found = StartLine.from_env()
    assert found is not None and found.path == tmp_path and found.workers == 3
    assert StartLine.from_env() is None  # not passed on to children or read twice
    monkeypatch.setenv(LINE_ENV, str(tmp_path / "gone"))
    monkeypatch.setenv(PEERS_ENV, "3")
    assert StartLine.from_env() is None  # a line whose launch has ended holds no one


def test_a_worker_that_never_arrives_holds_the_others_for_the_timeout_only(tmp_path) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    waited = StartLine(2, tmp_path).wait(0, timeout=1.0)
    assert 1.0 <= waited < 3.0 and time.monotonic() - t0 < 3.0
