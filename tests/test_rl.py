"""Post-training with untrusted rollout workers: tasks, GRPO, policy broadcast, verification.

The models here are one-layer GPTs with confident logits (a large embedding scale), so two
different models disagree the way trained ones do; the slow test pre-trains a real base model.
"""

from __future__ import annotations

import copy
from dataclasses import replace
import json
import random

import pytest
import torch

from farlink.codecs import make_codec
from farlink.data.tokenizer import train_tokenizer
from farlink.model.config import GPTConfig
from farlink.model.gpt import GPT
from farlink.rl.base import TextCodec
from farlink.rl.board import RolloutBoard
from farlink.rl.broadcast import PolicyPublisher, PolicyReplica
from farlink.rl.grpo import group_advantages, grpo_loss
from farlink.rl.policy import completion_logits, sample_group, uniform
from farlink.rl.tasks import (Addition, CallableTask, Countdown, JsonlTask, Sorting, TaskError,
                              demonstrations, is_heldout, make_task)
from farlink.rl.trainer import GRPOTrainer, RLConfig
from farlink.rl.verify import Tolerance, check, recomputed_logits
from farlink.rl.workers import RolloutWorker, worker_model

torch.set_num_threads(1)


def confident_gpt(seed: int, vocab: int = 257) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, n_layer=1, n_head=2, d_model=32, d_ff=64, seq_len=32))
    with torch.no_grad():  # peaked, varied next-token distributions, like a trained model's
        model.embed.weight.mul_(4.0)
        for block in model.blocks:
            block.mlp.proj.weight.mul_(40.0)
    return model.eval()


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(train_tokenizer(demonstrations(Addition(2), 200, 0.5), 257))


# --- tasks -------------------------------------------------------------------------------------
def test_shipped_tasks_score_right_and_wrong_answers() -> None:
    rng = random.Random(0)
    for task in (Addition(3), Sorting(5), Countdown(3)):
        for _ in range(20):
            problem = task.draw(rng)
            assert task.reward(problem, problem.answer) == 1.0, (task.name, problem)
            assert task.reward(problem, task.corrupt(problem, rng) + "9") == 0.0
            assert task.reward(problem, "") == 0.0
    problem = Countdown(3).make(random.Random(3))
    numbers, target = problem.data
    assert Countdown(3).reward(problem, f"{target}") == (1.0 if target in numbers else 0.0)
    assert Countdown(3).reward(problem, "__import__('os')") == 0.0


def test_training_draws_never_return_a_heldout_problem() -> None:
    task, rng = Addition(2), random.Random(1)
    assert not any(is_heldout(task.draw(rng).prompt) for _ in range(500))
    assert all(is_heldout(p.prompt) for p in task.heldout_set(50))


def test_demonstrations_hold_the_asked_fraction_of_right_answers() -> None:
    task = Addition(2)
    docs = demonstrations(task, 2000, 0.3, seed=4)
    right = sum(eval(d.split("=")[0]) == int(d.split("=")[1]) for d in docs)  # noqa: S307
    assert 0.25 < right / len(docs) < 0.35


def test_a_users_task_as_callable_or_jsonl_and_a_failing_verifier_is_named(tmp_path) -> None:
    def make(rng: random.Random) -> tuple[str, str]:
        n = rng.randint(0, 9)
        return f"double {n}:", str(2 * n)

    task = CallableTask("double", make, lambda prompt, answer, completion: completion == answer)
    problem = task.draw(random.Random(0))
    assert task.reward(problem, problem.answer) == 1.0
    broken = CallableTask("broken", make, lambda p, a, c: 1 / 0)
    with pytest.raises(TaskError, match="verifier of task 'broken' failed.*ZeroDivisionError"):
        broken.reward(problem, "x")
    with pytest.raises(TaskError, match=r"returned 2 .*number in \[0, 1\]"):
        CallableTask("two", make, lambda p, a, c: 2).reward(problem, "x")
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}?", "answer": f"a{i}"})
                              for i in range(40)))
    jsonl = make_task(str(path))
    assert isinstance(jsonl, JsonlTask) and len(jsonl.problems) == 40
    held = jsonl.heldout_set(3)
    assert all(jsonl.reward(p, p.answer + "\nmore") == 1.0 for p in held)
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(TaskError, match="tasks.jsonl:1"):
        make_task(str(path))


