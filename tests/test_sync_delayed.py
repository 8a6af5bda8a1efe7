"""The delayed outer step (--outer-overlap delayed|eager, farlink.sync.delayed): it overlaps the
round's exchange with the next inner steps, and its updates equal the delayed and eager updates
computed by hand (threads as peers)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from farlink.codecs import make_compressor
from farlink.comm.inprocess import InProcessGroup, LinkModel
from farlink.compose import wire
from farlink.config import RunConfig
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange

LOCAL = {0: [[0.0, 1.0], [0.5, 1.0], [2.0, -1.0], [0.25, 0.75]],
         1: [[1.0, 0.0], [1.0, 2.0], [-1.0, 0.5], [1.5, 1.0]]}
TOKENS = {0: 300, 1: 100}
LR, MOMENTUM = 0.7, 0.9


def _algo(collective, mode: str, name: str = "diloco"):  # noqa: ANN001, ANN202
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    cfg = RunConfig(algorithm=name, steps=100, warmup_steps=0, outer_overlap=mode)
    cls = algorithm_class(name)
    exchange = Exchange(collective, sender=f"r{id(collective)}", **wire(cls, cfg, "none"))
    return cls(model, cfg, collective, exchange)


def _drive(mode: str) -> list[dict]:
    """Each rank ends every phase at LOCAL[rank][t] with TOKENS[rank]; records where the next
    phase starts, the committed parameters after each sync, and after finish."""

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        algo = _algo(collective, mode)
        starts, committed = [], []
        for local in LOCAL[rank]:
            with torch.no_grad():
                algo.params[0].copy_(torch.tensor([local]))
            algo.tokens_since_sync = TOKENS[rank]
            outcome = algo.sync()
            assert outcome.synced
            starts.append(algo.params[0].detach().clone())
            committed.append(algo.global_params[0].clone())
        algo.finish()
        return {"starts": starts, "committed": committed,
                "final": algo.params[0].detach().clone(), "outer_steps": algo.outer_step,
                "fingerprint": algo.fingerprint()}

    return InProcessGroup(2).run(member, timeout=60)


def _nesterov(param: torch.Tensor):  # noqa: ANN202
    return torch.optim.SGD([param], lr=LR, momentum=MOMENTUM, nesterov=True)


def _step(opt: torch.optim.Optimizer, param: torch.Tensor, grad: torch.Tensor) -> None:
    param.grad = grad.clone()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _average(deltas: dict[int, torch.Tensor]) -> torch.Tensor:
    """The token-weighted mean as the exchange forms it (a sum of weighted updates, then /W)."""
    total = float(sum(TOKENS.values()))
    return torch.stack([deltas[r] * float(TOKENS[r]) for r in (0, 1)]).sum(0) / total


def _reference(mode: str) -> list[dict]:
    """The delayed and eager updates by hand: the committed θ^t = Opt(θ^(t-1), Δ^(t-1)); a phase
    starts from θ^t (delayed) or from the worker's own copy stepped with
    Δ^(t-1) + (Δ_m^t - Δ_m^(t-1)) / M (eager; no stand-in before a round was seen)."""
    theta = torch.tensor([[1.0, 2.0]])
    committed, opt = theta.clone(), None
    opt = _nesterov(committed)
    own = {r: theta.clone() for r in (0, 1)}
    own_opt = {r: _nesterov(own[r]) for r in (0, 1)}
    prev_own: dict[int, torch.Tensor] = {}
    members = 0
    pending = None  # the average in flight
    out = {r: {"starts": [], "committed": []} for r in (0, 1)}
    for t in range(len(LOCAL[0])):
        start = {r: (own[r] if mode == "eager" else committed).clone() for r in (0, 1)}
        deltas = {r: start[r] - torch.tensor([LOCAL[r][t]]) for r in (0, 1)}
        landed = pending
        if landed is not None:
            _step(opt, committed, landed)
            members = 2
        if mode == "eager":
            share = 1.0 / members if members else 0.0
            for r in (0, 1):
                g = deltas[r] * share
                if r in prev_own:
                    g = g - prev_own[r] * share
                if landed is not None:
                    g = landed + g
                _step(own_opt[r], own[r], g)
                if share:
                    prev_own[r] = deltas[r]
        pending = _average(deltas)
        for r in (0, 1):
            out[r]["starts"].append((own[r] if mode == "eager" else committed).clone())
            out[r]["committed"].append(committed.clone())
    _step(opt, committed, pending)
    for r in (0, 1):
        out[r]["final"] = committed.clone()
    return [out[0], out[1]]


@pytest.mark.parametrize("mode", ["delayed", "eager"])
def test_delayed_update_matches_reference_exactly(mode: str) -> None:
    got, want = _drive(mode), _reference(mode)
    for rank in (0, 1):
        for key in ("starts", "committed"):
            for t, (a, b) in enumerate(zip(got[rank][key], want[rank][key])):
                assert torch.equal(a, b), (mode, rank, key, t, a, b)
        assert torch.equal(got[rank]["final"], want[rank]["final"])
        assert got[rank]["outer_steps"] == len(LOCAL[0])  # every round landed once
    assert got[0]["fingerprint"] == got[1]["fingerprint"]  # one committed state
    if mode == "eager":  # the stand-in makes the replicas' starting points differ
        assert not torch.equal(got[0]["starts"][1], got[1]["starts"][1])


def test_delayed_first_phase_applies_nothing_and_lags_one_round() -> None:
    got = _drive("delayed")
    theta0 = torch.tensor([[1.0, 2.0]])
    assert torch.equal(got[0]["starts"][0], theta0)  # nothing has landed after phase 1
    blocking = _reference_blocking()
    # the committed θ after phase t+1 of the delayed step is not the blocking step's θ^t: the
    # Δ of phase t+1 is measured from an older start; but after phase 2 they coincide (both
    # have applied only round 1's average, measured from θ0)
    assert torch.equal(got[0]["committed"][1], blocking[0])


def _reference_blocking() -> list[torch.Tensor]:
    committed = torch.tensor([[1.0, 2.0]])
    opt = _nesterov(committed)
    out = []
    for t in range(len(LOCAL[0])):
        deltas = {r: committed - torch.tensor([LOCAL[r][t]]) for r in (0, 1)}
        _step(opt, committed, _average(deltas))
        out.append(committed.clone())
    return out


class _Timed(Exchange):
    """The real exchange, recording when each round's averaging ran."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.spans: list[tuple[float, float]] = []

    def average(self, tensors, weight, round_id):  # noqa: ANN001, ANN201
        began = time.perf_counter()
        try:
            return super().average(tensors, weight, round_id)
        finally:
            self.spans.append((began, time.perf_counter()))


