"""Sites of several ranks on the hivemind backend, through ``farlink train``.

Real processes: a bootstrap DHT peer, each site a ``torchrun`` of 2 ranks that shard a GPT with
``fully_shard`` over Gloo, every rank with its own p2p daemon; the site's rank 0 matchmakes and
votes, and rank r exchanges its shard with rank r of the other site. The same run with one rank
per site is the reference: same batches, same arithmetic (the gathered path decodes the same
bytes on every site), so FSDP2 changes only the order of floating-point reductions inside a
step, which is why the held-out losses agree to 1e-4 as on torchft.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("hivemind")

SITE_RUN = {"workers": 2, "steps": 20, "inner_steps": 10, "warmup_steps": 10, "batch_size": 8,
            "vocab_size": 512, "seq_len": 64, "eval_batches": 4, "backend": "hivemind"}


def site_run(tmp_path: Path, cache_dir: Path, name: str, **overrides):
    from farlink.config import load_config
    from farlink.train.launcher import launch

    cfg = load_config(None, {**SITE_RUN, "run_dir": tmp_path / name, "cache_dir": cache_dir,
                             **overrides})
    return cfg, launch(cfg, show_progress=False)


def test_two_sites_of_two_ranks_on_hivemind_match_one_rank_sites(tmp_path, cache_dir):
    from safetensors.torch import load_file

    cfg2, sites = site_run(tmp_path, cache_dir, "k2", ranks_per_worker=2)
    _, plain = site_run(tmp_path, cache_dir, "k1")
    assert sites.returncodes == [0, 0] and plain.returncodes == [0, 0]
    s2, s1 = sites.summary, plain.summary
    # each site one member of every group: both rounds averaged the two sites, never 4 peers
    assert s2["widest_group"] == 2 and s2["final_replicas"]["consistent"], s2["final_replicas"]
    assert [s[0] for s in s2["final_replicas"]["states"].values()] == [2, 2]
    # every rank of both sites holds the same shards: the whole models gathered from them agree
    a, b = (load_file(str(cfg2.run_dir / "final" / f"w{i}.safetensors")) for i in range(2))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    loss2, loss1 = s2["final_heldout_loss"], s1["final_heldout_loss"]
    assert abs(loss2 - loss1) <= 1e-4 * loss1, (loss2, loss1)
    # each rank sends only its shard: a site moves what a one-rank site moves (each rank's
    # payload carries its own small header, hence not bit-equal)
    for worker in ("w0", "w1"):
        bytes2 = s2["per_worker"][worker]["bytes_sent"]
        bytes1 = s1["per_worker"][worker]["bytes_sent"]
        assert abs(bytes2 - bytes1) <= 1e-3 * bytes1, (worker, bytes2, bytes1)