# --- GRPO --------------------------------------------------------------------------------------
def test_group_advantages_are_normalised_and_zero_for_a_flat_group() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    assert torch.equal(group_advantages(torch.ones(4)), torch.zeros(4))


def test_the_clipped_ratio_stops_the_gradient_and_kl_is_zero_at_the_reference() -> None:
    old = [torch.log(torch.tensor([0.5, 0.5]))]
    # ratio 2 with a positive advantage: clipped at 1.2, no gradient flows
    new = torch.log(torch.tensor([1.0, 1.0])).requires_grad_()
    parts = grpo_loss([new], old, [1.0], clip=0.2)
    parts.loss.backward()
    assert parts.clipped_fraction == 1.0 and torch.equal(new.grad, torch.zeros(2))
    # inside the clip range the gradient is the ratio times the advantage
    near = torch.log(torch.tensor([0.55, 0.5])).requires_grad_()
    grpo_loss([near], old, [1.0]).loss.backward()
    torch.testing.assert_close(near.grad, -torch.tensor([1.1, 1.0]) / 2)
    same = torch.log(torch.tensor([0.3, 0.6]))
    assert grpo_loss([same], [same], [0.0], kl_coef=1.0, ref_logprobs=[same]).kl == 0.0


# --- weights out -------------------------------------------------------------------------------
def test_a_worker_copy_is_bit_identical_to_the_served_version_at_a_quarter_of_the_bytes() -> None:
    model = confident_gpt(0)
    publisher = PolicyPublisher(model, make_codec("int4"), keep=3)
    replica = PolicyReplica(confident_gpt(1), make_codec("int4"), max_chain=2)
    replica.refresh(publisher)
    assert replica.full_fetches == 1 and replica.bytes_received > publisher.full_bytes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for version in range(1, 6):
        torch.manual_seed(version)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        publisher.publish(model)
        before = replica.bytes_received
        replica.refresh(publisher)
        assert replica.bytes_received - before <= publisher.full_bytes / 4
        for name, param in replica.model.named_parameters():
            assert torch.equal(param, publisher.weights(version)[name]), name
    # tied embedding and output head: one tensor, one delta
    assert replica.model.lm_head.weight is replica.model.embed.weight
    # a worker further behind than its chain (or than the deltas kept) refetches in full
    for _ in range(3):
        publisher.publish(model)
    replica.refresh(publisher)
    assert replica.full_fetches == 2 and replica.delta_updates == 5