def _overlap_run(mode: str, name: str = "diloco") -> list[dict]:
    # a dense round costs 2 latencies of 0.05 s = 0.1 s on this link (a gathered one 1), less
    # than a phase: 5 steps of >= 30 ms
    link = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.05)
    init = threading.Lock()

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        with init:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        cfg = RunConfig(algorithm=name, steps=20, inner_steps=5, warmup_steps=0,
                        outer_overlap=mode)
        cls = algorithm_class(name)
        exchange = _Timed(collective, sender=f"p{rank}", **wire(cls, cfg, "none"))
        algo = cls(model, cfg, collective, exchange)
        gen = torch.Generator().manual_seed(rank + 1)
        step_times, exposed = [], 0.0
        while not algo.finished():
            x = torch.randn(16, 8, generator=gen)
            (model(x) - x).pow(2).mean().backward()
            time.sleep(0.03)
            outcome = algo.step(16)
            exposed += outcome.comm_seconds
            step_times.append(time.perf_counter())
        finished = algo.finish()
        exposed += finished.comm_seconds if finished else 0.0
        return {"spans": exchange.spans, "steps": step_times, "exposed": exposed,
                "fingerprint": algo.fingerprint(), "outer_steps": algo.outer_step}

    return InProcessGroup(2, link).run(member, timeout=120)


def _steps_during_exchanges(result: dict) -> int:
    return sum(1 for t in result["steps"] for a, b in result["spans"] if a < t < b)


