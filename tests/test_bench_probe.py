"""``farlink bench probe --outer-lr X`` over variants of which some have no outer step."""

from __future__ import annotations

from pathlib import Path

from farlink.bench.algorithms import probe


def test_outer_lr_goes_to_the_variants_that_read_it(tmp_path: Path) -> None:
    """The config refuses an option its algorithm ignores, so the probe hands ``outer_lr`` to
    DiLoCo's variants and not to DDP's: both train, and DiLoCo's row carries the given lr."""
    result = probe(tmp_path, steps=4, inner_steps=2, workers=2, only=["ddp", "diloco-H2"],
                   extra={"outer_lr": 0.5, "warmup_steps": 1, "eval_batches": 1,
                          "model": "nano", "seq_len": 16, "batch_size": 2})
    rows = {r["label"]: r for r in result["rows"]}
    assert set(rows) == {"ddp", "diloco-H2"}
    assert rows["diloco-H2"]["config"]["outer_lr"] == 0.5
    assert rows["ddp"]["config"].get("outer_lr") != 0.5
    assert all(r["config"]["warmup_steps"] == 1 for r in rows.values())