def test_a_worker_copy_after_a_trainer_restart_is_refetched_not_kept_under_a_reused_number() -> None:
    """A restarted trainer numbers versions again from its checkpoint: its version 2 is not
    the old trainer's version 2, so a worker holding the old one fetches in full."""
    model = confident_gpt(0)
    before = PolicyPublisher(model, make_codec("int4"))
    checkpointed = {k: v.clone() for k, v in before.served.items()}
    replica = PolicyReplica(confident_gpt(1), make_codec("int4"), max_chain=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def moved() -> None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()

    torch.manual_seed(1)
    for _ in range(2):
        moved()
        before.publish(model)
    assert replica.refresh(before) == 2
    after = PolicyPublisher(model, make_codec("int4"))
    after.restore(checkpointed, 0)
    torch.manual_seed(2)
    for _ in range(2):
        moved()
        after.publish(model)
    assert replica.refresh(after) == 2 and replica.full_fetches == 2
    for name, param in replica.model.named_parameters():
        assert torch.equal(param, after.weights(2)[name]), name


# --- verification ------------------------------------------------------------------------------
def _rollouts(model: GPT, codec: TextCodec, dtype: torch.dtype = torch.float32, seeds=(1, 2, 3)):
    return sample_group(model, codec.prompt_ids("12+34="), list(seeds), worker="w", job=0,
                        version=0, stop_id=codec.eot, max_new_tokens=6, every=2, k=4,
                        dtype=dtype)


def test_honest_rollouts_pass_and_another_models_or_fabricated_ones_fail(codec) -> None:
    policy, other = confident_gpt(0), confident_gpt(1)
    seeds = list(range(40))
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            honest = _rollouts(policy, codec, dtype, seeds)
            assert {r.precision for r in honest} == {"fp32" if dtype == torch.float32 else "bf16"}
            logits = recomputed_logits(policy, honest)  # in the precision each worker names
            assert [check(r, lg, 1.0, 2) for r, lg in zip(honest, logits)] == [None] * 40, dtype
        forged = _rollouts(other, codec, seeds=seeds)
        reasons = [check(r, lg, 1.0, 2) for r, lg in zip(forged, completion_logits(policy, forged))]
        assert all(r is not None and r.startswith(("fingerprint", "sampling")) for r in reasons)
        # fabricated: tokens of someone's choosing, commitments honestly computed for them
        board = RolloutBoard(Addition(2), codec, 2)
        publisher = PolicyPublisher(policy, make_codec("int4"))
        cfg = RLConfig(fingerprint_every=2)
        cheat = RolloutWorker("c", board, publisher,
                              PolicyReplica(worker_model(policy), make_codec("int4")), cfg,
                              behaviour="fabricate")
        caught = 0
        for r in _rollouts(policy, codec, seeds=seeds):
            fake = cheat._committed(r, codec.tokenizer.encode("46").ids + [codec.eot])
            caught += check(fake, completion_logits(policy, [fake])[0], 1.0, 2) is not None
        assert caught >= 38


def test_a_rollouts_precision_travels_and_the_check_recomputes_in_it(codec) -> None:
    """A bf16 worker says so; over the wire the field survives, and the trainer recomputes in
    bf16 (checked in fp32, a bf16 draw can land further off its interval than the tolerance)."""
    from farlink.rl.remote import rollout_from_json, rollout_to_json

    policy = confident_gpt(0)
    with torch.no_grad():
        rollouts = _rollouts(policy, codec, torch.bfloat16, seeds=list(range(8)))
        assert [rollout_from_json(json.loads(json.dumps(rollout_to_json(r)))) for r in rollouts] \
            == rollouts
        fp32 = [rows.float() for rows in completion_logits(policy, rollouts)]
        bf16 = recomputed_logits(policy, rollouts)
    assert all(not torch.equal(a, b) for a, b in zip(fp32, bf16))
    for r, rows in zip(rollouts, bf16):  # the worker's own numbers: what it committed to
        assert [fp.values for fp in r.fingerprints] == [
            rows[fp.position][fp.ids].half().float().tolist() for fp in r.fingerprints]


def test_a_completion_one_token_off_the_seeded_draw_is_refused(codec) -> None:
    """A fabricated completion that is the seeded draw but for its last token, with honestly
    computed commitments and log-probabilities, is refused: no share of tokens off the draw is
    forgiven (a quarter was, and let such groups through). The only forgery that passes is a
    near-tie: the draw within the CDF tolerance of the forged token's interval, which rounding
    could flip for an honest worker too."""
    policy = confident_gpt(0)
    cheat = RolloutWorker("c", RolloutBoard(Addition(2), codec, 2),
                          PolicyPublisher(policy, make_codec("int4")),
                          PolicyReplica(worker_model(policy), make_codec("int4")),
                          RLConfig(fingerprint_every=2, max_new_tokens=6), behaviour="fabricate")
    cheat.model = policy
    tried = refused = 0
    with torch.no_grad():
        for r in _rollouts(policy, codec, seeds=list(range(60))):
            if len(r.completion_ids) != 6:
                continue
            logits = recomputed_logits(policy, [r])[0]
            assert check(r, logits, 1.0, 2) is None  # the honest draw passes
            probs = torch.softmax(logits[5], dim=-1)
            others = probs.clone()
            others[r.completion_ids[5]] = 0
            forged = int(others.argmax())  # the likeliest other token at the last position
            fake = cheat._committed(r, r.completion_ids[:5] + [forged])
            reason = check(fake, recomputed_logits(policy, [fake])[0], 1.0, 2)
            tried += 1
            if reason is not None:
                assert reason.startswith(("sampling: 1 of 6", "near-tie: 1 of 6")), reason
                refused += 1
            else:  # a near-tie: the draw lies within the tolerance of the forged interval
                upper = float(probs.cumsum(0)[forged])
                draw = uniform(r.seed, 5)
                gap = max(upper - float(probs[forged]) - draw, draw - upper)
                assert gap <= Tolerance().cdf, gap
    assert tried >= 20 and refused >= tried - 2, (tried, refused)


def _near_tie(policy, cheat: RolloutWorker, rollout):  # noqa: ANN001, ANN202
    """``rollout`` with its last token swapped for one whose CDF interval ends just short of
    the seeded draw (0.004-0.1 away), commitments honestly computed: a near-tie."""
    n = len(rollout.completion_ids)
    probs = torch.softmax(recomputed_logits(policy, [rollout])[0][n - 1], dim=-1)
    upper, draw = probs.cumsum(0), uniform(rollout.seed, n - 1)
    gaps = torch.maximum(upper - probs - draw, draw - upper)
    candidates = ((gaps > 0.01) & (gaps < 0.08)).nonzero().flatten().tolist()
    return cheat._committed(rollout, rollout.completion_ids[:-1] + [candidates[0]])


def test_near_ties_refuse_the_group_and_ban_only_when_they_repeat(codec) -> None:
    """A checked group whose draw misses by a near-tie (what bf16 rounding does to one honest
    group in ~50) is refused with all its worker's groups of the step, and recorded, but the
    worker is banned only at ``near_ties_to_ban`` in a row; a clean check starts the count
    again."""
    policy = confident_gpt(0)
    cfg = RLConfig(group_size=2, groups_per_step=4, deadline_s=1.0, fingerprint_every=2,
                   verify_fraction=0.0, near_ties_to_ban=2)
    publisher, board, trainer = _even_trainer(policy, codec, cfg)
    replica = lambda: PolicyReplica(worker_model(policy), make_codec("int4"))  # noqa: E731
    honest = RolloutWorker("h", board, publisher, replica(), cfg)
    near = RolloutWorker("w", board, publisher, replica(), cfg)
    near.model = policy  # its commitments come from the trainer's own policy

    def step(tied: bool):  # noqa: ANN202
        honest.do_job()
        near.do_job()
        subs = board.take(2, 1.0)
        if tied:
            subs = [replace(s, rollouts=[_near_tie(policy, near, s.rollouts[0])] + s.rollouts[1:])
                    if s.worker == "w" else s for s in subs]
        return trainer.train_step(subs)

    for tied, banned in ((True, False), (False, False), (True, False), (True, True)):
        log = step(tied)
        assert log is not None and log.groups == (1 if tied else 2), (tied, log)
        assert ("w" in board.banned) == banned
    kinds = [reason.split(":")[0] for _, reason in trainer.rejections]
    assert kinds == ["near-tie"] * 3 and trainer.ledger.get("h").updates_rejected == 0
    assert trainer.ledger.get("w").updates_rejected == 3


def test_the_trainer_bans_every_kind_of_cheat_and_keeps_the_honest_worker(codec) -> None:
    torch.manual_seed(0)
    policy = confident_gpt(0)
    cfg = RLConfig(group_size=4, groups_per_step=6, deadline_s=0.5, max_new_tokens=6,
                   fingerprint_every=2, verify_fraction=0.25)
    publisher = PolicyPublisher(policy, make_codec("int4"))
    # a reward an untrained policy earns half the time, so steps have a signal and move weights
    task = CallableTask("even", lambda rng: (f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", "44"),
                        lambda prompt, answer, completion: sum(map(ord, completion)) % 2 == 0)
    board = RolloutBoard(task, codec, cfg.group_size, version=lambda: publisher.version)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)

    def step(tokens: int) -> None:
        optimizer.step()
        optimizer.zero_grad()

    trainer = GRPOTrainer(policy, step, board, publisher, worker_model(policy), cfg)

    def worker(name: str, behaviour: str) -> RolloutWorker:
        return RolloutWorker(name, board, publisher,
                             PolicyReplica(worker_model(policy), make_codec("int4")), cfg,
                             behaviour=behaviour, other_model=confident_gpt(5))

    workers = [worker(b, b) for b in ("honest", "fabricate", "wrong_model", "stale", "replay")]
    for round_ in range(4):  # every worker hands in one job per round, then the trainer steps
        for w in workers:
            w.do_job()
        trainer.train_step()
    banned = {w for w, _ in trainer.rejections}
    assert banned == {"fabricate", "wrong_model", "stale", "replay"}, trainer.rejections
    kinds = {w: reason.split(":")[0] for w, reason in trainer.rejections}
    assert kinds["replay"] == "replay"
    assert trainer.ledger.get("honest").updates_rejected == 0
    assert trainer.ledger.get("honest").updates_accepted == 4
    # fabricated and foreign groups never count; the stale and the replaying worker's first job
    # was honest work (version 0 was the newest; nothing had been handed in to replay yet)
    for cheat in ("fabricate", "wrong_model"):
        assert trainer.ledger.get(cheat).updates_accepted == 0, cheat
    for cheat in ("stale", "replay"):
        assert trainer.ledger.get(cheat).updates_accepted <= 1, cheat


def _even_task() -> CallableTask:
    return CallableTask("even", lambda rng: (f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", "4"),
                        lambda prompt, answer, completion: sum(map(ord, completion)) % 2 == 0)


def _even_trainer(policy, codec, cfg: RLConfig):  # noqa: ANN001, ANN202
    """The even-sum task's publisher, board and a GRPO trainer of ``policy`` (SGD, lr 0.1)."""
    publisher = PolicyPublisher(policy, make_codec("int4"))
    board = RolloutBoard(_even_task(), codec, cfg.group_size, version=lambda: publisher.version)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    trainer = GRPOTrainer(policy, lambda tokens: (optimizer.step(), optimizer.zero_grad()),
                          board, publisher, worker_model(policy), cfg)
    return publisher, board, trainer


def test_a_worker_gone_mid_job_costs_no_step_and_the_deadline_bounds_the_wait(codec) -> None:
    import time

    policy = confident_gpt(0)
    cfg = RLConfig(group_size=4, groups_per_step=3, deadline_s=0.3, fingerprint_every=2)
    publisher, board, trainer = _even_trainer(policy, codec, cfg)
    started = time.monotonic()
    assert trainer.train_step() is None  # nothing came: no step, no new version
    assert 0.3 <= time.monotonic() - started < 5 and publisher.version == 0
    board.request("gone")  # took a job and was killed before handing it in
    alive = RolloutWorker("alive", board, publisher,
                          PolicyReplica(worker_model(policy), make_codec("int4")), cfg)
    for _ in range(2):
        alive.do_job()
    log = trainer.train_step()  # two of three groups: the step commits at the deadline
    assert log is not None and log.groups == 2 and trainer.step == 1 and publisher.version == 1
    assert trainer.ledger.peers() == ["alive"]


def test_groups_older_than_max_staleness_are_dropped_and_staleness_is_recorded(codec) -> None:
    policy = confident_gpt(0)
    cfg = RLConfig(group_size=4, groups_per_step=8, deadline_s=0.2, fingerprint_every=2,
                   max_staleness=1)
    publisher, board, trainer = _even_trainer(policy, codec, cfg)
    worker = RolloutWorker("w", board, publisher,
                           PolicyReplica(worker_model(policy), make_codec("int4")), cfg)
    worker.do_job()  # version 0
    for _ in range(2):
        publisher.publish(policy)  # two versions later
    worker.do_job()  # version 2
    publisher.publish(policy)
    log = trainer.train_step()
    assert log.groups == 1 and log.dropped_stale == 1 and log.staleness == [1]
    assert trainer.ledger.get("w").updates_rejected == 0  # late is not dishonest


def test_a_backlog_of_too_stale_groups_does_not_shrink_a_step(codec) -> None:
    """Groups dropped as too stale do not count toward ``groups_per_step``: the step goes on
    taking hand-ins until it holds that many usable ones (a backlog once made steps of one
    or two groups, and learning stalled)."""
    policy = confident_gpt(0)
    cfg = RLConfig(group_size=4, groups_per_step=2, deadline_s=2.0, fingerprint_every=2,
                   max_staleness=0)
    publisher, board, trainer = _even_trainer(policy, codec, cfg)
    worker = RolloutWorker("w", board, publisher,
                           PolicyReplica(worker_model(policy), make_codec("int4")), cfg)
    for _ in range(3):
        worker.do_job()  # version 0: too stale once version 1 is out
    publisher.publish(policy)
    for _ in range(2):
        worker.do_job()  # version 1
    log = trainer.train_step()
    assert log is not None and log.groups == 2 and log.dropped_stale == 3
    assert log.staleness == [0, 0]


@pytest.mark.slow
def test_the_whole_loop_on_a_real_base_model_with_two_async_workers() -> None:
    """The short recipe's base model, 30 GRPO steps with two workers at staleness 2: the base
    is right sometimes, honest workers are never rejected, every group is within the staleness
    bound, and each policy version reaches a worker in at most a quarter of its fp32 bytes."""
    from farlink.train.rl import make_base, make_session, run_session

    base = make_base("addition:1", pretrain_steps=300, seed=0)
    session = make_session(base, RLConfig(seed=0), workers=2)
    summary = run_session(session, 30, eval_every=30)
    assert summary["heldout_accuracy_base"] > 0  # low but non-zero: the recipe's promise
    assert summary["steps"] == 30 and summary["rejections"] == []
    assert all(row["staleness_max"] <= 2 for row in session.logs if "staleness_max" in row)
    assert any(row.get("reward", 0) > 0 for row in session.logs)
    full = summary["bytes_full_fp32"]
    for worker in summary["workers"].values():
        assert 0 < worker["delta_bytes_per_version"] <= full / 4, worker


@pytest.mark.slow
def test_grpo_raises_heldout_accuracy_above_the_base() -> None:
    """The default run (sorting:3, the 1000-step base, 60 steps at lr 3e-4, 2 workers):
    pass@1 on held-out prompts, which no training draw returns, rises clearly."""
    from farlink.train.rl import LR, STEPS, TASK, make_base, make_session, run_session

    base = make_base(TASK, seed=0)
    summary = run_session(make_session(base, RLConfig(seed=0), workers=2, lr=LR), STEPS,
                          eval_every=STEPS)
    assert summary["heldout_accuracy_final"] > summary["heldout_accuracy_base"] + 0.03, summary


def test_a_restarted_trainer_resumes_at_its_last_committed_step(codec, tmp_path) -> None:
    """Checkpoint after each committed step; a new trainer process (here: new objects) resumes
    with the same weights, version, step and ledger; a hand-in of a job issued before the
    restart expires without blaming its worker, who refetches the policy in full."""
    from farlink.train.rl import Base, make_session, restore_state, save_state

    def session(seed: int):  # noqa: ANN202
        base = Base(confident_gpt(seed), codec, _even_task(), [])
        cfg = RLConfig(group_size=4, groups_per_step=2, deadline_s=0.3, fingerprint_every=2)
        return make_session(base, cfg, workers=1, lr=1e-2)

    first = session(0)
    worker = first.workers[0]
    for _ in range(2):
        worker.do_job()
        worker.do_job()
        assert first.trainer.train_step() is not None
        save_state(tmp_path, first)
    late = first.board.request(worker.name)  # issued, then the trainer went down
    second = session(1)
    assert restore_state(tmp_path, second) == 2
    for a, b in zip(first.base.model.parameters(), second.base.model.parameters()):
        assert torch.equal(a, b)
    assert second.publisher.version == first.publisher.version == 2
    assert second.trainer.ledger.get(worker.name).updates_accepted == 4
    moved = second.workers[0]
    moved.name = worker.name
    from farlink.rl.board import Submission

    stale_hand_in = Submission(worker.name, late.job, worker._rollouts(late), 0.0)
    moved.do_job()
    moved.do_job()
    subs = [stale_hand_in] + second.board.take(2, 1.0)
    log = second.trainer.train_step(subs)
    assert log is not None and log.step == 2 and log.groups == 2 and log.dropped_stale == 1
    assert second.trainer.rejections == [] and moved.replica.full_fetches == 1


def test_a_group_that_would_break_the_update_is_refused_checked_or_not(codec) -> None:
    """Every admitted group enters the update, sampled for checking or not: a NaN
    log-probability (the importance ratio), a NaN fingerprint, a token id past the model's
    vocabulary (the trainer's forward) or a log-probability count that does not match the
    tokens are refused as malformed before any of it is used."""
    from dataclasses import replace

    policy = confident_gpt(0)
    cfg = RLConfig(group_size=4, groups_per_step=1, deadline_s=2.0, fingerprint_every=2)
    publisher, board, trainer = _even_trainer(policy, codec, cfg)
    worker = RolloutWorker("w", board, publisher,
                           PolicyReplica(worker_model(policy), make_codec("int4")), cfg)
    worker.do_job()
    [sub] = board.take(1, 2.0)
    assert trainer.admit(sub) is None
    first = sub.rollouts[0]
    fingerprint = replace(first.fingerprints[0], values=[float("nan")] * len(first.fingerprints[0].values))
    broken = {
        "nan log-probability": replace(first, logprobs=[float("nan")] + first.logprobs[1:]),
        "nan fingerprint": replace(first, fingerprints=[fingerprint] + first.fingerprints[1:]),
        "token past the vocabulary": replace(
            first, completion_ids=[policy.config.vocab_size] + first.completion_ids[1:]),
        "fewer log-probabilities": replace(first, logprobs=first.logprobs[:-1]),
        "unknown precision": replace(first, precision="int8"),
        "two precisions in a group": replace(first, precision="bf16"),
    }
    for what, rollout in broken.items():
        reason = trainer.admit(replace(sub, rollouts=[rollout] + sub.rollouts[1:]))
        assert reason is not None and reason.startswith("malformed"), (what, reason)
