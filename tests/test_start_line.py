"""The workers one launch starts meet in their first round, however late one of them is ready.

Real torchft Managers in separate processes and a real Lighthouse with ``min_replicas`` 1 (the
elastic default); one peer gets its collective up 4 s after the other, as a worker still
loading its data on a busy machine does."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import torch

from farlink.train.lighthouse import Lighthouse
from farlink.train.start_line import LINE_ENV, PEERS_ENV, StartLine

LATE_S = 4.0


def _peer(index: int, address: str, line: str | None, queue) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    from farlink.comm.torchft_backend import TorchftCollective

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
        queue.put((index, info.world_size, waited))
    finally:
        coll.close()


def first_round_groups(line: StartLine | None) -> dict[int, tuple[int, float]]:
    lighthouse = Lighthouse(min_replicas=1, join_timeout=20).start()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    path = str(line.path) if line else None
    procs = [ctx.Process(target=_peer, args=(i, lighthouse.address, path, queue))
             for i in range(2)]
    try:
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            index, world, waited = queue.get(timeout=120)
            results[index] = (world, waited)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.stop()
    return results


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
