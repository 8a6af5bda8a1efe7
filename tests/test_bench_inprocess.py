"""The in-process variant runner: real algorithms, exact bytes, replicas in agreement."""

from __future__ import annotations

from pathlib import Path

from farlink.bench.inprocess import train_in_process
from farlink.comm.base import ring_allreduce_bytes


def test_ddp_row_has_exact_bytes_and_agreeing_replicas(cache_dir: Path) -> None:
    row = train_in_process("ddp", {"algorithm": "ddp", "workers": 2, "steps": 3, "warmup_steps": 1,
                                   "batch_size": 2, "seq_len": 16, "vocab_size": 300,
                                   "eval_batches": 1, "cache_dir": cache_dir}, eval_points=1)
    assert len(set(row["worker_losses"])) == 1  # DDP replicas hold the same parameters
    params = row["params"]
    # every step all-reduces the gradients plus the token weight, in fp32
    assert row["bytes_per_worker"] == 3 * ring_allreduce_bytes(4 * (params + 1), 2)
    assert row["tokens_per_worker"] == 3 * 2 * 16
    assert [e["step"] for e in row["evals"]] == [3]
