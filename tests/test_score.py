"""Contributions judged by what they do: adaptive attacks, loss scoring, accounting that cannot
be inflated, and the defaults of an open run."""

from __future__ import annotations

import pytest
import torch

from farlink.config import load_config
from farlink.model import GPT, preset_config
from farlink.robust.attacks import make_attack
from farlink.robust.score import LossScorer, ReplayCheck

torch.set_num_threads(1)

UPDATE = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5])}


def test_adaptive_attacks_use_what_they_received():
    alie, ipm, copycat = make_attack("alie:2"), make_attack("ipm:4"), make_attack("copycat")
    # before any round was received: ALIE has no spread (its own update), copycat sends zeros
    assert torch.equal(alie(UPDATE, 0)["w"], UPDATE["w"])
    assert float(copycat(UPDATE, 0)["w"].abs().sum()) == 0
    assert torch.equal(ipm(UPDATE, 0)["w"], -4 * UPDATE["w"])
    others = {"p1": {"w": torch.tensor([1.0, 0.0, 3.0]), "b": torch.tensor([1.0])},
              "p2": {"w": torch.tensor([3.0, 0.0, 3.0]), "b": torch.tensor([1.0])}}
    alie.observe(others, 0)
    copycat.observe(others, 0)
    spread = torch.stack([others["p1"]["w"], others["p2"]["w"]]).std(dim=0)
    assert torch.allclose(alie(UPDATE, 1)["w"], UPDATE["w"] - 2 * spread)
    assert torch.equal(alie(UPDATE, 1)["b"], UPDATE["b"])  # no spread there
    assert torch.equal(copycat(UPDATE, 1)["w"], others["p1"]["w"])
    inflate = make_attack("inflate:10")
    assert inflate(UPDATE, 0) is UPDATE and inflate.claim_factor == 10.0
    with pytest.raises(ValueError):
        make_attack("inflate:-1")


def test_replay_check_marks_zeros_and_copies_of_earlier_rounds_only():
    gen = torch.Generator().manual_seed(0)
    first = {p: {"x": torch.randn(5000, generator=gen)} for p in ("a", "b")}
    check = ReplayCheck()
    assert check.marks(first) == {}
    second = {"a": {"x": torch.randn(5000, generator=gen)},
              "b": {"x": torch.zeros(5000)},
              "c": {"x": first["a"]["x"] * 1.0001}}  # a copy, even re-quantized
    marks = check.marks(second)
    assert set(marks) == {"b", "c"}
    assert marks["b"].startswith("free_rider") and marks["c"].startswith("replay")
    assert "a's update" in marks["c"]


def test_a_round_tried_again_is_no_replay_of_itself():
    """A round that failed is tried again with the same honest updates: they repeat the first
    try's, not an earlier round's, and earn their credit; a copy from an earlier round is
    still caught after the retry."""
    gen = torch.Generator().manual_seed(1)
    round_3 = {p: {"x": torch.randn(5000, generator=gen)} for p in ("a", "b")}
    check = ReplayCheck()
    assert check.marks(round_3, 3) == {}
    assert check.marks(round_3, 3) == {}  # the retry of round 3
    round_4 = {"a": {"x": torch.randn(5000, generator=gen)}, "b": round_3["b"]}
    assert set(check.marks(round_4, 4)) == {"b"}


