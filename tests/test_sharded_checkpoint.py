"""A replica group's checkpoint written by its ranks together (torch.distributed.checkpoint),
verified.

Two real processes in a Gloo group write two steps, each from a background thread while the
training thread keeps running collectives of its own on the default group; the published
directories are then read back, checked and damaged from this process, as a resume would. The
same two processes then fill a small disk (where one can be mounted): a process's start is most
of such a scenario's cost.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from farlink.state.checkpoint import (DIGESTS, META, CheckpointError, checkpoint_path,
                                      load_checkpoint, load_newest_intact,
                                      save_sharded_checkpoint)


def rank_state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` holds at ``step``: shards of different sizes, as FSDP's may be."""
    return {"global.w": torch.arange(3 + rank, dtype=torch.float32) + step,
            "counter.inner_steps": torch.tensor(step),
            "rng.torch": torch.full((5,), rank, dtype=torch.uint8)}


def replica_group_meta(step: int) -> dict:
    """What farlink.Optimizer records with a replica group's checkpoint (the parts read back
    here)."""
    return {"tokens": step * 8, "algorithm": "diloco", "site_ranks": 2, "bytes_sent": 0}


def _rank(rank: int, port: int, root: str, small_disk: str | None, queue) -> None:  # noqa: ANN001
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    group = dist.new_group(backend="gloo")  # the checkpoint writer's own group
    for step in (10, 20):
        writer = threading.Thread(target=save_sharded_checkpoint, args=(
            Path(root), step, rank_state(rank, step), replica_group_meta(step), rank, group))
        writer.start()
        for _ in range(50):  # the training thread's collectives go on meanwhile
            total = torch.ones(4)
            dist.all_reduce(total)
            assert total.tolist() == [2.0] * 4
        writer.join()
    dist.barrier()
    if small_disk is not None:
        _rank_on_a_small_disk(rank, small_disk, queue)  # leaves the process
    dist.destroy_process_group()