@pytest.mark.parametrize("name", ["diloco", "sparseloco"])
def test_delayed_round_runs_while_inner_steps_proceed(name: str) -> None:
    delayed = _overlap_run("delayed", name)
    blocking = _overlap_run("none", name)
    for r in delayed:
        assert len(r["spans"]) == 4 and r["outer_steps"] == 4  # 20 steps / H = 5
        # the rounds of phases 1-3 each ran while the next phase's steps ran (how many steps
        # fit in a round's 0.1 s depends on the machine's load: at least one does)
        for began, ended in r["spans"][:3]:
            assert any(began < t < ended for t in r["steps"]), r
    assert delayed[0]["fingerprint"] == delayed[1]["fingerprint"]
    for r in blocking:  # the blocking step: no inner step runs while its round does
        assert _steps_during_exchanges(r) == 0
        assert r["exposed"] >= 4 * 0.05
    # only the last round (landed by finish, after the last phase) is left exposed
    for fast, slow in zip(delayed, blocking):
        assert fast["exposed"] < 0.6 * slow["exposed"], (fast["exposed"], slow["exposed"])


def test_streaming_delayed_lands_each_fragment_one_period_later() -> None:
    """One fragment launched at step 2 of every H = 4: with the outer step delayed its update
    lands at step 6, as the fragment's next round starts, not tau steps after its launch."""
    from farlink.sync.streaming import StreamingDiLoCo

    alpha = 0.25
    cfg = RunConfig(algorithm="streaming_diloco", inner_steps=4, fragments=1, steps=8,
                    warmup_steps=0, overlap_steps=1, mix_alpha=alpha, outer_overlap="delayed")
    local = {0: torch.tensor([[0.0, 1.0]]), 1: torch.tensor([[1.0, 0.0]])}

    def member(rank: int, coll):  # noqa: ANN001, ANN202
        model = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        algo = StreamingDiLoCo(model, cfg, coll, Exchange(coll, make_compressor("none"),
                                                          sender=f"p{rank}"))
        after = []
        for t in range(1, 9):
            if t == 2:
                with torch.no_grad():
                    algo.params[0].copy_(local[rank])
            algo.step(16)
            after.append(algo.params[0].detach().clone())
        algo.finish()
        return after

    theta1 = torch.tensor([[1.0, 2.0]]) - 0.7 * 1.9 * torch.tensor([[0.5, 1.5]])
    for rank, after in enumerate(InProcessGroup(2).run(member, timeout=60)):
        for t in (2, 3, 4, 5):  # in flight through the next period's first steps
            assert torch.equal(after[t - 1], local[rank]), t
        torch.testing.assert_close(after[5], alpha * local[rank] + (1 - alpha) * theta1)


def test_streaming_delayed_keeps_every_fragment_in_flight_while_computing() -> None:
    from farlink.sync.streaming import StreamingDiLoCo

    link = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.1)
    init = threading.Lock()
    cfg = RunConfig(algorithm="streaming_diloco", inner_steps=8, fragments=2, steps=32,
                    warmup_steps=0, outer_overlap="delayed")

    def member(rank: int, coll):  # noqa: ANN001, ANN202
        with init:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        exchange = _Timed(coll, make_compressor("none"), sender=f"p{rank}")
        algo = StreamingDiLoCo(model, cfg, coll, exchange)
        gen = torch.Generator().manual_seed(rank + 1)
        steps, most_in_flight, exposed = [], 0, 0.0
        while not algo.finished():
            x = torch.randn(16, 8, generator=gen)
            (model(x) - x).pow(2).mean().backward()
            time.sleep(0.02)
            exposed += algo.step(16).comm_seconds
            steps.append(time.perf_counter())
            most_in_flight = max(most_in_flight, len(algo._queue))
        algo.finish()
        return {"spans": exchange.spans, "steps": steps, "most": most_in_flight,
                "globals": [g.clone() for g in algo.global_params], "exposed": exposed,
                "rounds": algo.fragment_rounds}

    results = InProcessGroup(2, link).run(member, timeout=120)
    for r in results:
        assert r["rounds"] == [4, 4]  # 32 steps / H = 8, each fragment every period
        assert r["most"] == 2  # both fragments' rounds in flight at once
        assert _steps_during_exchanges(r) >= 8 * 2  # 8 rounds, each overlapping steps
        assert r["exposed"] < 0.5 * 8 * 0.2
    for a, b in zip(results[0]["globals"], results[1]["globals"]):
        assert torch.equal(a, b)