def _trained(model: GPT, batches: list, steps: int) -> dict[str, torch.Tensor]:
    """The pseudo-gradient of ``steps`` AdamW steps from ``model``'s parameters."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    local = GPT(model.config)
    local.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(local.parameters(), lr=3e-3)
    for inputs, targets in batches[:steps]:
        _, loss = local(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: start[n] - p.detach() for n, p in local.named_parameters()}


def test_scorer_ranks_by_loss_drop_and_spares_a_slow_peer():
    """Real model, real training: a peer that trained half as many steps (and claims half the
    tokens) scores like a full one; IPM, a free rider and an inflated claim do not."""
    torch.manual_seed(0)
    cfg = preset_config("tiny", vocab_size=64, seq_len=16)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(1)
    # a learnable language: each token is the previous one plus one
    starts = torch.randint(0, 64, (48, 1), generator=gen)
    seqs = (starts + torch.arange(17)) % 64
    batches = [(seqs[i:i + 4, :-1], seqs[i:i + 4, 1:]) for i in range(0, 40, 4)]
    heldout = (seqs[40:44, :-1], seqs[40:44, 1:])
    full, slow = _trained(model, batches, 8), _trained(model, batches[4:], 4)
    updates = {"full": full, "slow": slow, "ipm": {n: -4 * v for n, v in full.items()},
               "rider": {n: torch.zeros_like(v) for n, v in full.items()},
               "inflator": _trained(model, batches[2:], 8)}
    tokens = {"full": 8.0, "slow": 4.0, "ipm": 8.0, "rider": 8.0, "inflator": 80.0}
    base = {n: p.detach() for n, p in model.named_parameters()}
    scorer = LossScorer(model, lambda: base, lambda peer, r: batches[0], heldout)
    marks = ReplayCheck().marks(updates)
    verdicts = scorer.judge(0, updates, tokens, marks)
    assert verdicts["full"].drop > 0 and verdicts["slow"].drop > 0
    assert verdicts["slow"].score >= 0.5 and scorer.factor(verdicts["slow"].rating) >= 0.5
    assert verdicts["ipm"].drop < 0 and verdicts["ipm"].score < 0
    assert verdicts["ipm"].mark == "harmful"
    assert verdicts["rider"].score == 0.0 and verdicts["rider"].mark.startswith("free_rider")
    assert verdicts["inflator"].score < 0.25  # its true drop over its false claim
    for bad in ("ipm", "rider", "inflator"):
        assert scorer.factor(verdicts[bad].rating) == 0.0
    assert scorer.seconds > 0 and scorer.rounds == 1
    # its work in sequences run forward: the held-out batch at theta and at the round's median
    # step, and at that step plus each of the three distinct shares (8, 4 and 80 of 100 tokens)
    # of itself; then for each of the four measured peers (the free rider is marked, not
    # measured) its held-out batch moved, its shard batch at theta and moved, and the held-out
    # batch at the median step plus its share; and the long IPM step's three again at the usual
    # length
    assert scorer.sequences == 4 * (2 + 3 + 4 * 4 + 3)
    # ratings average over rounds: a peer that turns good climbs back, not at once
    again = scorer.judge(1, {"full": full, "ipm": full}, {"full": 8.0, "ipm": 8.0})
    assert -1.0 < again["ipm"].rating < again["full"].rating


class _Ridge(torch.nn.Module):
    """One parameter on a ridge: descending from w=0.5 toward the near valley at w=1 lowers
    the loss a little; a step of 12 honest lengths the other way jumps past the hump at w=0
    into the deeper valley at w=-1 and lowers it more, while a step of honest length that way
    climbs the hump. In one dimension, what ``bench attack`` measured of IPM at eps=4 in its
    first rounds (reversed and four times as long, it lowered the held-out loss more than any
    honest update)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5]))

    def forward(self, inputs, targets):  # noqa: ANN001, ANN201
        return None, ((self.w ** 2 - 1) ** 2 + 0.3 * self.w).sum()


def _scorer_of(model, base=None):  # noqa: ANN001, ANN202
    """A scorer of one-parameter updates around ``base`` (the model's own value by default),
    whose shard and held-out batches are the same empty batch: the model's loss ignores it."""
    base = {"w": model.w.detach()} if base is None else base
    batch = (torch.zeros(1), torch.zeros(1))
    return LossScorer(model, lambda: base, lambda peer, r: batch, batch), base, batch


def test_a_long_step_is_judged_in_its_direction():
    model = _Ridge()
    scorer, base, batch = _scorer_of(model)
    honest = {"a": -0.1, "b": -0.11, "c": -0.09}
    updates = {p: {"w": torch.tensor([v])} for p, v in honest.items()}
    updates["ipm"] = {"w": torch.tensor([1.2])}  # 12 x an honest length, the other way
    tokens = dict.fromkeys(updates, 8.0)
    moved = {"w": base["w"] - updates["ipm"]["w"]}
    assert scorer._loss(moved, batch) < scorer._loss({"w": torch.tensor([0.6])}, batch)
    verdicts = scorer.judge(0, updates, tokens)
    assert verdicts["ipm"].score == -1.0 and scorer.factor(verdicts["ipm"].rating) == 0
    assert all(verdicts[p].score > 0.8 for p in honest)


