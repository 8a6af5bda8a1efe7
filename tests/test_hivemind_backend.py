"""HivemindCollective across real peer processes on 127.0.0.1 (real p2p daemons, real sockets).

All tests here take 40-120 s on a busy 2-core machine (process start, p2p daemons, >= 2 s of
matchmaking per round), so they are marked slow. Each peer is a spawned process with its own DHT + collective; the parent only collects what each
peer reports per round and checks it against what the peers contributed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

import pytest
import torch

RUN = "hmtest"
TIMEOUTS = dict(
    matchmaking_time=2.0,
    request_timeout=1.0,
    round_timeout=60.0,
    allreduce_timeout=10.0,
    gather_timeout=10.0,
    commit_timeout=6.0,
    state_timeout=20.0,
    state_chunk_bytes=64,  # the 64-float state spans several chunks, fetched from several peers
)
# a healthy swarm's scenarios never wait a timeout out; long ones keep a peer that a loaded
# machine delays by seconds from giving up on a vote that the others then count
HEALTHY = dict(allreduce_timeout=30.0, gather_timeout=30.0, commit_timeout=30.0)
N1, N2, STATE_N = 1000, 37, 64


def contributions(k: int, round_id: int) -> list[torch.Tensor]:
    a = torch.arange(N1, dtype=torch.float32) * 0.5 + (k + 1) * 10 + round_id
    b = torch.full((N2,), float((k + 1) * (round_id + 1)))
    return [a, b]


def payload_for(k: int, round_id: int) -> bytes:
    return f"peer{k}-round{round_id}-".encode() * 3


def _peer(k: int, initial_peers: list[str], q, stop, plan: dict) -> None:
    torch.set_num_threads(1)
    from farlink.comm.hivemind_backend import HivemindCollective

    coll = HivemindCollective(
        f"{RUN}-{plan['run']}",
        initial_peers,
        client_mode=plan.get("client", False),
        min_group_size=plan["min_group"],
        **{**TIMEOUTS, **plan.get("timeouts", {})},
    )
    state = {"w": torch.full((STATE_N,), float(plan.get("state_value", 0.0)))}
    coll.register_state(lambda: {"w": state["w"].clone()}, lambda s: state.update(w=s["w"].clone()))
    q.put(("ready", k, str(coll.peer_id), coll.maddrs))
    for _ in range(plan["rounds"]):
        if stop.is_set():
            break
        t0 = time.perf_counter()
        info = coll.begin_round()
        tensors = contributions(k, info.round_id)
        b0 = coll.stats.bytes_sent
        coll.all_reduce_sum(tensors)
        ar_bytes, shards = coll.stats.bytes_sent - b0, list(coll.last_shards)
        b1 = coll.stats.bytes_sent
        gathered = coll.all_gather_bytes(payload_for(k, info.round_id))
        ag_bytes = coll.stats.bytes_sent - b1
        ok = coll.commit()
        if ok:
            state["w"] += 1.0  # the "outer step": committed state changes every round
        q.put(
            (
                "round",
                k,
                dict(
                    round_id=info.round_id,
                    rank=info.rank,
                    world=info.world_size,
                    peers=info.peers,
                    healed=info.healed,
                    sums=[t.tolist() for t in tensors],
                    gathered=gathered,
                    ar_bytes=ar_bytes,
                    ag_bytes=ag_bytes,
                    shards=shards,
                    ok=ok,
                    w=float(state["w"][0]),
                    w_const=bool((state["w"] == state["w"][0]).all()),
                    seconds=time.perf_counter() - t0,
                    state_sources=len(coll.last_state_sources),
                    phases=dict(coll.stats.phase_seconds),
                    comm_seconds=coll.stats.comm_seconds,
                ),
                None,
            )
        )
        time.sleep(plan.get("pause", 0.5))
    coll.close()
    q.put(("done", k, None, None))


class Swarm:
    """Spawned peers and what they reported."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.q = self.ctx.Queue()
        self.stop = self.ctx.Event()  # peers leave after their current round
        self.procs: dict[int, mp.Process] = {}
        self.peer_ids: dict[str, int] = {}
        self.rounds: dict[int, list[dict]] = {}
        self.done: set[int] = set()
        self.bootstrap: list[str] = []

    def start(self, k: int, plan: dict) -> None:
        p = self.ctx.Process(target=_peer, args=(k, self.bootstrap, self.q, self.stop, plan))
        p.start()
        self.procs[k] = p
        self.rounds[k] = []
        self.wait(lambda: k in self.peer_ids.values(), 90, f"peer {k} ready")

    def pump(self, timeout: float = 1.0) -> None:
        try:
            kind, k, a, b = self.q.get(timeout=timeout)
        except queue.Empty:
            return
        if kind == "ready":
            self.peer_ids[a] = k
            if not self.bootstrap:
                self.bootstrap = list(b)
        elif kind == "round":
            self.rounds[k].append(a)
        elif kind == "done":
            self.done.add(k)

    def wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; rounds: {self.rounds}")
            for k, p in self.procs.items():
                if p.exitcode not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"peer {k} crashed with exit code {p.exitcode}")
            self.pump()

    def kill(self, k: int) -> None:
        os.kill(self.procs[k].pid, signal.SIGKILL)
        self.procs[k].join(10)

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
            p.join(10)