def test_a_stop_request_ends_the_wait_for_the_round_in_flight() -> None:
    """A worker's Ctrl-C only sets farlink's stop flag: the wait for a delayed round that never
    lands (a peer gone mid-round) must end on it, naming what it waited for."""
    from concurrent.futures import Future

    from farlink import interrupt
    from farlink.sync.base import StepOutcome

    algo = _algo(InProcessGroup(1).member(0), "delayed")
    algo.delayed._future = Future()  # a round in flight that never lands
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            algo.delayed._wait(StepOutcome())
        except BaseException as exc:  # noqa: BLE001 - what the wait ended with
            raised.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    try:
        waiter.start()
        threading.Timer(0.3, interrupt.STOP.set).start()
        waiter.join(timeout=10)
    finally:
        interrupt.STOP.clear()
    assert not waiter.is_alive(), "the wait slept through the stop request"
    assert isinstance(raised[0], KeyboardInterrupt) and "delayed round" in str(raised[0])


@pytest.mark.parametrize(("name", "slow_round_start"),
                         [("diloco", False), ("sparseloco", False), ("diloco", True)])
def test_a_background_checkpoint_leaves_the_round_in_flight_and_holds_what_it_decided(
        name: str, slow_round_start: bool, tmp_path) -> None:  # noqa: ANN001
    """A checkpoint at the boundary, just after the round was launched, must not wait for that
    round in the training loop (with a checkpoint every round that wait put the whole WAN
    exchange back on the critical path); the file it writes still holds what the round
    decided: the same tensors as a checkpoint taken after the round landed.

    ``slow_round_start``: the wait for the last write (``before_round``) takes 0.3 s, as a
    round's thread that a busy machine starts late: the write submitted meanwhile waits for
    that round, so a round that waited for it from its own thread never ended."""
    import farlink
    from farlink.state.checkpoint import load_newest_intact

    latency = 0.5  # a round takes >= 2 latencies: 1 s
    init = threading.Lock()

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        with init:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        sync = farlink.Optimizer(model, None if name == "sparseloco" else inner,
                                 collective=collective, index=rank, backend="inprocess",
                                 algorithm=name, steps=20, inner_steps=5, warmup_steps=0,
                                 outer_overlap="eager",
                                 **({} if name == "sparseloco" else {"codec": "int4+ef"}))
        if slow_round_start:
            land_last_write = sync.algorithm.before_round

            def late() -> None:
                time.sleep(0.3)
                land_last_write()

            sync.algorithm.before_round = late
        gen = torch.Generator().manual_seed(rank + 1)
        saves = []
        for boundary in range(2):
            for _ in range(5):
                x = torch.randn(16, 8, generator=gen)
                (model(x) - x).pow(2).mean().backward()
                if name == "sparseloco":
                    inner.step()
                    inner.zero_grad()
                sync.step(tokens=16)
            sync.save(tmp_path / f"bg{rank}", background=True)
            still_in_flight = sync.algorithm.delayed.in_flight()
            sync.wait_for_checkpoint()
            blocking = sync.checkpoint_tensors()  # the round has landed by now
            written = load_newest_intact(tmp_path / f"bg{rank}").tensors
            saves.append({"in_flight": still_in_flight,
                          "written": written, "blocking": blocking, "boundary": boundary})
        sync.finish()
        sync.close()
        return saves

    results = InProcessGroup(2, LinkModel(bandwidth_bytes_per_s=1e9, latency_s=latency)).run(
        member, timeout=60)
    for saves in results:
        for s in saves:
            assert s["in_flight"], "the save waited for the round in flight"
            written, blocking = s["written"], s["blocking"]
            assert "counter.outer_step" in written and "delayed.members" in written
            if s["boundary"] == 1:  # round 2 landed: its average is in the file
                assert any(k.startswith("delayed.avg.") for k in written)
                assert int(written["counter.outer_step"]) == 2
            if name == "diloco":
                assert any(k.startswith("residual.") for k in written)
            # (save adds what this member knows of its peers, trust.*, beside the state)
            assert {k for k in written if not k.startswith("trust.")} == set(blocking)
            for k, v in blocking.items():
                if k != "rng.torch":  # the peers are threads of one process: one torch RNG
                    assert torch.equal(written[k], v), k