def _mount_small_disk(disk: Path) -> str | None:
    """A 12 MB tmpfs at ``disk``: room for one step of ``_rank_on_a_small_disk`` but not two.
    None when mounted; else why not (the full-disk test skips, saying it)."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "a real full disk needs a tmpfs mount, which needs root"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        return f"cannot mount a tmpfs here: {mounted.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Iterator[dict]:
    """Two ranks (spawned processes) that write two steps under ``root``, then, where a small
    disk could be mounted, fill it under ``small_root``; their exit codes and what each saw on
    the small disk (``outcomes``), or why there was none (``no_disk``)."""
    import socket
    import subprocess

    base = tmp_path_factory.mktemp("replica_group")
    disk = base / "disk"
    no_disk = _mount_small_disk(disk)
    small_root = None if no_disk else disk / "w0"
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        spawn = multiprocessing.get_context("spawn")
        queue = spawn.Queue()
        procs = [spawn.Process(target=_rank, args=(
            r, port, str(base / "w0"), None if small_root is None else str(small_root), queue))
            for r in range(2)]
        for proc in procs:
            proc.start()
        outcomes = dict(queue.get(timeout=120) for _ in procs) if small_root else None
        for proc in procs:
            proc.join(timeout=120)
        yield {"root": base / "w0", "exitcodes": [p.exitcode for p in procs],
               "small_root": small_root, "outcomes": outcomes, "no_disk": no_disk}
    finally:
        if small_root is not None:
            subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.fixture(scope="module")
def written(ranks: dict) -> Path:
    assert ranks["exitcodes"] == [0, 0]
    return ranks["root"]


def test_each_step_is_one_directory_whose_every_file_has_a_digest(written):
    assert sorted(p.name for p in written.iterdir()) == ["LATEST", "step-0000010",
                                                         "step-0000020"]
    assert (written / "LATEST").read_text() == "step-0000020"
    path = checkpoint_path(written, 20)
    meta = json.loads((path / META).read_text())
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.name != META)
    assert sorted(meta[DIGESTS]) == files and ".metadata" in files and len(files) >= 3
    for rank in (0, 1):
        tensors, meta = load_checkpoint(path, rank=rank)
        assert meta["tokens"] == 160
        expected = rank_state(rank, 20)
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[k], expected[k]) for k in expected)


def test_a_damaged_file_sets_the_step_aside_and_the_replica_group_falls_back(written, tmp_path):
    import shutil

    root = tmp_path / "w0"
    shutil.copytree(written, root)
    newest = checkpoint_path(root, 20)
    part = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    restored = load_newest_intact(root, rank=1)
    assert restored.path == checkpoint_path(root, 10)
    assert torch.equal(restored.tensors["global.w"], rank_state(1, 10)["global.w"])
    assert [(p.name, part.name in why) for p, why in restored.rejected] == [
        ("corrupt-step-0000020", True)]


def test_a_rank_the_checkpoint_lacks_is_told_to_keep_the_ranks_per_worker(written):
    with pytest.raises(CheckpointError, match="same --ranks-per-worker"):
        load_checkpoint(checkpoint_path(written, 20), rank=2)


def test_no_temporary_directory_is_left(written):
    assert not [p for p in written.iterdir() if p.name.startswith(".")]
    assert os.path.isdir(checkpoint_path(written, 10))


def test_a_replica_whose_state_the_parts_do_not_fit_is_told_which_to_resume_with(written):
    """Each rank's part is its own shard: a one-rank replica cuts the parts again for itself
    (farlink.parallel.reshard), and parts that are not of its state (another model) are refused,
    never read as the whole model."""
    import farlink

    model = torch.nn.Linear(4, 1)
    sync = farlink.Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             backend="inprocess", algorithm="diloco", steps=10, inner_steps=5)
    with pytest.raises(ValueError, match="replica group of 2 ranks.*--ranks-per-worker 2"):
        sync.load(written)
    sync.close()


def _rank_on_a_small_disk(rank: int, root: str, queue) -> None:  # noqa: ANN001
    import torch.distributed as dist

    from farlink.state.checkpoint import DiskFull

    big = {"global.w": torch.full((1_000_000,), float(rank))}  # 4 MB per rank and step
    outcomes = []
    for step in (10, 20):
        try:
            save_sharded_checkpoint(Path(root), step, big, replica_group_meta(step), rank,
                                    dist.group.WORLD)
            outcomes.append("saved")
        except DiskFull as exc:
            outcomes.append(f"disk full: {exc}")
        except Exception as exc:  # reported to the test, which names it
            outcomes.append(f"{type(exc).__name__}: {str(exc)[-300:]}")
    queue.put((rank, outcomes))
    queue.close()
    queue.join_thread()  # the outcome is delivered before this process leaves
    dist.destroy_process_group()
    os._exit(0)  # as a replica group's rank leaves (farlink.worker.exit_process): no teardown


def test_a_full_disk_stops_every_rank_and_keeps_the_previous_step(ranks: dict) -> None:
    """Room for one step (8 MB) but not two: both ranks raise DiskFull, naming the directory,
    the partial write is removed, and the step before stays the newest and loads."""
    if ranks["no_disk"]:
        pytest.skip(ranks["no_disk"])
    root, outcomes = ranks["small_root"], ranks["outcomes"]
    assert ranks["exitcodes"] == [0, 0]
    for rank in (0, 1):
        assert outcomes[rank][0] == "saved"
        assert outcomes[rank][1].startswith(f"disk full: disk full writing checkpoint under "
                                            f"{root}"), outcomes
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-0000010"]
    assert (root / "LATEST").read_text() == "step-0000010"
    tensors, _ = load_checkpoint(root / "step-0000010", rank=1)
    assert torch.equal(tensors["global.w"], torch.ones(1_000_000))


def test_a_replica_group_beside_per_rank_checkpoints_of_the_earlier_layout_refuses_to_start_over(
        tmp_path):
    """A replica group's run dir that holds only ``rankR/step-N`` checkpoints (the layout before
    one DCP directory per step) is refused with what to do, never resumed from the initial
    state."""
    import types

    import torch.distributed as dist

    import farlink

    root = tmp_path / "w0"
    (root / "rank0" / "step-0000020").mkdir(parents=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        replica = types.SimpleNamespace(replica_group=types.SimpleNamespace(
            rank=0, gloo_group=lambda: dist.group.WORLD))
        with pytest.raises(ValueError, match="earlier layout.*new --run-dir"):
            farlink.Optimizer._load_replica_group(replica, root)
        (root / "rank0" / "step-0000020").rmdir()  # an empty run dir is a fresh start
        assert farlink.Optimizer._load_replica_group(replica, root) is None
    finally:
        dist.destroy_process_group()
