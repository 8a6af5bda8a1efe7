"""``farlink bench backends``' round means, computed by hand from metrics files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farlink.bench.backends import round_means


def test_round_means_tell_the_backends_cost_from_the_wait_for_stragglers(tmp_path: Path) -> None:
    # two rounds, three workers; the last to arrive waits for nobody (the smallest round_s)
    rounds = {"w0": [1.0, 2.0], "w1": [0.25, 1.5], "w2": [0.5, 0.75]}
    (tmp_path / "metrics").mkdir()
    for worker, seconds in rounds.items():
        lines = [{"kind": "step", "worker": worker, "step": 1}]
        lines += [{"kind": "sync", "committed": True, "round_s": s} for s in seconds]
        lines.append({"kind": "sync", "committed": False, "round_s": 9.0})  # not a round
        (tmp_path / "metrics" / f"{worker}.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in lines))
    means = round_means(tmp_path)
    assert means["rounds"] == 2
    assert means["mean_round_s"] == pytest.approx(1.5)  # worker 0: (1 + 2) / 2
    assert means["mean_round_s_all"] == pytest.approx(6.0 / 6)
    assert means["mean_last_arrival_round_s"] == pytest.approx((0.25 + 0.75) / 2)
