"""``farlink bench scale`` on a small budget: the table holds measured bytes per peer per round
on the picked path and on today's gathered path, and the JSON and PNG are written."""

from __future__ import annotations

import json
from pathlib import Path

from farlink.bench.scale import run


def test_scale_rows_compare_the_compressed_all_reduce_with_the_gathered_path(
        tmp_path: Path, cache_dir: Path) -> None:
    result = run(tmp_path, peers=[3], codecs=["int8+ef", "sparseloco"], rules=["mean"], steps=2,
                 inner_steps=1, baseline_peers=[3], link=None,
                 extra={"vocab_size": 300, "seq_len": 16, "eval_batches": 1, "warmup_steps": 1,
                        "cache_dir": cache_dir})
    rows = {(r["codec"], r["asked"]): r for r in result["rows"]}
    auto, gathered = rows[("int8+ef", "auto")], rows[("int8+ef", "gathered")]
    assert auto["path"] == "allreduce" and gathered["path"] == "gathered"
    assert auto["rounds"] == gathered["rounds"] == 2
    # 2 (n-1)/n = 4/3 payloads against (n-1) = 2: two thirds, headers included
    assert 1.0 <= auto["ratio_to_ideal"] <= 1.10
    assert 0.66 <= auto["bytes_vs_gathered"] <= 0.70
    assert abs(auto["loss_vs_gathered"]) < 0.005
    assert rows[("sparseloco", "auto")]["path"] == "gathered"
    assert ("sparseloco", "gathered") not in rows  # its only path
    assert json.loads((tmp_path / "scale.json").read_text())["rows"] == result["rows"]
    assert (tmp_path / "scale.png").stat().st_size > 10_000
