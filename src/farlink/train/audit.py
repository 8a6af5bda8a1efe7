"""After-the-fact checks of a run from its metrics: did replicas agree, was anything lost?

Every committed round logs a fingerprint of the committed state. A run is consistent when, for
every outer step, all workers that logged it logged the same fingerprint (no divergent replica, no
update applied twice: a double application would give a different state for the same step
number), and the committed outer steps seen by the run form one contiguous sequence (none lost).

In groups smaller than the swarm (hivemind ``--group-size``, Moshpit), two groups commit one
outer step with different states by design, and each record names its group: there a step
diverges only when members of one group logged different states, and the run's last step, one
group of the whole swarm, must have one state. Steps that several groups committed apart are
reported as ``group_steps``.

A worker may log the same outer step twice without anything being wrong: when its checkpoint of a
committed round could not be written (a full disk, a kill between the log line and the save), it
resumes from the round before and computes that round again. Deterministic training redoes it bit
for bit, so the second record carries the same fingerprint: a *redone* step, reported (it is work
done twice) but consistent. The same step logged with another fingerprint is a divergence.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from farlink.train.metrics import read_metrics


def audit_run(run_dir: Path) -> dict:
    fingerprints: dict[int, set[str]] = defaultdict(set)
    by_group: dict[tuple[int, str | None], set[str]] = defaultdict(set)
    per_worker_steps: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    evals, restarts = [], 0
    for path in sorted((run_dir / "metrics").glob("w*.jsonl")):
        starts = 0
        for r in read_metrics(path):
            if r["kind"] == "sync" and r.get("committed"):
                fingerprints[r["outer_step"]].add(r["fingerprint"])
                by_group[(r["outer_step"], r.get("group"))].add(r["fingerprint"])
                per_worker_steps[path.stem][r["outer_step"]].append(r["fingerprint"])
            elif r["kind"] == "start":
                starts += 1
            elif r["kind"] == "eval":
                evals.append(r)
        restarts += max(0, starts - 1)
    steps = sorted(fingerprints)
    apart = {s for (s, _), f in by_group.items() if len(f) > 1}  # one group, several states
    if steps and len(fingerprints[steps[-1]]) > 1:
        apart.add(steps[-1])  # the run ends on one model whatever its groups
    divergent = {s: sorted(fingerprints[s]) for s in sorted(apart)}
    group_steps = {s: sorted(f) for s, f in fingerprints.items() if len(f) > 1 and s not in apart}
    missing = sorted(set(range(1, steps[-1] + 1)) - set(steps)) if steps else []
    twice = {w: {s: f for s, f in logged.items() if len(f) > 1}
             for w, logged in per_worker_steps.items()}
    # the same state twice is a redo; two states for one step of one worker is not
    redone = {w: sorted(s for s, f in t.items() if len(set(f)) == 1) for w, t in twice.items()}
    repeated = {w: sorted(s for s, f in t.items() if len(set(f)) > 1) for w, t in twice.items()}
    redone = {w: s for w, s in redone.items() if s}
    repeated = {w: s for w, s in repeated.items() if s}
    evals.sort(key=lambda r: (r["time"]))
    return {
        "outer_steps": steps[-1] if steps else 0,
        "divergent_steps": divergent,
        "group_steps": group_steps,
        "missing_steps": missing,
        "repeated_steps": repeated,
        "redone_steps": redone,
        "consistent": not divergent and not missing and not repeated,
        # committed rounds that were lost and never recovered: a gap in the sequence
        "lost_committed_steps": len(missing),
        # committed rounds a worker computed again (to the same state) after losing its copy
        "redone_committed_steps": sum(len(s) for s in redone.values()),
        "restarts": restarts,
        "first_eval_loss": evals[0]["loss"] if evals else None,
        "last_eval_loss": evals[-1]["loss"] if evals else None,
    }
