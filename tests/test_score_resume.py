"""A member's record of its peers survives restarts: the ledger (credits, marks), the loss
scores' ratings and the updates a replay is compared with are in the checkpoint (farlink's own,
and a framework's: ``Optimizer.state_dict``), so a run resumed (every member restarted) weighs
an attacker by its whole record, as the run that never stopped does. Workers as threads: torchft's real Lighthouse and Gloo in one process."""

from __future__ import annotations

import io
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
def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seqs = (torch.randint(0, 64, (4, 1), generator=gen) + torch.arange(17)) % 64
    return seqs[:, :-1], seqs[:, 1:]


class Reversed:
    """w3's attack: 4 x its update reversed, until the test turns it honest."""

    def __init__(self) -> None:
        self.honest = False

    def __call__(self, update: dict, round_id: int) -> dict:
        return update if self.honest else {k: -4 * v for k, v in update.items()}


def _replica(rank: int, collective, harmful: bool, start, seed: int = 0):
    """Replica ``w{rank}`` of four (DiLoCo, 2 inner steps, a loss scorer over the algorithm's
    global parameters); ``w3`` sends 4 x its update reversed while ``harmful``."""
    import farlink
    from farlink.compose import global_params_of
    from farlink.model import GPT, preset_config
    from farlink.robust.score import LossScorer

    with start:  # torch's RNG is the process's: one replica at a time, all from one init
        torch.manual_seed(seed)
        model = GPT(preset_config("nano", vocab_size=64, seq_len=16))
    # the scorer reads the global parameters of the algorithm built below when it scores
    scorer = LossScorer(model, global_params_of(lambda: sync.algorithm),
                        lambda peer, r: _batch(1000 + int(peer[1:])), _batch(999))
    sync = farlink.Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                             collective=collective, index=rank, backend="inprocess",
                             algorithm="diloco", inner_steps=2, steps=100, codec="int8",
                             scorer=scorer, tamper=Reversed() if rank == 3 and harmful else None)
    return model, sync


def _train(rank: int, model, sync, steps: range) -> list[tuple[bool, float]]:
    """Train ``steps``; how each committed round judged ``w3`` (kept?, its rating)."""
    judged = []
    for step in steps:
        _, loss = model(*_batch(100 * rank + step))
        loss.backward()
        outcome = sync.step(tokens=64)
        if outcome is not None and outcome.committed:
            last = sync.algorithm.last_exchange
            judged.append(("w3" in last.accepted, last.scores["w3"][1]))
    return judged


def _member(rank: int, collective, ckpt: Path, steps: range, harmful: bool, start=None):
    """Loads its checkpoint, trains ``steps``, saves. Returns how each round judged ``w3``."""
    model, sync = _replica(rank, collective, harmful, start)
    sync.load(ckpt / f"w{rank}")
    judged = _train(rank, model, sync, steps)
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


# --- the same records through a framework's checkpoint (state_dict, torch.save) ---------------
HARMFUL_STEPS, ALL_STEPS = 6, 8  # w3 harms the first three rounds, then sends honest updates


def _framework_checkpoint(model, sync) -> bytes:
    """What HF Trainer / Lightning write: the model's and the optimizer's state dicts."""
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": sync.state_dict()}, saved)
    return saved.getvalue()


def _straight(rank: int, collective, start):
    """The run that never stops; its framework checkpoint when w3 turns honest."""
    model, sync = _replica(rank, collective, True, start)
    judged = _train(rank, model, sync, range(HARMFUL_STEPS))
    saved = _framework_checkpoint(model, sync)
    if sync.exchange.tamper is not None:  # w3 turns honest (it sends its update as it is)
        sync.exchange.tamper.honest = True
    judged += _train(rank, model, sync, range(HARMFUL_STEPS, ALL_STEPS))
    sync.close()
    return judged, saved, sync.ledger.to_dict()


