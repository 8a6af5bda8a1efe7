"""Checkpoints resume exactly: an interrupted-and-resumed run ends bit-identical to an
uninterrupted one on the same schedule (parameters, optimizer states, data position, RNG)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from farlink.config import load_config
from farlink.train.checkpoint import latest_checkpoint, load_checkpoint
from farlink.train.launcher import launch

BASE = {"vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2, "workers": 2,
        "steps": 40, "inner_steps": 10, "warmup_steps": 5, "join_timeout": 10}


def test_resumed_run_matches_uninterrupted_run_bit_for_bit(tmp_path: Path,
                                                           cache_dir: Path) -> None:
    straight = load_config(None, {**BASE, "run_dir": tmp_path / "a", "cache_dir": cache_dir})
    assert launch(straight, show_progress=False).returncodes == [0, 0]

    cut = load_config(None, {**BASE, "run_dir": tmp_path / "b", "cache_dir": cache_dir,
                             "stop_at_step": 20})
    first = launch(cut, show_progress=False)
    assert first.returncodes == [0, 0]
    assert not (cut.run_dir / "final").exists()  # it really stopped early
    _, meta = load_checkpoint(latest_checkpoint(cut.run_dir / "checkpoints" / "w0"))
    assert meta["inner_steps"] == 20 and meta["outer_step"] == 2

    resumed = load_config(None, {**BASE, "run_dir": tmp_path / "b", "cache_dir": cache_dir,
                                 "resume": True})
    assert launch(resumed, show_progress=False).returncodes == [0, 0]
    for worker in ("w0", "w1"):
        a = load_file(str(straight.run_dir / "final" / f"{worker}.safetensors"))
        b = load_file(str(resumed.run_dir / "final" / f"{worker}.safetensors"))
        assert a.keys() == b.keys()
        for name in a:
            assert (a[name] == b[name]).all(), f"{worker}:{name} differs after resume"