@pytest.fixture
def swarm():
    s = Swarm()
    yield s
    s.close()


def check_round(swarm: Swarm, reports: list[dict]) -> None:
    """Every member of a committed round got the exact sum, all payloads in rank order, and
    sent exactly the bytes of the formula."""
    first = reports[0]
    peers = first["peers"]
    assert len(reports) == first["world"] == len(peers)
    ks = [swarm.peer_ids[p] for p in peers]
    expected = [sum(contributions(k, first["round_id"])[i] for k in ks) for i in range(2)]
    expected_payloads = [payload_for(k, first["round_id"]) for k in ks]
    for rep in reports:
        assert rep["ok"] and rep["peers"] == peers and rep["round_id"] == first["round_id"]
        for got, want in zip(rep["sums"], expected):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-6, atol=1e-4)
        assert rep["gathered"] == expected_payloads
        n, me, shards = len(peers), rep["rank"], rep["shards"]
        assert sum(shards) == N1 + N2
        assert rep["ar_bytes"] == 4 * ((N1 + N2 - shards[me]) + (n - 1) * shards[me])


def committed_by_round(swarm: Swarm, ks) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for k in ks:
        for rep in swarm.rounds[k]:
            if rep["ok"]:
                out.setdefault(rep["round_id"], []).append(rep)
    return out


@pytest.mark.slow
def test_three_peers_sum_gather_and_bytes(swarm: Swarm) -> None:
    plan = dict(run="a", rounds=3, min_group=3, timeouts=HEALTHY)
    for k in range(3):
        swarm.start(k, plan)
    swarm.wait(lambda: swarm.done == {0, 1, 2}, 150, "3 peers x 3 rounds")
    by_round = committed_by_round(swarm, range(3))
    assert sorted(by_round) == [0, 1, 2]
    for reports in by_round.values():
        assert {swarm.peer_ids[p] for p in reports[0]["peers"]} == {0, 1, 2}
        check_round(swarm, reports)
        for rep in reports:  # gather: payload to each of the 2 other (server) members
            assert rep["ag_bytes"] == len(payload_for(0, rep["round_id"])) * 2
        for rep in reports:  # every second in a collective is booked under one phase
            assert set(rep["phases"]) == {"matchmaking", "all_reduce", "all_gather", "commit"}
            assert sum(rep["phases"].values()) == pytest.approx(rep["comm_seconds"])
            assert all(seconds > 0 for seconds in rep["phases"].values())
    # shards are bandwidth-proportional (equal bandwidths -> nearly equal, whole parts)
    shards = by_round[0][0]["shards"]
    assert max(shards) - min(shards) <= (N1 + N2) // (8 * 3) + 2


@pytest.mark.slow
def test_client_mode_peer_takes_part(swarm: Swarm) -> None:
    for k in range(3):
        swarm.start(k, dict(run="d", rounds=2, min_group=3, client=(k == 2), timeouts=HEALTHY))
    swarm.wait(lambda: swarm.done == {0, 1, 2}, 150, "2 servers + 1 client x 2 rounds")
    by_round = committed_by_round(swarm, range(3))
    assert sorted(by_round) == [0, 1]
    for reports in by_round.values():
        check_round(swarm, reports)
        peers = reports[0]["peers"]
        client_rank = next(r for r, p in enumerate(peers) if swarm.peer_ids[p] == 2)
        server_ranks = [r for r in range(3) if r != client_rank]
        p = len(payload_for(0, reports[0]["round_id"]))
        for rep in reports:
            if rep["rank"] == client_rank:
                assert rep["shards"][client_rank] == 0  # a client reduces nothing
                assert rep["ag_bytes"] == 2 * p  # pushes to both servers, fetches the rest
            else:
                serves_client = server_ranks[client_rank % 2] == rep["rank"]
                assert rep["ag_bytes"] == p * 1 + (2 * p if serves_client else 0)


