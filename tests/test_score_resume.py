"""A member's record of its peers survives restarts: the ledger (credits, marks), the loss
scores' ratings and the updates a replay is compared with are in the checkpoint, so a run
resumed (every member restarted) weighs an attacker by its whole record, as the run that never
stopped does. Workers as threads: torchft's real Lighthouse and Gloo in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from farlink.config import load_config
from farlink.state.checkpoint import latest_checkpoint, load_checkpoint
from farlink.testing.runs import launch_in_threads

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

BASE = {"model": "nano", "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2,
        "workers": 3, "steps": 12, "inner_steps": 2, "warmup_steps": 2, "join_timeout": 10,
        "min_replicas": 3, "score": "loss", "attack": "ipm:4", "attackers": "2"}


def _ledger(run_dir: Path, worker: str) -> dict:
    return json.loads((run_dir / "ledger" / f"{worker}.json").read_text())["peers"]


def test_a_resumed_scored_run_keeps_the_attackers_record(tmp_path: Path, cache_dir: Path):
    straight = load_config(None, {**BASE, "run_dir": tmp_path / "a", "cache_dir": cache_dir})
    assert launch_in_threads(straight).returncodes == [0, 0, 0]

    cut = load_config(None, {**BASE, "run_dir": tmp_path / "b", "cache_dir": cache_dir,
                             "stop_at_step": 6})
    assert launch_in_threads(cut).returncodes == [0, 0, 0]
    assert not (cut.run_dir / "final").exists()  # it really stopped early
    _, meta = load_checkpoint(latest_checkpoint(cut.run_dir / "checkpoints" / "w0"))
    assert meta["outer_step"] == 3 and meta["trust"]["scorer"]["ratings"]["w2"] < 0.25
    resumed = load_config(None, {**BASE, "run_dir": tmp_path / "b", "cache_dir": cache_dir,
                                 "resume": True})
    assert launch_in_threads(resumed).returncodes == [0, 0, 0]

    for honest in ("w0", "w1"):
        a, b = _ledger(straight.run_dir, honest), _ledger(resumed.run_dir, honest)
        # the attacker's record holds every round, before the restart and after it
        assert b["w2"]["rounds"] == a["w2"]["rounds"] == 6
        assert b["w2"]["rejections"] == a["w2"]["rejections"]
        assert b["w2"]["rejections"].get("score", 0) >= 4
        assert b["w2"]["rating"] == a["w2"]["rating"] < 0.25
        assert b["w2"]["tokens_credited"] == a["w2"]["tokens_credited"]
        assert b["w0"]["tokens_credited"] == a["w0"]["tokens_credited"] > 0
    for worker in ("w0", "w1"):  # so the aggregates were the same: one model at the end
        a = load_file(str(straight.run_dir / "final" / f"{worker}.safetensors"))
        b = load_file(str(resumed.run_dir / "final" / f"{worker}.safetensors"))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[name], b[name]) for name in a), f"{worker} differs"


# --- the library: farlink.Optimizer's checkpoint, members as threads ----------------------------
def _member(rank: int, collective, ckpt: Path, steps: range, harmful: bool, start=None):
    """Replica ``w{rank}`` of four (DiLoCo, 2 inner steps, a loss scorer over the algorithm's
    global parameters): loads its checkpoint, trains ``steps``, saves; ``w3`` sends 4 x its
    update reversed while ``harmful``. Returns how each round judged ``w3``."""
    import farlink
    from farlink.compose import global_params_of
    from farlink.model import GPT, preset_config
    from farlink.robust.score import LossScorer

    def batch(seed: int):
        gen = torch.Generator().manual_seed(seed)
        seqs = (torch.randint(0, 64, (4, 1), generator=gen) + torch.arange(17)) % 64
        return seqs[:, :-1], seqs[:, 1:]

    with start:  # torch's RNG is the process's: one replica at a time, all from one init
        torch.manual_seed(0)
        model = GPT(preset_config("nano", vocab_size=64, seq_len=16))
    # the scorer reads the global parameters of the algorithm built below when it scores
    scorer = LossScorer(model, global_params_of(lambda: sync.algorithm),
                        lambda peer, r: batch(1000 + int(peer[1:])), batch(999))
    sync = farlink.Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                             collective=collective, index=rank, backend="inprocess",
                             algorithm="diloco", inner_steps=2, steps=100, codec="int8",
                             scorer=scorer)
    alg = sync.algorithm
    if rank == 3 and harmful:
        sync.exchange.tamper = lambda update, round_id: {k: -4 * v for k, v in update.items()}
    sync.load(ckpt / f"w{rank}")
    judged = []
    for step in steps:
        _, loss = model(*batch(100 * rank + step))
        loss.backward()
        outcome = sync.step(tokens=64)
        if outcome is not None and outcome.committed:
            last = alg.last_exchange
            judged.append(("w3" in last.accepted, last.scores["w3"][1]))
    sync.save(ckpt / f"w{rank}")
    sync.close()
    return judged


def test_a_restarted_member_keeps_discounting_an_attacker_that_turns_honest(tmp_path: Path):
    """w3 harms three rounds (rated -1), then every member restarts from its checkpoint and w3
    sends honest updates: with its record, its rating climbs from -1 and it stays left out of
    the first round after the restart; a member that forgot it would take it back at once."""
    import threading

    from farlink.comm.inprocess import InProcessGroup

    start = threading.Lock()
    before = InProcessGroup(4).run(
        lambda r, c: _member(r, c, tmp_path, range(6), True, start), timeout=120)
    after = InProcessGroup(4).run(
        lambda r, c: _member(r, c, tmp_path, range(6, 8), False, start), timeout=120)
    for rank in range(3):
        assert [kept for kept, _ in before[rank]] == [False] * 3
        assert before[rank][-1][1] < 0
        kept, rating = after[rank][0]
        assert not kept and rating < 0.25, after[rank]
