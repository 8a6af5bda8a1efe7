"""farlink.Optimizer around models farlink did not build: every algorithm, injected optimizers,
authentication, exact resume; and the examples as real processes on torchft."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import farlink
from farlink.comm.inprocess import InProcessGroup
from farlink.config import RunConfig
from farlink.optimizer import JOIN_QUORUM_TIMEOUT
from farlink.sync import ALGORITHMS, capabilities
from farlink.testing.faults import Faults, FaultyCollective

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
FLAT = [a for a in ALGORITHMS if not capabilities(a).islands]


class Tiny(nn.Module):
    """Not farlink's GPT: a user's two-layer regressor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).squeeze(-1)


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(16, 4, generator=gen)
    return x, x.sum(-1)


def user_loop(sync: farlink.Optimizer, model: nn.Module, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = data(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        sync.step(tokens=len(x))


_INIT = threading.Lock()  # the peers are threads: torch's global RNG is shared between them


def replica(rank: int, collective, **options):  # noqa: ANN001, ANN201
    with _INIT:
        torch.manual_seed(0)
        model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    inner = None if not capabilities(options.get("algorithm", "diloco")).inner_optimizer else opt
    options.setdefault("steps", 100)  # DeMo schedules its own lr over the run
    return model, farlink.Optimizer(model, inner, collective=collective, index=rank,
                                    backend="inprocess", **options)


@pytest.mark.parametrize("algorithm", FLAT)
def test_every_flat_algorithm_wraps_a_users_model_and_optimizer(algorithm: str) -> None:
    def member(rank: int, collective):  # noqa: ANN001, ANN202
        model, sync = replica(rank, collective, algorithm=algorithm, inner_steps=5)
        before = [p.detach().clone() for p in model.parameters()]
        user_loop(sync, model, rank, 0, 20)
        sync.finish()
        moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return sync.fingerprint(), sync.outer_step, moved, sync.metrics()

    results = InProcessGroup(2).run(member)
    assert results[0][0] == results[1][0]  # the replicas' committed states agree
    assert all(r[1] > 0 and r[2] for r in results)
    assert results[0][3]["bytes_sent"] > 0


def test_users_optimizer_keeps_its_lr_and_an_injected_outer_optimizer_is_used() -> None:
    """Outer SGD lr 1 without momentum is plain averaging: after a round both replicas hold the
    mean of their local parameters (by hand), and the user's lr was not rescheduled."""

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        with _INIT:
            torch.manual_seed(0)
            model = Tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sync = farlink.Optimizer(
            model, opt, collective=collective, index=rank, backend="inprocess",
            algorithm="diloco", inner_steps=3,
            outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
        for step in range(2):
            x, y = data(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            sync.step(tokens=16)
        local = [p.detach().clone() for p in model.parameters()]
        x, y = data(rank, 2)
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():  # what the third inner step will leave (plain SGD, by hand)
            stepped = [p - 0.05 * p.grad for p in model.parameters()]
        outcome = sync.step(tokens=16)
        assert outcome.committed and opt.param_groups[0]["lr"] == 0.05
        return local, stepped, [p.detach().clone() for p in model.parameters()]

    (_, s0, p0), (_, s1, p1) = InProcessGroup(2).run(member)
    for a, b, after0, after1 in zip(s0, s1, p0, p1):
        torch.testing.assert_close(after0, (a + b) / 2)
        assert torch.equal(after0, after1)


def test_authenticated_run_through_the_api() -> None:
    def member(rank: int, collective):  # noqa: ANN001, ANN202
        model, sync = replica(rank, collective, algorithm="diloco", inner_steps=4,
                              auth="secret", secret="s3cret", codec="int8")
        user_loop(sync, model, rank, 0, 8)
        return sync.fingerprint(), sync.algorithm.last_exchange.accepted, sync.ledger.peers()

    (f0, accepted, peers), (f1, _, _) = InProcessGroup(2).run(member)
    assert f0 == f1 and len(accepted) == 2 and peers == sorted(accepted)


@pytest.mark.parametrize("algorithm", ["diloco", "streaming_diloco", "ddp", "demo", "sparseloco"])
def test_api_checkpoint_resumes_bit_for_bit(tmp_path: Path, algorithm: str) -> None:
    """One replica alone: 12 steps straight, against 7 + save + a fresh process's objects + load
    + 5; parameters and the committed state end identical, bit for bit."""

    def run(steps: list[tuple[int, int]]) -> tuple[list[torch.Tensor], str]:
        ckpt = tmp_path / f"{algorithm}-{len(steps)}"
        for start, stop in steps:
            own_wire = capabilities(algorithm).wire_codec is not None  # its own codec
            streaming = {"fragments": 2, "overlap_steps": 1} \
                if algorithm == "streaming_diloco" else {}  # options the others do not read
            model, sync = replica(0, None, algorithm=algorithm, inner_steps=5,
                                  codec="none" if own_wire else "int8+ef", **streaming)
            meta = sync.load(ckpt)
            assert (meta or {}).get("step", 0) == start
            user_loop(sync, model, 0, start, stop)
            sync.save(ckpt, step=stop)
            sync.close()
        return [p.detach().clone() for p in model.parameters()], sync.fingerprint()

    straight, f_straight = run([(0, 12)])
    resumed, f_resumed = run([(0, 7), (7, 12)])
    assert f_straight == f_resumed
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_a_newcomer_heals_from_a_live_replica_through_the_api(tmp_path: Path) -> None:
    """Replica 0 resumes a checkpoint two outer steps in; replica 1 starts from another init and
    joins: its zero-weight first round loads replica 0's verified state, and from then on both
    hold the same committed state."""
    model, alone = replica(0, None, algorithm="diloco", inner_steps=5)
    user_loop(alone, model, 0, 0, 10)
    alone.save(tmp_path)
    assert alone.outer_step == 2

    def member(rank: int, collective):  # noqa: ANN001, ANN202
        model, sync = replica(rank, collective, algorithm="diloco", inner_steps=5)
        if rank == 0:
            assert sync.load(tmp_path)["outer_step"] == 2
            user_loop(sync, model, 0, 10, 15)  # its regular round at step 15
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # not the run's state
            outcome = sync.join()
            assert outcome.committed and sync.healed
        joined = sync.fingerprint()
        user_loop(sync, model, rank, 15, 20)
        return joined, sync.fingerprint(), sync.outer_step

    recorded: list[RoundArguments] = []

    def recording(rank: int, collective):  # noqa: ANN001, ANN202
        if rank == 1:
            collective = RoundArguments(collective)
            recorded.append(collective)
        return member(rank, collective)

    (j0, f0, o0), (j1, f1, o1) = InProcessGroup(2).run(recording)
    assert j0 == j1 and f0 == f1 and o0 == o1 == 4
    # the newcomer's rounds say what they are; nothing was set on its collective and restored
    asked = recorded[0].asked
    assert asked[0] == {"joining": True, "timeout": JOIN_QUORUM_TIMEOUT, "tag": None}
    assert asked[1:] == [{"joining": False, "timeout": None, "tag": None}]
    assert recorded[0].quorum_timeout == 120


class RoundArguments(FaultyCollective):
    """An in-process member that records what each ``begin_round`` was asked."""

    _OWN = (*FaultyCollective._OWN, "asked")

    def __init__(self, inner) -> None:  # noqa: ANN001
        super().__init__(inner, Faults(), 1)
        self.asked: list[dict] = []

    def begin_round(self, final: bool = False, **round_options):  # noqa: ANN003, ANN201
        self.asked.append(round_options)
        return super().begin_round(final, **round_options)


def test_sparseloco_outer_step_is_the_same_from_the_cli_and_the_api(tmp_path: Path) -> None:
    """`farlink train` writes config.json and its workers read it back, which marks every field
    as given; the API gets only the options its caller named. Both must build SparseLoCo's own
    outer step (the paper's lr 1.0, accumulator decay 0.95), not DiLoCo's 0.7/0.9."""
    cli = RunConfig(algorithm="sparseloco", backend="inprocess", run_dir=tmp_path)
    (tmp_path / "config.json").write_text(cli.model_dump_json())
    stored = RunConfig.model_validate_json((tmp_path / "config.json").read_text())

    def outer(sync: farlink.Optimizer) -> tuple[float, float, float]:
        group = sync.algorithm.outer_opt.param_groups[0]
        return group["lr"], group["momentum"], sync.algorithm.beta

    from_cli = outer(farlink.Optimizer(Tiny(), config=stored))
    from_api = outer(farlink.Optimizer(Tiny(), algorithm="sparseloco", backend="inprocess",
                                       steps=100))
    assert from_cli == from_api == (1.0, 0.0, 0.95)
    given = farlink.Optimizer(Tiny(), algorithm="sparseloco", backend="inprocess", steps=100,
                              sparseloco_lr=0.5, sparseloco_beta=0.8)
    assert outer(given) == (0.5, 0.0, 0.8)


def test_two_replicas_on_hivemind_through_the_api() -> None:
    """Two replicas a user starts (threads here, each with its own DHT on 127.0.0.1) say
    workers=2: their rounds average the two of them (RunConfig's default of 4 launched workers
    must not make them wait for two more), and they end identical after three DiLoCo rounds.
    On ``emulate_link="home"`` their collectives are held as the link would hold them (the
    hivemind backend ignored the link before: only torchft's collectives were held)."""
    replicas = []
    for rank in range(2):
        with _INIT:
            torch.manual_seed(0)  # one init (as DiLoCo's θ starts); their data differ
            model = Tiny()
        peers = replicas[0][1].addresses if replicas else []
        sync = farlink.Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                 algorithm="diloco", inner_steps=3, backend="hivemind",
                                 workers=2, peers=peers, index=rank, quorum_timeout=30,
                                 emulate_link="home")
        replicas.append((model, sync))
    assert replicas[0][1].addresses and replicas[1][1].config.min_replicas == 2
    outcomes: list[list] = [[], []]

    def loop(rank: int) -> None:
        model, sync = replicas[rank]
        for step in range(9):
            x, y = data(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            outcome = sync.step(tokens=len(x))
            if outcome.synced:
                outcomes[rank].append((outcome.committed, outcome.world_size))

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert outcomes[0] == outcomes[1] == [(True, 2)] * 3
        (m0, s0), (m1, s1) = replicas
        assert s0.fingerprint() == s1.fingerprint() and s0.outer_step == 3
        assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
        home = s0.collective.emulated_link  # 70 ms a hop: three rounds' all-reduces, 2 hops each
        assert home is not None and home.latency_s == pytest.approx(0.07)
        for _, sync in replicas:
            assert sync.collective.stats.emulated_seconds >= 3 * 2 * home.latency_s
    finally:
        for _, sync in replicas:
            sync.close()


def test_a_given_collective_brings_its_own_emulated_link() -> None:
    """``emulate_link`` holds the collectives farlink builds; a collective the caller built
    without a link is refused with what to do (the link was set on it and never used: an
    in-process member reads its group's link), and one built with a link is taken as it is."""
    from farlink.comm.base import LinkModel
    from farlink.comm.inprocess import InProcessGroup
    from farlink.links import get_profile

    with pytest.raises(ValueError, match="has no emulated link: build it with one"):
        farlink.Optimizer(Tiny(), collective=InProcessGroup(2).member(0), backend="inprocess",
                          workers=2, steps=10, inner_steps=5, warmup_steps=1,
                          emulate_link="home")
    link = LinkModel.of_profile(get_profile("home"))
    member = InProcessGroup(2, link).member(0)
    sync = farlink.Optimizer(Tiny(), collective=member, backend="inprocess", workers=2,
                             steps=10, inner_steps=5, warmup_steps=1, emulate_link="home")
    try:
        assert sync.collective.emulated_link is link
    finally:
        sync.close()


def test_hivemind_through_the_api_asks_how_many_replicas() -> None:
    with pytest.raises(ValueError, match="workers=N"):
        farlink.Optimizer(Tiny(), torch.optim.SGD(Tiny().parameters(), lr=0.1),
                          backend="hivemind")


def test_hierarchical_diloco_with_islands_the_user_forms() -> None:
    """Two islands of two replicas (threads, in-process collectives): every replica passes its
    island's collective, each island's leader also the collective the leaders share. After two
    global rounds every replica holds the same committed state; only leaders crossed the slow
    link. The shared model learned: its loss on data no replica trained on fell."""
    from island_threads import run_islands

    def heldout(model: nn.Module) -> float:
        with torch.no_grad():
            return sum(nn.functional.mse_loss(model(x), y).item()
                       for x, y in (data(99, step) for step in range(4)))

    def member(worker: int, island, leaders) -> tuple:  # noqa: ANN001
        with _INIT:
            torch.manual_seed(0)
            model = Tiny()
        before = heldout(model)
        sync = farlink.Optimizer(
            model, torch.optim.SGD(model.parameters(), lr=0.05), index=worker,
            algorithm="hierarchical_diloco", backend="inprocess", steps=8, inner_steps=4,
            island_steps=2, collective=island, global_collective=leaders)
        user_loop(sync, model, worker, 0, 8)
        return sync.fingerprint(), sync.outer_step, sync.metrics(), before, heldout(model)

    results = run_islands(member)
    assert len({r[0] for r in results}) == 1 and all(r[1] == 2 for r in results)
    assert all(after < 0.9 * before for *_, before, after in results), \
        [(before, after) for *_, before, after in results]
    crossed = [r[2]["inter_bytes"] > 0 for r in results]
    assert crossed == [True, False, True, False]


def test_global_links_are_refused_by_a_one_level_algorithm() -> None:
    with pytest.raises(ValueError, match="hierarchical_diloco"):
        farlink.Optimizer(Tiny(), torch.optim.SGD(Tiny().parameters(), lr=0.1), steps=10,
                          inner_steps=5, backend="inprocess", global_lighthouse="h:1")


def test_a_loop_of_its_own_needs_only_the_public_surface(tmp_path: Path) -> None:
    """What `farlink train`'s loop asks, a user's loop can: where the run is, when to
    checkpoint, how long background writes held it, what failed."""
    model, sync = replica(0, None, algorithm="diloco", inner_steps=5, steps=12)
    boundaries = []
    while not sync.finished:
        x, y = data(0, sync.inner_steps)
        nn.functional.mse_loss(model(x), y).backward()
        outcome = sync.step(tokens=len(x))
        if sync.at_boundary(outcome):
            boundaries.append((sync.inner_steps, sync.outer_step, outcome.committed))
            sync.save(tmp_path, background=True)
    sync.wait_for_checkpoint()
    assert boundaries == [(5, 1, True), (10, 2, True)] and sync.inner_steps == 12
    assert sync.failed_rounds == 0 and not sync.healed and sync.traffic() == {}
    assert sync.checkpoint_wait_seconds >= 0 and (tmp_path / "LATEST").exists()
    sync.close()


def test_options_that_do_not_exist_or_conflict_are_clear_errors() -> None:
    model = Tiny()
    with pytest.raises(ValueError, match="inner_stepz"):
        farlink.Optimizer(model, backend="inprocess", inner_stepz=5)
    other = torch.optim.SGD(Tiny().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="exactly the model's trainable parameters"):
        farlink.Optimizer(model, other, backend="inprocess")
    with pytest.raises(ValueError, match="needs steps"):
        farlink.Optimizer(model, backend="inprocess")  # farlink's schedule needs the length
    with pytest.raises(ValueError, match="no injected outer optimizer"):
        farlink.Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="inprocess",
                          algorithm="ddp", outer_optimizer=lambda p: torch.optim.SGD(p, lr=1))
    with pytest.raises(ValueError, match="Lighthouse"):
        farlink.Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="torchft")


def test_capabilities_answer_what_config_and_planner_used_to_list_by_name() -> None:
    """DeMo syncs every step: the config used to say only DDP did (the planner said both)."""
    from farlink.plan import planned_algorithms, predict_round

    assert RunConfig(algorithm="demo").sync_every == 1
    for algorithm in planned_algorithms():
        cfg = RunConfig(algorithm=algorithm, inner_steps=7)
        wire = capabilities(algorithm).wire_codec  # DeMo's or SparseLoCo's own codec
        codec = "dct_topk:64:32" if wire == "dct_topk" else wire or "fp32"
        pred = predict_round(algorithm, 4, 1.0, 1e9, 0.01, n_params=1e6, inner_steps=7,
                             fragments=1, codec=codec)
        assert pred.steps_per_round == cfg.sync_every, algorithm
    with pytest.raises(ValueError, match="round_seconds"):
        RunConfig(algorithm="demo", round_seconds=5)
    with pytest.raises(ValueError, match="torchft"):
        RunConfig(algorithm="hierarchical_diloco", backend="hivemind")


# --- the examples' own loops on real torchft (replicas as threads) ----------------------------
class _BuiltSignal:
    """``farlink`` as an example sees it, saying when replica ``index`` has built its model (it
    calls ``farlink.Optimizer`` right after)."""

    def __init__(self, built: list[threading.Event]) -> None:
        self.built = built

    def Optimizer(self, *args, index: int, **kwargs):  # noqa: ANN002, ANN003, ANN201, N802
        self.built[index].set()
        return farlink.Optimizer(*args, index=index, **kwargs)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(farlink, name)


def run_example(name: str, workdir: Path, steps: int, replicas: int = 2) -> list[dict]:
    """The example's own ``train`` for each replica, as threads against torchft's Lighthouse
    served here, as the example's ``main`` serves it before starting a process per replica (the
    same ``train``, arguments and checkpoint paths); then what ``main`` prints as ``replicas
    agree: True``. Replica r starts once replica r-1 has built its model: each seeds torch's RNG,
    which is the process's, and builds its model from it."""
    import importlib.util

    from farlink.testing import in_threads, lighthouse_server

    spec = importlib.util.spec_from_file_location(f"example_{Path(name).stem}",
                                                  ROOT / "examples" / name)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    built = [threading.Event() for _ in range(replicas)]
    example.farlink = _BuiltSignal(built)

    with lighthouse_server(replicas, join_timeout_s=10.0) as address:
        def replica(rank: int, _member: object) -> dict:
            if rank:
                assert built[rank - 1].wait(120), f"replica {rank - 1} built no model"
            return example.train(address, rank, steps, workdir / "checkpoints" / f"r{rank}")

        results = in_threads(replica, dict.fromkeys(range(replicas)), timeout=300)
    results = [results[r] for r in range(replicas)]
    assert len({r["fingerprint"] for r in results}) == 1  # "replicas agree: True"
    return results


@pytest.mark.torchft_threads
def test_own_model_example_two_torchft_replicas_then_resume(tmp_path: Path) -> None:
    first = run_example("own_model.py", tmp_path, 30)
    assert len(first) == 2 and {r["outer_steps"] for r in first} == {3}
    assert all(r["heldout_after"] < r["heldout_before"] for r in first)
    # the same command with a longer budget resumes both replicas from their checkpoints
    again = run_example("own_model.py", tmp_path, 50)
    assert {r["outer_steps"] for r in again} == {5}
    assert len({r["fingerprint"] for r in again}) == 1


@pytest.mark.torchft_threads
def test_hf_llama_example_learns_on_two_torchft_replicas(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    results = run_example("hf_llama.py", tmp_path, 40)
    assert len(results) == 2
    assert all(r["heldout_after"] < math.log(64) / 2 and r["outer_steps"] > 0 for r in results)


def test_the_examples_loops_add_at_most_ten_lines() -> None:
    for name in ("own_model.py", "hf_llama.py"):
        text = (ROOT / "examples" / name).read_text()
        added = [line for line in text.splitlines() if line.rstrip().endswith("# farlink")
                 or "# farlink:" in line]
        assert 0 < len(added) <= 10, (name, len(added))


def test_public_names_are_the_lazy_exports() -> None:
    import farlink

    assert set(farlink.__all__) == {"__version__", *farlink._EXPORTS}
    assert all(getattr(farlink, name) is not None for name in farlink.__all__)


def test_peers_name_hivemind_initial_peers_and_lighthouse_is_torchft_s() -> None:
    """One word per backend: peers= is refused on torchft (with what to give instead), both at
    once are refused, and lighthouse= on hivemind is refused naming peers=."""
    from farlink.compose import join_address
    from farlink.config import RunConfig

    torchft, hivemind = RunConfig(backend="torchft"), RunConfig(backend="hivemind")
    with pytest.raises(ValueError, match="joins through lighthouse="):
        join_address(torchft, None, ["/ip4/127.0.0.1/tcp/1/p2p/Qm"])
    with pytest.raises(TypeError, match="not also lighthouse="):
        join_address(hivemind, "/ip4/127.0.0.1/tcp/1", ["/ip4/127.0.0.1/tcp/2"])
    assert join_address(hivemind, None, ["/a", "/b"]) == "/a,/b"
    with pytest.raises(ValueError, match=r"give the initial peers as peers="):
        join_address(hivemind, "/a", None)
    assert join_address(torchft, "http://h:1", None) == "http://h:1"
