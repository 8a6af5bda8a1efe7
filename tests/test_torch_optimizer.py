"""farlink.Optimizer is a torch.optim.Optimizer: what a framework does to an optimizer (an lr
scheduler, step(closure), zero_grad, hooks, torch.save of state_dict and load_state_dict)
reaches the inner optimizer and resumes a run exactly. Two replicas as threads in one process;
the frameworks themselves run in tests/test_frameworks.py."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import farlink
from farlink.comm.inprocess import InProcessGroup
from farlink.sync import ALGORITHMS, capabilities
from farlink.testing.threads import in_threads

torch.set_num_threads(1)
H = 4


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).squeeze(-1)


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(16, 4, generator=gen)
    return x, x.sum(-1)


def framework_replica(collective, rank: int, seed: int = 0, **options):  # noqa: ANN001, ANN201
    """What a framework is handed: the model, farlink's optimizer around the user's AdamW, and
    a warmup scheduler built on farlink's optimizer (as Trainer and Lightning users build it)."""
    gen = torch.Generator().manual_seed(seed)
    model = Tiny()
    with torch.no_grad():  # threads share torch's global RNG: initialize from our own
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    inner = torch.optim.AdamW(model.parameters(), lr=0.02)
    opt = farlink.Optimizer(model, inner, algorithm="diloco", inner_steps=H,
                            backend="inprocess", collective=collective, index=rank, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))
    return model, inner, opt, scheduler


def framework_steps(model: nn.Module, opt, scheduler, rank: int, start: int,  # noqa: ANN001
                    stop: int) -> list[float]:
    """A framework's loop: step(closure) with zero_grad inside the closure, then the scheduler."""
    losses = []
    for step in range(start, stop):
        x, y = data(rank, step)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        losses.append(float(opt.step(closure).detach()))
        scheduler.step()
    return losses


def test_it_is_a_torch_optimizer_over_the_inner_optimizers_groups_and_state() -> None:
    model, inner, opt, scheduler = framework_replica(None, 0)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert inner.param_groups[0]["lr"] == pytest.approx(0.02 / 5)  # the scheduler's warmup
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    x, y = data(0, 0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())

    def closure() -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and calls == ["pre"] and len(inner.state) == 4
    assert opt.last_outcome.outer_step == 0 and opt.inner_steps == 1
    scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.02 * 2 / 5)
    with pytest.raises(TypeError, match="tokens=N"):
        opt.step(16)
    with pytest.raises(ValueError, match="parameters it was built with"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(ValueError, match="not a farlink.Optimizer state"):
        opt.load_state_dict(inner.state_dict())
    opt.close()


def test_torch_saved_state_dict_resumes_two_replicas_exactly() -> None:
    """Two replicas stop mid-round (2 steps past a round), their optimizer and scheduler states
    go through torch.save/torch.load(weights_only=True), and fresh replicas (another initial
    model, another process's worth of objects) load them and run on: they land on the model of
    the run that never stopped, bit for bit, and the loss fell."""
    stop, end = H + 2, 5 * H

    def uninterrupted(rank: int, collective):  # noqa: ANN001, ANN202
        model, _, opt, scheduler = framework_replica(collective, rank)
        losses = framework_steps(model, opt, scheduler, rank, 0, stop)
        saved = io.BytesIO()
        torch.save({"optimizer": opt.state_dict(), "scheduler": scheduler.state_dict(),
                    "model": model.state_dict()}, saved)
        losses += framework_steps(model, opt, scheduler, rank, stop, end)
        return saved.getvalue(), losses, opt.fingerprint(), [p.detach().clone()
                                                              for p in model.parameters()]

    def resumed(rank: int, collective, saved: bytes):  # noqa: ANN001, ANN202
        model, _, opt, scheduler = framework_replica(collective, rank, seed=7)
        checkpoint = torch.load(io.BytesIO(saved), weights_only=True)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        assert opt.outer_step == 1 and opt.inner_steps == stop
        framework_steps(model, opt, scheduler, rank, stop, end)
        return opt.fingerprint(), [p.detach().clone() for p in model.parameters()]

    first = InProcessGroup(2).run(uninterrupted)
    group = InProcessGroup(2)
    again = in_threads(lambda rank, member: resumed(rank, member, first[rank][0]),
                       {rank: group.member(rank) for rank in range(2)})
    assert first[0][2] == first[1][2] == again[0][0] == again[1][0]
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first[rank][3], again[rank][1]))
        losses = first[rank][1]
        assert sum(losses[-4:]) < sum(losses[:4]) / 4


def test_a_round_weighs_replicas_by_counted_tokens_or_else_by_steps() -> None:
    """Replica 0 counts two micro-batches of one token a step with count_tokens, replica 1
    counts nothing, so each of its steps weighs one: the round's weight is 2H + H (replica 0
    alone: 2H)."""

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        model, _, opt, _ = framework_replica(collective, rank)
        for step in range(H):
            x, y = data(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            if rank == 0:
                opt.count_tokens(1)
                opt.count_tokens(1)
            outcome = opt.step()
        assert outcome.committed
        return opt.algorithm.last_exchange.total_weight

    assert InProcessGroup(2).run(member) == [3 * H, 3 * H]
    assert InProcessGroup(1).run(member) == [2 * H]


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if not capabilities(a).islands])
def test_every_algorithms_state_dict_goes_through_torch_load_and_back(algorithm: str) -> None:
    """One replica, 3 steps (mid-round where rounds are longer), its state_dict through
    torch.save and torch.load(weights_only=True) into a fresh replica: the same committed state,
    round position and next step."""

    def build(seed: int):  # noqa: ANN202
        torch.manual_seed(seed)
        model = Tiny()
        inner = (torch.optim.AdamW(model.parameters(), lr=0.01)
                 if capabilities(algorithm).inner_optimizer else None)
        return model, farlink.Optimizer(model, inner, algorithm=algorithm, inner_steps=2,
                                        steps=100, backend="inprocess")

    def one_step(model: nn.Module, opt: farlink.Optimizer, step: int) -> None:
        x, y = data(0, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    model, opt = build(0)
    for step in range(3):
        one_step(model, opt, step)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    again_model, again = build(1)
    again.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert again.fingerprint() == opt.fingerprint() and again.inner_steps == opt.inner_steps == 3
    one_step(model, opt, 3)
    one_step(again_model, again, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again_model.parameters()))
    opt.close()
    again.close()


def test_a_scheduler_farlink_does_not_read_is_said_at_the_first_step(
        caplog: pytest.LogCaptureFixture) -> None:
    def first_step(algorithm: str, inner: bool, **options) -> list[str]:  # noqa: ANN003
        caplog.clear()
        model = Tiny()
        opt = farlink.Optimizer(model, torch.optim.AdamW(model.parameters()) if inner else None,
                                algorithm=algorithm, steps=100, inner_steps=5,
                                backend="inprocess", **options)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        for step in range(2):
            x, y = data(0, step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.close()
        return [r.getMessage() for r in caplog.records if "scheduler" in r.getMessage()]

    assert first_step("diloco", inner=True) == []
    [demo] = first_step("demo", inner=False)
    assert demo.startswith("demo steps with its own lr")
    [scheduled] = first_step("diloco", inner=True, lr_schedule=True)
    assert "lr_schedule=False" in scheduled
