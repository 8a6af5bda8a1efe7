"""After-the-fact checks of a run from its metrics: did replicas agree, was anything lost?

Every committed round logs a fingerprint of the committed state. A run is consistent when, for
every outer step, all workers that logged it logged the same fingerprint (no divergent replica, no
update applied twice: a double application would give a different state for the same step
number), and the committed outer steps seen by the run form one contiguous sequence (none lost).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from farlink.train.metrics import read_metrics


def audit_run(run_dir: Path) -> dict:
    fingerprints: dict[int, set[str]] = defaultdict(set)
    per_worker_steps: dict[str, list[int]] = defaultdict(list)
    evals, restarts = [], 0
    for path in sorted((run_dir / "metrics").glob("w*.jsonl")):
        starts = 0
        for r in read_metrics(path):
            if r["kind"] == "sync" and r.get("committed"):
                fingerprints[r["outer_step"]].add(r["fingerprint"])
                per_worker_steps[path.stem].append(r["outer_step"])
            elif r["kind"] == "start":
                starts += 1
            elif r["kind"] == "eval":
                evals.append(r)
        restarts += max(0, starts - 1)
    steps = sorted(fingerprints)
    divergent = {s: sorted(f) for s, f in fingerprints.items() if len(f) > 1}
    missing = sorted(set(range(1, steps[-1] + 1)) - set(steps)) if steps else []
    repeated = {w: s for w, s in per_worker_steps.items() if len(s) != len(set(s))}
    evals.sort(key=lambda r: (r["time"]))
    return {
        "outer_steps": steps[-1] if steps else 0,
        "divergent_steps": divergent,
        "missing_steps": missing,
        "repeated_steps": repeated,
        "consistent": not divergent and not missing and not repeated,
        # committed rounds that were lost and redone: a gap in, or a rewind of, the sequence
        "lost_committed_steps": len(missing),
        "restarts": restarts,
        "first_eval_loss": evals[0]["loss"] if evals else None,
        "last_eval_loss": evals[-1]["loss"] if evals else None,
    }