@pytest.mark.slow
def test_sigkilled_peer_is_dropped(swarm: Swarm) -> None:
    for k in range(3):
        swarm.start(k, dict(run="b", rounds=30, min_group=2))
    swarm.wait(lambda: len(swarm.rounds[2]) >= 2, 120, "two rounds before the kill")
    before_kill = len(swarm.rounds[0])
    swarm.kill(2)

    def two_peer_rounds() -> int:
        # peer 2 may have joined after peers 0 and 1 made 2-peer rounds of their own: only the
        # rounds after the kill count, and the first may have begun before it
        reps = [r for r in swarm.rounds[0][before_kill:] if r["ok"] and r["world"] == 2]
        return len(reps[1:])

    swarm.wait(lambda: two_peer_rounds() >= 2, 240, "survivors' 2-peer rounds")
    swarm.stop.set()
    swarm.wait(lambda: swarm.done == {0, 1}, 120, "survivors finish")
    last_with_2 = max(r["round_id"] for r in swarm.rounds[2])
    after = {
        rid: reps
        for rid, reps in committed_by_round(swarm, [0, 1]).items()
        if rid > last_with_2 and all(r["world"] == 2 for r in reps)
    }
    assert len(after) >= 2, f"survivors committed too few 2-peer rounds: {swarm.rounds}"
    for reports in after.values():
        assert {swarm.peer_ids[p] for p in reports[0]["peers"]} == {0, 1}
        check_round(swarm, reports)
    ids = [r["round_id"] for r in swarm.rounds[0] if r["ok"]]
    assert ids == list(range(len(ids)))  # round ids continue without gaps or repeats


@pytest.mark.slow
def test_newcomer_heals_from_peers_and_joins(swarm: Swarm) -> None:
    for k in range(3):
        swarm.start(k, dict(run="c", rounds=30, min_group=3, pause=1.0))
    swarm.wait(lambda: all(len(swarm.rounds[k]) >= 2 for k in range(3)), 150, "2 rounds")
    swarm.start(3, dict(run="c", rounds=2, min_group=3, state_value=-100.0))
    swarm.wait(lambda: len(swarm.rounds[3]) >= 2, 200, "newcomer's rounds")
    swarm.stop.set()
    first = swarm.rounds[3][0]
    assert first["healed"] and first["ok"] and first["world"] == 4
    assert first["round_id"] >= 2  # learned the current round from the swarm
    # state after its first commit = healed state (round_id) + 1, like everyone else's
    assert first["w"] == first["round_id"] + 1 and first["w_const"]
    assert first["state_sources"] >= 2  # chunks came from more than one up-to-date peer
    swarm.wait(lambda: swarm.done == {0, 1, 2, 3}, 200, "all peers finish")
    by_round = committed_by_round(swarm, range(4))
    four = [reps for reps in by_round.values() if reps[0]["world"] == 4]
    assert four
    for reports in four:
        check_round(swarm, reports)
    for reports in by_round.values():  # every peer holds the same state after each round
        assert len({r["w"] for r in reports}) == 1


def test_a_server_hands_each_payload_on_as_it_arrives_not_after_the_last() -> None:
    """What a client-mode member's fetch is answered from: payload 0 goes out while payload 2 is
    still on its way; a member known dead is not waited for; the deadline ends the wait."""
    import asyncio

    from farlink.comm.hivemind_backend import _Mailbox

    async def scenario() -> tuple[list, float, list, list]:
        box = _Mailbox()
        box.put(b"k", 0, b"zero")
        handed: list[tuple[int, bytes, bool]] = []
        started = time.monotonic()

        async def late() -> None:
            await asyncio.sleep(0.3)
            box.put(b"k", 2, b"two")

        task = asyncio.create_task(late())
        async for rank, data in box.arrivals(b"k", {0, 2}, time.monotonic() + 10):
            handed.append((rank, data, 2 in box.slots[b"k"]))  # was 2 there yet?
        await task
        took = time.monotonic() - started
        dead = [r async for r, _ in box.arrivals(b"k", {0, 1}, time.monotonic() + 10, {1})]
        expired = [r async for r, _ in box.arrivals(b"k", {0, 3}, time.monotonic() + 0.2)]
        return handed, took, dead, expired

    handed, took, dead, expired = asyncio.run(scenario())
    assert handed == [(0, b"zero", False), (2, b"two", True)]
    assert 0.3 <= took < 2.0
    assert dead == [0] and expired == [0]


def test_a_closed_collective_refuses_a_call_and_leaves_no_coroutine_behind() -> None:
    """Work asked of a closed peer fails at once, saying so, and its coroutine is closed: one
    handed to the stopped event loop never ran, timed out, and was later collected as "never
    awaited" in the middle of whatever the process did next."""
    import inspect

    from farlink.comm.errors import CommError
    from farlink.comm.hivemind_backend import HivemindCollective

    coll = HivemindCollective(f"{RUN}-closed", [], min_group_size=1, **TIMEOUTS)
    coll.close()
    work = coll._cancel_pending()
    with pytest.raises(CommError, match="closed"):
        coll._call(work, timeout=2)
    assert inspect.getcoroutinestate(work) == inspect.CORO_CLOSED
