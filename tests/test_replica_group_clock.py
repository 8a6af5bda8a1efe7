"""A time-budgeted round's end on a replica group of several ranks: each rank reads its own clock,
but the replica group is one replica, so every rank must end the round at the same step (a rank
that entered the round alone would wait in torchft's quorum while the others waited in the next
step's all-reduce).

Two real processes, a Gloo group between them (the replica group), each a DiLoCo and then a
hierarchical DiLoCo replica through :class:`farlink.Optimizer` (one pair of processes asks for
both algorithms: starting them is most of the cost); rank 0's clock is put past the round's
deadline, rank 1's is not.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest

ALGORITHMS = ("diloco", "hierarchical_diloco")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_decides(rank: int, port: int, answers) -> None:  # noqa: ANN001
    import os

    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    import farlink
    from farlink.comm.inprocess import InProcessGroup
    from farlink.parallel.sharding import ReplicaGroup

    torch.set_num_threads(1)
    replica_group = ReplicaGroup.from_env(replica_index=0).start()
    for algorithm in ALGORITHMS:
        model = torch.nn.Linear(4, 4)
        options = {"island_seconds": 1.0} if algorithm == "hierarchical_diloco" else {}
        sync = farlink.Optimizer(model, algorithm=algorithm, backend="inprocess", steps=100,
                                 round_seconds=1.0, collective=InProcessGroup(1).member(0),
                                 replica_group=replica_group, **options)
        clock = sync.algorithm.clock  # the schedule whose deadline ends the round
        if rank == 0:  # this rank's clock says the round's time is long over
            clock.period_started -= 1000.0
            clock.clock_started -= 1000.0
        clock.steps_since_clock = 1
        answers.put((algorithm, rank, sync.algorithm.round_due()))
    replica_group.close()


@pytest.fixture(scope="module")
def decisions() -> tuple[list, dict]:
    """Both ranks' exit codes and each algorithm's answers by rank."""
    ctx = mp.get_context("spawn")
    answers, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=rank_decides, args=(r, port, answers)) for r in range(2)]
    for proc in ranks:
        proc.start()
    decided: dict[str, dict[int, bool]] = {algorithm: {} for algorithm in ALGORITHMS}
    try:
        for _ in range(len(ranks) * len(ALGORITHMS)):
            algorithm, rank, due = answers.get(timeout=120)
            decided[algorithm][rank] = due
    finally:
        for proc in ranks:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [proc.exitcode for proc in ranks], decided


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_ranks_of_a_replica_group_end_a_timed_round_together(algorithm: str,
                                                                 decisions) -> None:  # noqa: ANN001
    exitcodes, decided = decisions
    assert exitcodes == [0, 0]
    assert decided[algorithm] == {0: True, 1: True}, decided
