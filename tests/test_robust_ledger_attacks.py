"""Attack emulation and the contribution ledger."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from rich.console import Console

from farlink.robust.attacks import make_attack
from farlink.robust.ledger import ContributionLedger
from farlink.robust.validate import UpdateRejected, check_update, screen_norms

torch.set_num_threads(1)

UPDATE = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5])}


def test_attacks_transform_as_documented():
    assert make_attack("none")(UPDATE, 0) is UPDATE
    assert torch.equal(make_attack("sign_flip")(UPDATE, 0)["w"], -UPDATE["w"])
    assert torch.equal(make_attack("scale:100")(UPDATE, 0)["w"], UPDATE["w"] * 100)
    assert torch.equal(make_attack("scale")(UPDATE, 0)["b"], UPDATE["b"] * 100)
    assert torch.isnan(make_attack("nan")(UPDATE, 0)["w"]).all()
    zeros = make_attack("free_rider")(UPDATE, 3)
    assert all(float(v.abs().sum()) == 0 and v.shape == UPDATE[k].shape
               for k, v in zeros.items())


def test_noise_is_seeded_per_round_and_has_the_asked_std():
    big = {"w": torch.zeros(20000)}
    a, b = make_attack("noise:2.5", seed=1), make_attack("noise:2.5", seed=1)
    r0, r0b, r1 = a(big, 0)["w"], b(big, 0)["w"], a(big, 1)["w"]
    assert torch.equal(r0, r0b) and not torch.equal(r0, r1)
    assert abs(float(r0.std()) - 2.5) < 0.1


def test_stale_free_rider_replays_its_first_update():
    rider = make_attack("free_rider:stale")
    first = rider(UPDATE, 0)
    later = rider({"w": torch.tensor([9.0, 9.0, 9.0]), "b": torch.tensor([9.0])}, 5)
    assert torch.equal(later["w"], UPDATE["w"]) and torch.equal(first["b"], later["b"])


@pytest.mark.parametrize("bad", ["nope", "scale:x", "noise:-1", "sign_flip:2", "free_rider:x"])
def test_unknown_attacks_are_refused(bad):
    with pytest.raises(ValueError):
        make_attack(bad)


def test_ledger_counts_tokens_and_reasons(tmp_path):
    ledger = ContributionLedger()
    gen = torch.Generator().manual_seed(0)
    for round_id in range(3):
        updates = {f"p{i}": torch.randn(20, generator=gen) for i in range(4)}
        updates["bad"] = make_attack("nan" if round_id < 2 else "scale:1000")(
            {"x": updates["p0"]}, round_id)["x"]
        sane = {}
        for peer, update in updates.items():  # the exchange's two checks, in its order
            try:
                check_update("x", update, (20,))
                sane[peer] = {"x": update}
            except UpdateRejected as exc:
                ledger.record_rejected(peer, round_id, 100.0, exc.reason)
        for peer, reason in screen_norms(sane, 10.0).items():
            del sane[peer]
            ledger.record_rejected(peer, round_id, 100.0, UpdateRejected(reason, "norm").reason)
        for peer in sane:
            ledger.record_accepted(peer, round_id, 100.0)
    bad, good = ledger.get("bad"), ledger.get("p1")
    assert (bad.updates_rejected, bad.updates_accepted, bad.tokens_accepted) == (3, 0, 0.0)
    assert bad.rejections == {"nonfinite": 2, "norm": 1} and bad.tokens_claimed == 300
    assert (good.updates_accepted, good.tokens_accepted, good.rounds) == (3, 300.0, 3)
    assert (good.first_round, good.last_round, good.acceptance) == (0, 2, 1.0)

    path = tmp_path / "ledger.json"
    ledger.save(path)
    again = ContributionLedger.load(path)
    assert again.to_dict() == ledger.to_dict()
    again.record_accepted("p1", 2, 50)  # same round again: tokens add, rounds do not
    assert again.get("p1").rounds == 3 and again.get("p1").tokens_accepted == 350

    console = Console(record=True, width=140)
    console.print(ledger.summary())
    text = console.export_text()
    assert "nonfinite x2" in text and "norm x1" in text and "p3" in text


def test_a_peer_scored_in_a_round_that_did_not_commit_is_saved(tmp_path):
    """A loss-scored round records each judged peer's score as it is rated, but credits its
    update only once the round commits (``Exchange.settle``): a peer scored in a round that
    failed has a score and no round yet. The ledger still saves and loads (a volunteer's
    checkpoint holds it; it failed with ``KeyError`` and the volunteer died)."""
    ledger = ContributionLedger()
    ledger.record_score("w0", 0.12, 0.23)
    ledger.record_rejected("w1", 0, 10.0, "score: discounted")
    path = tmp_path / "ledger.json"
    ledger.save(path)
    again = ContributionLedger.load(path)
    assert again.to_dict() == ledger.to_dict()
    scored = again.get("w0")
    assert (scored.score, scored.rating, scored.rounds, scored.updates_accepted) == (
        0.12, 0.23, 0, 0)
    again.record_accepted("w0", 1, 5.0)  # its first committed round counts as its first
    assert (again.get("w0").rounds, again.get("w0").first_round) == (1, 1)


def test_ledger_rejects_bad_files_and_values(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        ContributionLedger.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        ContributionLedger.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps({"version": 1, "peers": {"a": {"bogus": 1}}}))
    with pytest.raises(ValueError, match="corrupt"):
        ContributionLedger.load(tmp_path / "y.json")
    with pytest.raises(ValueError):
        ContributionLedger().record_accepted("a", 0, -1)
    with pytest.raises(KeyError):
        ContributionLedger().get("nobody")


def test_ledger_is_thread_safe():
    ledger = ContributionLedger()
    per_thread = 2000

    def work(t: int) -> None:
        for i in range(per_thread):
            if i % 4 == 0:
                ledger.record_rejected("shared", i, 1.0, "norm: too big")
            else:
                ledger.record_accepted("shared", i, 1.0)
            ledger.record_accepted(f"own{t}", i, 2.0)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    shared = ledger.get("shared")
    assert shared.updates_accepted == 8 * per_thread * 3 // 4
    assert shared.rejections == {"norm": 8 * per_thread // 4}
    assert shared.tokens_claimed == 8 * per_thread and shared.rounds == per_thread
    assert all(ledger.get(f"own{t}").tokens_accepted == 2.0 * per_thread for t in range(8))
