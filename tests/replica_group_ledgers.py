"""What every rank of a run of two 2-rank replica groups must have recorded about its peers'
updates."""

from __future__ import annotations

import json
from pathlib import Path


def assert_every_rank_accepted(run_dir: Path, updates: int) -> None:
    """One ledger per rank (w0, w1 and their rank 1), each listing both replica groups, every update
    accepted and none rejected."""
    ledgers = sorted(p.name for p in (run_dir / "ledger").iterdir())
    assert ledgers == ["w0.json", "w0.rank1.json", "w1.json", "w1.rank1.json"]
    for name in ledgers:
        peers = json.loads((run_dir / "ledger" / name).read_text())["peers"]
        assert sorted(peers) == ["w0", "w1"], (name, peers)
        assert all(p["updates_accepted"] == updates and p["updates_rejected"] == 0
                   for p in peers.values()), (name, peers)