def _resumed(rank: int, collective, start, saved: bytes):
    """A fresh replica (another initial model) resumed as a framework resumes it."""
    model, sync = _replica(rank, collective, False, start, seed=7)
    checkpoint = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(checkpoint["model"])
    sync.load_state_dict(checkpoint["optimizer"])
    judged = _train(rank, model, sync, range(HARMFUL_STEPS, ALL_STEPS))
    sync.close()
    return judged, sync.ledger.to_dict()


@pytest.fixture(scope="module")
def straight_run() -> list:
    import threading

    from farlink.comm.inprocess import InProcessGroup

    start = threading.Lock()
    return InProcessGroup(4).run(lambda r, c: _straight(r, c, start), timeout=120)


def test_a_framework_resumed_member_keeps_its_record_of_an_attacker(straight_run: list):
    """Every member's optimizer goes through state_dict -> torch.save -> torch.load(weights_only)
    -> a fresh optimizer's load_state_dict after w3 harmed three rounds: w3 stays left out of
    the first round after the restart, at the rating the run that never stopped gives it, and
    every peer's record (credits, rounds, rejections, ratings) ends as that run's does."""
    import threading

    from farlink.comm.inprocess import InProcessGroup

    start = threading.Lock()
    resumed = InProcessGroup(4).run(
        lambda r, c: _resumed(r, c, start, straight_run[r][1]), timeout=120)
    for rank in range(3):
        before, after = straight_run[rank][0], resumed[rank][0]
        assert [kept for kept, _ in before[:3]] == [False] * 3 and before[2][1] < 0
        kept, rating = after[0]
        assert not kept and rating < 0.25, after  # a member that forgot w3 took it back
        assert after == before[3:]
        straight, again = straight_run[rank][2]["peers"], resumed[rank][1]["peers"]
        assert again["w3"]["rejections"].get("score", 0) >= 4
        for peer in ("w0", "w1", "w2", "w3"):
            assert again[peer]["tokens_credited"] == straight[peer]["tokens_credited"], peer
        assert again == straight


def test_a_framework_checkpoint_with_a_tampered_record_is_refused(straight_run: list):
    """A rating outside [-1, 1], or a record that does not parse, in a framework's checkpoint
    is refused by load_state_dict, and the replica keeps its state and records as they were;
    a checkpoint of an older farlink (no records) loads and restores none."""
    import threading

    start = threading.Lock()

    def fresh():  # noqa: ANN202
        model, sync = _replica(0, None, False, start, seed=7)
        return sync, sync.fingerprint()

    def saved() -> dict:
        return torch.load(io.BytesIO(straight_run[0][1]), weights_only=True)["optimizer"]

    tampered = saved()
    assert tampered["farlink"]["trust"]["scorer"]["ratings"]["w3"] < 0
    tampered["farlink"]["trust"]["scorer"]["ratings"]["w3"] = 5.0
    sync, fingerprint = fresh()
    with pytest.raises(ValueError, match=r"ratings out of \[-1, 1\] for w3"):
        sync.load_state_dict(tampered)
    assert sync.exchange.scorer.ratings == {} and sync.ledger.peers() == []
    assert sync.fingerprint() == fingerprint and sync.outer_step == 0
    sync.close()

    for break_it in (lambda trust: trust["ledger"].pop("peers"),
                     lambda trust: trust.pop("replays"),
                     lambda trust: trust["replays"][0][1].append("w9")):
        malformed = saved()
        break_it(malformed["farlink"]["trust"])
        sync, fingerprint = fresh()
        with pytest.raises(ValueError, match="record of this member's peers is refused"):
            sync.load_state_dict(malformed)
        assert sync.exchange.scorer.ratings == {} and sync.ledger.peers() == []
        assert sync.exchange.replays.state() == ([], {})
        assert sync.fingerprint() == fingerprint
        sync.close()

    older = saved()
    del older["farlink"]["trust"]
    older["farlink"]["tensors"] = {k: v for k, v in older["farlink"]["tensors"].items()
                                   if not k.startswith("trust.")}
    sync, _ = fresh()
    sync.load_state_dict(older)
    assert sync.outer_step == 3 and sync.exchange.scorer.ratings == {}
    assert sync.ledger.peers() == []
    sync.close()
