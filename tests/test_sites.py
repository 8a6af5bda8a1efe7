"""Sites of several ranks: FSDP2 (Gloo, CPU) inside each site, DiLoCo across, through torchft.

Real processes throughout: a torchft Lighthouse, each site a ``torchrun`` of 2 ranks that shard a
GPT with ``fully_shard``, and the same replicas run unsharded (one process per site) for the
comparison. The kill test SIGKILLs one rank of one site mid-run; torchrun restarts that site,
which resumes from the newest checkpoint all its ranks hold while the other site goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procfs import descendants

pytest.importorskip("torchft")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_sites.py"


def run_sites(workdir: Path, *args: str, timeout: float = 400) -> tuple[list[dict], str]:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--workdir", str(workdir), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return sorted(results, key=lambda r: r["site"]), proc.stdout


def test_two_sites_of_two_ranks_train_what_unsharded_sites_train(tmp_path):
    steps = ["--sites", "2", "--steps", "30", "--inner-steps", "10", "--batch", "8"]
    sharded, _ = run_sites(tmp_path / "k2", *steps, "--ranks", "2")
    plain, _ = run_sites(tmp_path / "k1", *steps, "--ranks", "1")
    assert [r["ranks"] for r in sharded] == [2, 2] and [r["ranks"] for r in plain] == [1, 1]
    # replicas identical across sites, shard by shard
    assert sharded[0]["fingerprints"] == sharded[1]["fingerprints"]
    assert len(set(sharded[0]["fingerprints"])) == 2  # two different shards
    assert plain[0]["fingerprints"] == plain[1]["fingerprints"]
    assert all(r["outer_steps"] == 3 for r in sharded + plain)
    # the same model from the same batches: FSDP2 over 2 ranks changes reduction order only
    heldout_k2, heldout_k1 = sharded[0]["heldout"], plain[0]["heldout"]
    assert abs(heldout_k2 - heldout_k1) <= 1e-4 * heldout_k1, (heldout_k2, heldout_k1)
    # each rank sends only its shard: a site moves what one unsharded replica moves
    site_k2, site_k1 = sharded[0]["site_bytes_sent"], plain[0]["site_bytes_sent"]
    assert abs(site_k2 - site_k1) <= 1e-3 * site_k1, (site_k2, site_k1)


def _site_ranks(root: int, site: int) -> list[int]:
    """PIDs of the training ranks of site ``site`` (torchrun's children) below ``root``."""
    ranks = []
    for pid in descendants(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"--site-worker" in cmdline and b"torch.distributed.run" not in cmdline
                and f"REPLICA_GROUP_ID={site}".encode() in environ
                and any(e.startswith(b"LOCAL_RANK=") for e in environ)):
            ranks.append(pid)
    return ranks


def test_a_site_whose_rank_is_sigkilled_restarts_and_rejoins(tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--workdir", str(workdir), "--sites", "2", "--ranks", "2",
         "--steps", "60", "--inner-steps", "10", "--min-replicas", "1", "--max-restarts", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # wait until site 1 has committed and checkpointed two rounds on both ranks
        deadline = time.time() + 240
        marker = workdir / "site1" / "rank1" / "step-0000020"
        while not marker.is_dir():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        victims = _site_ranks(proc.pid, site=1)
        assert len(victims) == 2, victims
        os.kill(max(victims), signal.SIGKILL)  # one rank of site 1, mid-run
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    results = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")),
                     key=lambda r: r["site"])
    survivor, restarted = results
    assert restarted["restarts"] == 1 and survivor["restarts"] == 0
    # the restarted site resumed from a checkpoint every rank held, not from scratch
    assert restarted["resumed_at"] is not None and restarted["resumed_at"] >= 20
    # nothing committed was lost: every round of the run committed, both sites hold the result
    assert survivor["outer_steps"] == restarted["outer_steps"] == 6
    assert survivor["fingerprints"] == restarted["fingerprints"]