class _Valleys(torch.nn.Module):
    """One parameter between a shallow valley near w=0.3 and a deep one at w=-1, starting at
    w=0: honest steps go to the near valley; IPM's step (four honest lengths, reversed) lands in
    the deep one and lowers the loss more, and at the honest length reversed it still lowers it
    (so judging it in its direction does not catch it either). In one dimension, what ``bench
    attack`` measured of IPM at eps=4 and H=20 in its first rounds (docs/trust.md)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.0]))

    def forward(self, inputs, targets):  # noqa: ANN001, ANN201
        w = self.w
        return None, (1 - 0.5 * torch.exp(-((w - 0.3) / 0.2) ** 2)
                      - torch.exp(-((w + 1) / 0.6) ** 2)).sum()


def test_a_share_that_undoes_the_median_step_is_harmful():
    """IPM's update lowers the loss applied alone, and at the honest length too, but as the
    mean would add it (a quarter of it, at the round's median step) it walks the others' step
    back to where the round started: harmful. The honest shares go on down."""
    model = _Valleys()
    scorer, base, batch = _scorer_of(model)
    honest = {"a": -0.25, "b": -0.26, "c": -0.24}
    updates = {p: {"w": torch.tensor([v])} for p, v in honest.items()}
    updates["ipm"] = {"w": torch.tensor([1.0])}  # -4 x the honest mean
    at = {w: scorer._loss({"w": torch.tensor([w])}, batch) for w in (0.0, 0.25, -0.25, -1.0)}
    assert at[-1.0] < at[0.25] < at[0.0] and at[-0.25] < at[0.0]  # alone it lowers the loss
    verdicts = scorer.judge(0, updates, dict.fromkeys(updates, 8.0))
    assert verdicts["ipm"].score == -1.0 and verdicts["ipm"].mark == "harmful"
    assert scorer.factor(verdicts["ipm"].rating) == 0
    assert all(verdicts[p].score > 0.8 for p in honest)


def test_two_ipm_attackers_of_eight_are_harmful_each():
    """Two IPM attackers of eight reverse the mean as one of four does, but each weighs an
    eighth: the bound on what a share may undo grows with its weight, so each is judged
    harmful; applied alone (and at the honest length) each lowers the loss more than the
    honest updates do."""
    model = _Valleys()
    scorer, base, batch = _scorer_of(model)
    honest = {"a": -0.3, "b": -0.31, "c": -0.29, "d": -0.3, "e": -0.305, "f": -0.295}
    updates = {p: {"w": torch.tensor([v])} for p, v in honest.items()}
    updates.update({p: {"w": torch.tensor([1.2])} for p in ("ipm1", "ipm2")})  # -4 x mean
    at = {w: scorer._loss({"w": torch.tensor([w])}, batch) for w in (0.0, 0.3, -0.3, -1.2)}
    assert at[-1.2] < at[0.3] < at[0.0] and 4 * (at[0.0] - at[-0.3]) > at[0.0] - at[0.3]
    verdicts = scorer.judge(0, updates, dict.fromkeys(updates, 8.0))
    for bad in ("ipm1", "ipm2"):
        assert verdicts[bad].mark == "harmful" and scorer.factor(verdicts[bad].rating) == 0
    assert all(verdicts[p].score > 0.8 for p in honest)


def test_honest_shares_past_the_median_steps_valley_are_kept():
    """Late in a run the round's median step can overshoot the held-out sequences' valley, so
    a further quarter of it raises their loss by most of the step's gain: an honest share is
    judged against a typical share (the median step's own), not against stopping there."""
    model = _Valleys()
    scorer, base, batch = _scorer_of(model)
    updates = {p: {"w": torch.tensor([v])} for p, v in
               {"a": -0.4, "b": -0.41, "c": -0.39, "d": -0.4}.items()}
    at = {w: scorer._loss({"w": torch.tensor([w])}, batch) for w in (0.0, 0.4, 0.5)}
    assert at[0.5] - at[0.4] > 0.5 * (at[0.0] - at[0.4])  # a quarter more climbs back
    verdicts = scorer.judge(0, updates, dict.fromkeys(updates, 8.0))
    assert all(v.score > 0.8 and v.mark is None for v in verdicts.values()), verdicts


def test_a_median_step_within_the_noise_judges_no_share():
    """Where the round's median step lowers the held-out loss by less than 1% of it (late in a
    run, on a few sequences: noise), no share is judged by it; its own drop still judges it."""
    model = _Valleys()
    # next to the bottom of the near valley (w=0.3)
    scorer, base, batch = _scorer_of(model, {"w": torch.tensor([0.29])})
    updates = {p: {"w": torch.tensor([v])} for p, v in
               {"a": -0.005, "b": -0.03, "c": -0.004, "d": 0.02}.items()}
    stepped = scorer._loss({"w": torch.tensor([0.295])}, batch)  # the median step
    assert 0 < scorer._loss(base, batch) - stepped < 0.01 * stepped
    assert scorer._undoing(base, scorer._loss(base, batch), updates, dict.fromkeys(updates, 8.0),
                           sorted(updates), sorted(updates)) == set()
    # the same shares, judged against a step that lowers the loss enough, are judged
    far = {"w": torch.tensor([0.0])}
    steps = {p: {"w": torch.tensor([v])} for p, v in
             {"a": -0.3, "b": -0.31, "c": -0.29, "ipm": 1.2}.items()}
    assert scorer._undoing(far, scorer._loss(far, batch), steps, dict.fromkeys(steps, 8.0),
                           sorted(steps), sorted(steps)) == {"ipm"}


def test_trust_is_lost_fast_and_regained_slowly():
    """An attacker that harms two rounds and then helps (ALIE at z=3 in ``bench attack``)
    stays rated below an honest peer with one poor round, whose rating recovers."""
    scorer = LossScorer(torch.nn.Linear(1, 1), dict, lambda peer, r: None,
                        (torch.zeros(1), torch.zeros(1)))
    honest_drops = [1.0, 1.0, 1.0, 1.0, 1.0, 0.3]
    attacker_drops = [1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    rated = []
    for round_id, (h, a) in enumerate(zip(honest_drops, attacker_drops)):
        priors = dict(scorer.ratings)
        verdicts = scorer.rate(round_id, {"ref": 1.0, "honest": h, "alie": a},
                               {p: priors.get(p) for p in ("ref", "honest", "alie")},
                               ["ref", "honest", "alie"])
        rated.append((verdicts["honest"].rating, verdicts["alie"].rating))
    assert all(h > a for h, a in rated[1:]), rated
    assert rated[-1][0] >= 0.6  # one poor round costs an honest peer part of its weight
    assert scorer.factor(rated[3][1]) == 0  # not weighed in the first round it helps again


def test_a_peer_that_trained_twice_as_long_keeps_its_score():
    """Real model, real training: a peer that trained twice the steps (claiming twice the
    tokens; its update is longer than 1.25 x the round's median, so it is judged in its
    direction too) scores like the others."""
    torch.manual_seed(0)
    model = GPT(preset_config("tiny", vocab_size=64, seq_len=16))
    gen = torch.Generator().manual_seed(1)
    seqs = (torch.randint(0, 64, (48, 1), generator=gen) + torch.arange(17)) % 64
    batches = [(seqs[i:i + 4, :-1], seqs[i:i + 4, 1:]) for i in range(0, 40, 4)]
    heldout = (seqs[40:44, :-1], seqs[40:44, 1:])
    updates = {"a": _trained(model, batches, 4), "b": _trained(model, batches[1:], 4),
               "c": _trained(model, batches[2:], 4), "fast": _trained(model, batches, 8)}
    tokens = {"a": 4.0, "b": 4.0, "c": 4.0, "fast": 8.0}
    from farlink.robust.score import LONG_STEP, _norm

    norms = {p: _norm(u) for p, u in updates.items()}
    assert norms["fast"] > LONG_STEP * sorted(norms.values())[1]  # judged in its direction
    base = {n: p.detach() for n, p in model.named_parameters()}
    scorer = LossScorer(model, lambda: base, lambda peer, r: batches[0], heldout)
    verdicts = scorer.judge(0, updates, tokens)
    assert verdicts["fast"].score >= 0.5 and scorer.factor(verdicts["fast"].rating) >= 0.5


def test_bench_rates_count_what_the_ledger_left_out():
    """The bench's two rates: attackers' rounds left out or credited nothing (rejected by
    score or mark, or accepted with a mark), honest rounds left out (false rejects)."""
    from farlink.bench.attack import _rates

    peers = {"w0": {"rounds": 6, "updates_rejected": 1, "marks": {}},
             "w1": {"rounds": 6, "updates_rejected": 0, "marks": {}},
             "w2": {"rounds": 6, "updates_rejected": 4, "marks": {"replay": 1}}}
    rates = _rates(peers, {"w2"})
    assert rates == {"attacker_discount_rate": 5 / 6, "honest_false_reject_rate": 1 / 12}


def test_open_runs_default_to_a_robust_rule_and_scoring():
    trusted = load_config(None, {})
    assert (trusted.members, trusted.aggregator, trusted.score) == ("trusted", "mean", "none")
    open_run = load_config(None, {"members": "open"})
    assert (open_run.aggregator, open_run.score) == ("centered_clip", "loss")
    chosen = load_config(None, {"members": "open", "aggregator": "median", "score": "none"})
    assert (chosen.aggregator, chosen.score) == ("median", "none")
    with pytest.raises(Exception, match="members"):
        load_config(None, {"members": "everyone"})


# --- the exchange: accounting and scoring over real collectives ----------------------------------
def _model_and_data():
    torch.manual_seed(0)
    model = GPT(preset_config("nano", vocab_size=64, seq_len=16))
    gen = torch.Generator().manual_seed(1)
    seqs = (torch.randint(0, 64, (48, 1), generator=gen) + torch.arange(17)) % 64
    return model, [(seqs[i:i + 4, :-1], seqs[i:i + 4, 1:]) for i in range(0, 48, 4)]


def _honest_update(model: GPT, batch, lr: float = 0.05) -> dict[str, torch.Tensor]:
    """One SGD step's pseudo-gradient (``lr`` x the gradient) on ``batch``."""
    model.zero_grad()
    _, loss = model(*batch)
    loss.backward()
    out = {n: lr * p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out


def _exchange(collective, name: str, ledger, scorer=None, tamper=None):
    from farlink.codecs import make_compressor
    from farlink.robust.auth import make_authenticator
    from farlink.sync.exchange import Exchange

    return Exchange(collective, make_compressor("int8"), name, ledger=ledger, tamper=tamper,
                    authenticator=make_authenticator("secret", secret="s", peer_id=name),
                    max_weight=4 * 100.0, round_allowance=100.0, scorer=scorer,
                    path="gathered")


def test_free_riders_copycats_and_inflators_are_credited_nothing_under_the_plain_mean():
    """No scorer: the mean is what it was, but the ledger credits a zero update, a replay of
    another peer's earlier update and a claim beyond the run's bound nothing, and marks each;
    an honest peer is credited at most one round's tokens."""
    from farlink.comm.inprocess import InProcessGroup
    from farlink.robust.ledger import ContributionLedger

    attacks = {1: "free_rider", 2: "copycat", 3: "inflate:10"}
    ledgers = [ContributionLedger() for _ in range(5)]

    def member(rank, collective):
        tamper = make_attack(attacks[rank]) if rank in attacks else None
        ex = _exchange(collective, f"w{rank}", ledgers[rank], tamper=tamper)
        results = []
        for round_id in range(3):
            gen = torch.Generator().manual_seed(100 * round_id + rank)
            result = ex.average({"x": torch.randn(3000, generator=gen)}, 100.0, round_id)
            ex.settle(result, round_id, committed=True)
            results.append(result)
        return results

    results = InProcessGroup(5).run(member)
    for rank in (0, 4):  # honest members see the same rounds
        peers = ledgers[rank].to_dict()["peers"]
        assert peers["w0"]["tokens_credited"] == peers["w4"]["tokens_credited"] == 300.0
        assert peers["w1"]["tokens_credited"] == 0 and peers["w1"]["marks"] == {"free_rider": 3}
        assert peers["w2"]["marks"] == {"free_rider": 1, "replay": 2}  # nothing to copy at first
        assert peers["w2"]["tokens_credited"] == 0
        assert peers["w3"]["tokens_credited"] == 0 and peers["w3"]["marks"] == {"inflated": 3}
        assert peers["w3"]["tokens_accepted"] <= 3 * 150.0  # its weight was bounded too
    final = [r[-1] for r in results]
    assert set(final[0].accepted) == {f"w{i}" for i in range(5)}  # the mean's set is unchanged
    assert all(torch.equal(f.tensors["x"], final[0].tensors["x"]) for f in final)


def _scored_round(collectives: dict, attacks: dict[str, str], runner) -> dict:
    """Two scored rounds of honest SGD updates and the ``attacks``, each member its own model
    copy and scorer; returns each member's results, ledger and scorer."""
    from farlink.robust.ledger import ContributionLedger

    model, batches = _model_and_data()
    state = model.state_dict()

    def member(name, collective):
        local = GPT(model.config)
        local.load_state_dict(state)
        base = {n: p.detach() for n, p in local.named_parameters()}
        scorer = LossScorer(local, lambda: base, lambda peer, r: batches[1], batches[0])
        ledger = ContributionLedger()
        tamper = make_attack(attacks[name]) if name in attacks else None
        ex = _exchange(collective, name, ledger, scorer=scorer, tamper=tamper)
        out = []
        for step in range(2):
            round_id = collective.begin_round().round_id  # a round of the backend's own
            index = sorted(collectives).index(name)
            update = _honest_update(local, batches[2 + 2 * index + step])
            result = ex.average(update, 100.0, round_id)
            ex.settle(result, round_id, committed=collective.commit())
            out.append(result)
        return out, ledger, scorer

    return runner(member)


def _check_scored(rows: dict, attacker: str, honest: list[str]) -> None:
    results = {name: r[0] for name, r in rows.items()}
    for name in honest:
        out, ledger, scorer = rows[name]
        for result in out:
            assert attacker in result.rejected and "discounted" in result.rejected[attacker]
            assert sorted(result.accepted) == sorted(honest)
            ratings = dict(result.scores)
            assert min(ratings[h][1] for h in honest) > ratings[attacker][1]
        peers = ledger.to_dict()["peers"]
        assert peers[attacker]["tokens_credited"] == 0
        assert peers[attacker]["rating"] < 0 < min(peers[h]["rating"] for h in honest)
        assert peers[attacker]["rejections"] == {"score": 2}
        assert scorer.seconds > 0
    for round_id in range(2):  # one aggregate on every honest member: the ratings were agreed
        first = results[honest[0]][round_id].tensors
        for name in honest[1:]:
            assert all(torch.equal(first[k], results[name][round_id].tensors[k]) for k in first)


def test_scored_exchange_in_threads_discounts_ipm_and_agrees_on_one_aggregate():
    from farlink.comm.inprocess import InProcessGroup

    names = ["w0", "w1", "w2", "w3"]
    group = InProcessGroup(4)
    rows = _scored_round(dict.fromkeys(names), {"w3": "ipm:4"},
                         lambda fn: dict(zip(names, group.run(
                             lambda rank, c: fn(names[rank], c), timeout=120))))
    _check_scored(rows, "w3", ["w0", "w1", "w2"])


@pytest.mark.slow
def test_scored_exchange_on_hivemind_peers_in_one_process():
    pytest.importorskip("hivemind")
    from test_hivemind_early_matchmaking import SHORT, in_threads

    from farlink.comm.hivemind_backend import HivemindCollective

    opts = dict(target_group_size=3, min_group_size=3, **SHORT)
    first = HivemindCollective("scored", **opts)
    peers = {"w0": first, "w1": HivemindCollective("scored", first.maddrs, **opts),
             "w2": HivemindCollective("scored", first.maddrs, **opts)}
    try:
        rows = _scored_round(peers, {"w2": "ipm:4"},
                             lambda fn: in_threads(fn, peers, timeout=180))
        _check_scored(rows, "w2", ["w0", "w1"])
    finally:
        for coll in peers.values():
            coll.close()


@pytest.mark.torchft_threads
def test_farlink_train_with_loss_scoring_on_torchft_names_and_credits_nothing_to_ipm(
        tmp_path, cache_dir):
    """A whole ``farlink train --score loss`` run (workers as threads, torchft's real
    Lighthouse, real Gloo): the IPM attacker is discounted in the honest ledgers, credited
    nothing while discounted, and the report shows scores and ratings."""
    import json

    from rich.console import Console

    from farlink.testing.runs import launch_in_threads
    from farlink.train.report import contributions

    cfg = load_config(None, {
        "model": "nano", "vocab_size": 512, "seq_len": 64, "batch_size": 4, "eval_batches": 2,
        "workers": 3, "steps": 8, "inner_steps": 2, "warmup_steps": 2, "join_timeout": 5,
        "min_replicas": 3, "score": "loss",
        "attack": "ipm:4", "attackers": "2", "run_dir": tmp_path / "run",
        "cache_dir": cache_dir})
    assert launch_in_threads(cfg).returncodes == [0, 0, 0]
    for honest in ("w0", "w1"):
        peers = json.loads((cfg.run_dir / "ledger" / f"{honest}.json").read_text())["peers"]
        assert "w2" in peers, peers
        assert peers["w2"]["rejections"].get("score", 0) >= 1
        assert peers["w2"]["rating"] < 0.25 <= min(peers["w0"]["rating"], peers["w1"]["rating"])
        assert peers["w2"]["tokens_credited"] < peers["w0"]["tokens_credited"]
    console = Console(record=True, width=200)
    contributions(console, cfg.run_dir)
    text = console.export_text()
    assert "tokens credited" in text and "rating" in text and "score x" in text
