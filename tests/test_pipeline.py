"""Pipeline stages: split GPT, stage peers over TCP, gradients equal to the unsplit model's,
compressed activations, stochastic wiring and peers killed mid-run.

A peer that is SIGKILLed is a real stage process (``start_pipeline``); where the subject is the
pipeline's arithmetic, wiring or protocol, the peers are real ``StageServer``s of real
``StageWorker``s on threads of this process (:func:`pipeline_in_threads`), over the same
sockets and handshake."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from farlink.model import GPT, GPTConfig
from farlink.parallel import wire
from farlink.parallel.peers import start_pipeline, stop_pipeline
from farlink.parallel.pipeline import PipelineTrainer
from farlink.parallel.stage_auth import driver_auth
from farlink.parallel.stage_server import StageServer, StageWorker
from farlink.parallel.stages import build_stage, model_parameter_name, stage_bounds

torch.set_num_threads(1)

MICRO = GPTConfig(vocab_size=97, n_layer=4, n_head=2, d_model=32, d_ff=64, seq_len=16)


def batch(seed: int, rows: int = 8, config: GPTConfig = MICRO) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (rows, config.seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


@dataclass
class ThreadPeer:
    stage: int
    address: str  # host:port
    server: StageServer


def start_thread_peer(config: GPTConfig, stage: int, stages: int, lr: float = 3e-3) -> ThreadPeer:
    """What ``start_stage_peer`` starts (the same seed, optimizer and driver token), served
    on a thread of this process."""
    server = StageServer(StageWorker(build_stage(config, 0, stage, stages), lr),
                         auth=driver_auth())
    server.on_shutdown = server.stop
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return ThreadPeer(stage, f"127.0.0.1:{server.port}", server)


@contextmanager
def pipeline_in_threads(config: GPTConfig, stages: int, peers_per_stage: int = 1,
                        lr: float = 3e-3) -> Iterator[list[list[ThreadPeer]]]:
    """``start_pipeline``'s peers (by stage), served on threads; stopped on leaving."""
    peers: list[list[ThreadPeer]] = []
    try:
        for s in range(stages):
            peers.append([start_thread_peer(config, s, stages, lr)
                          for _ in range(peers_per_stage)])
        yield peers
    finally:
        for stage in peers:
            for peer in stage:
                peer.server.stop()


def unsplit_gradients(config: GPTConfig, tokens, targets, micro_batches: int):
    torch.manual_seed(0)
    model = GPT(config)
    for x, y in zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)):
        (model(x, y)[1] / micro_batches).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_stage_bounds_cover_every_block_once() -> None:
    assert stage_bounds(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="at least 2 stages"):
        stage_bounds(4, 1)
    with pytest.raises(ValueError, match="at most 4 stages"):
        stage_bounds(4, 5)


def test_stages_chained_in_process_compute_the_unsplit_loss() -> None:
    tokens, targets = batch(1, rows=2)
    torch.manual_seed(0)
    expected = GPT(MICRO)(tokens, targets)[1]
    stages = [build_stage(MICRO, 0, s, 3) for s in range(3)]
    x = tokens
    for stage in stages[:-1]:
        x = stage(x)
    assert torch.allclose(stages[-1].loss(x, targets), expected, atol=1e-6)
    assert model_parameter_name("blocks.0.attn.qkv.weight", 3) == "blocks.3.attn.qkv.weight"


@pytest.mark.parametrize("n_stages", [2, 3])
def test_pipelined_gradients_equal_unsplit_model(n_stages: int) -> None:
    """Stage peers over real sockets, 4 micro-batches in flight: fp32 gradients to 1e-5."""
    tokens, targets = batch(2)
    expected = unsplit_gradients(MICRO, tokens, targets, micro_batches=4)
    with pipeline_in_threads(MICRO, n_stages) as peers:
        trainer = PipelineTrainer([[p.address for p in stage] for stage in peers],
                                  micro_batches=4, in_flight=4)
        losses = trainer.forward_backward(tokens, targets)
        grads = trainer.gradients()
    assert len(losses) == 4
    assert all(load.in_flight == 0 for load in trainer.router.load.values())  # all work done
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert torch.allclose(grads[name], g, atol=1e-5, rtol=0), name
    assert trainer.bytes["activations"] > 0 and trainer.bytes["gradients"] > 0


def test_pipelined_adamw_steps_equal_unsplit_model_steps() -> None:
    """Three AdamW steps (weight decay, lr 1e-2) through 2 stage peers leave every weight,
    both copies of the tied embedding included, where the unsplit model's steps on the same
    micro-batches leave it (fp32, 1e-5)."""
    lr, steps = 1e-2, 3
    batches = [batch(50 + k) for k in range(steps)]
    torch.manual_seed(0)
    model = GPT(MICRO)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    for tokens, targets in batches:
        optimizer.zero_grad()
        for x, y in zip(tokens.chunk(4), targets.chunk(4)):
            (model(x, y)[1] / 4).backward()
        optimizer.step()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    with pipeline_in_threads(MICRO, 2, lr=lr) as peers:
        trainer = PipelineTrainer(_addresses(peers), micro_batches=4, in_flight=4, lr=lr)
        for tokens, targets in batches:
            trainer.step(tokens, targets)
        states = []
        for stage in _addresses(peers):
            start = trainer.call(stage[0], wire.Message("ping")).meta["start"]
            states.append({model_parameter_name(n, start): t for n, t in
                           trainer.call(stage[0], wire.Message("state")).tensors.items()})
    first, last = states
    assert torch.allclose(first["embed.weight"], last.pop("lm_head.weight"), atol=1e-5, rtol=0)
    torch.manual_seed(0)
    initial = dict(GPT(MICRO).named_parameters())
    assert set(first | last) == set(expected)
    for name, weight in (first | last).items():
        assert torch.allclose(weight, expected[name], atol=1e-5, rtol=0), name
        assert not torch.allclose(weight, initial[name], atol=1e-4), f"{name} did not move"


@pytest.mark.parametrize("spec", ["fp32", "int8", "int4", "topk:0.1"])
def test_frame_bytes_are_header_plus_codec_payloads(spec: str) -> None:
    import json
    import struct

    from farlink.codecs import make_codec

    y = torch.randn(2, 16, 32)
    targets = torch.randint(0, 97, (2, 16))
    message = wire.Message("loss", {"scale": 0.25}, {"x": y, "targets": targets.to(torch.int32)})
    frame = wire.encode(message, {"x": spec})
    (hlen,) = struct.unpack_from("<I", frame, 4)
    header = json.loads(frame[8:8 + hlen])
    codec = make_codec(spec)
    assert len(frame) == 8 + hlen + len(codec.encode(y)) + 4 * targets.numel()
    assert len(frame) <= 8 + hlen + codec.max_payload_nbytes(tuple(y.shape)) + 4 * targets.numel()
    received = wire.decode(frame[4:])
    assert received.nbytes == len(frame)
    assert torch.equal(received.tensors["targets"], targets)
    assert [t["codec"] for t in header["tensors"]] == [make_codec(spec).name, "raw"]
    if spec == "fp32":
        assert torch.equal(received.tensors["x"], y)
    if spec == "int8":  # blockwise absmax: off by at most half a step of the block's scale
        bound = y.reshape(-1, 64).abs().amax(1) / 127 / 2
        error = (received.tensors["x"] - y).reshape(-1, 64).abs().amax(1)
        assert bool((error <= bound * 1.01 + 1e-8).all())


@pytest.mark.slow  # pipeline training through the CLI runs by default
def test_compressed_activations_cut_bytes_by_the_codec_ratio_and_keep_gradients_close() -> None:
    """Activations wide enough that frame headers are a few percent of the fp32 payload."""
    wide = GPTConfig(vocab_size=97, n_layer=2, n_head=2, d_model=128, d_ff=128, seq_len=32)
    tokens, targets = batch(3, config=wide)
    runs = {}
    for spec in ("fp32", "int8", "int4"):
        peers = start_pipeline(wide, 2)
        try:
            trainer = PipelineTrainer([[p.address for p in stage] for stage in peers],
                                      micro_batches=4, activation_codec=spec)
            trainer.forward_backward(tokens, targets)
            runs[spec] = (trainer.gradients(), dict(trainer.bytes))
        finally:
            stop_pipeline(peers)
    exact, fp32_bytes = runs["fp32"]
    numel = 2 * wide.seq_len * wide.d_model  # one micro-batch's activations
    for spec, ratio in (("int8", 4 * numel / (numel + numel // 64 * 2)),
                        ("int4", 4 * numel / (numel // 2 + numel // 64 * 2))):
        grads, nbytes = runs[spec]
        for kind in ("activations", "gradients"):
            measured = fp32_bytes[kind] / nbytes[kind]
            assert ratio * 0.85 < measured <= ratio, (spec, kind, measured, ratio)
        for name, g in exact.items():
            cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), g.flatten(), 0)
            assert cosine > (0.99 if spec == "int8" else 0.9), (spec, name, float(cosine))
        assert not torch.equal(grads["blocks.0.mlp.up.weight"], exact["blocks.0.mlp.up.weight"])


def test_router_sends_more_to_faster_peers_and_skips_failed_ones() -> None:
    from farlink.parallel.swarm_router import StageUnavailable, ThroughputRouter

    router = ThroughputRouter([["a", "b"], ["fast", "slow"]])
    seconds = {"fast": 1.0, "slow": 3.0}
    busy: list[str] = []
    for _ in range(40):  # 4 in flight at a time, finished in order of arrival
        busy.append(router.choose(1))
        if len(busy) == 4:
            peer = busy.pop(0)
            router.finished(peer, seconds[peer])
    served = {p: router.load[p].served for p in seconds}
    assert served["fast"] >= 2 * served["slow"] > 0, served
    assert router.bottleneck() == 1  # stage 0's peers were never measured: unknown = fast
    for peer in ("a", "b"):
        assert router.choose(0) == peer  # each unmeasured peer is tried once
    for peer in ("a", "b"):
        router.finished(peer, 10.0)  # 0.2 micro-batches/s together, below stage 1's 1.33
    assert router.bottleneck() == 0
    router.failed("fast")
    assert {router.choose(1) for _ in range(5)} == {"slow"}
    router.failed("slow")
    with pytest.raises(StageUnavailable, match="stage 1 has no live peer"):
        router.choose(1)


def _addresses(peers) -> list[list[str]]:
    return [[p.address for p in stage] for stage in peers]


def _kill_first_sent(trainer: PipelineTrainer, stage, op: str, at_step: int) -> list:
    """SIGKILL whichever peer of ``stage`` the trainer first sends an ``op`` request in step
    ``at_step`` (0-based) or later, just before the request: it meets a dead peer at a known
    point of a step whichever peer the router (which routes by measured speed) picked. The
    returned list gets the victim."""
    original, victims, one_at_a_time = trainer.call, [], threading.Lock()

    def call(peer, message, *args, **kwargs):
        with one_at_a_time:  # micro-batches run in threads: one victim per stage
            if (not victims and message.op == op and trainer.steps >= at_step
                    and peer in [p.address for p in stage]):
                victim = next(p for p in stage if p.address == peer)
                victim.kill()
                victims.append(victim)
        return original(peer, message, *args, **kwargs)

    trainer.call = call
    return victims


# by default: test_pipeline_train's
# test_a_stage_peer_killed_mid_run_is_routed_around_and_the_run_finishes (a stage process
# SIGKILLed, its work re-routed, every step committed) and
# test_router_sends_more_to_faster_peers_and_skips_failed_ones
@pytest.mark.slow
def test_killing_a_peer_of_each_stage_mid_step_loses_no_committed_step() -> None:
    """2 stages x 2 peers: a first-stage peer is SIGKILLed in step 2 between a micro-batch's
    forward and backward pass (its graph dies: the forward is redone on the other peer), and a
    last-stage peer in step 4 just before a loss pass is sent to it (re-routed)."""
    peers = start_pipeline(MICRO, 2, peers_per_stage=2)
    try:
        trainer = PipelineTrainer(_addresses(peers), micro_batches=4, in_flight=4,
                                  average_every=2)
        first_victims = _kill_first_sent(trainer, peers[0], "backward", 1)
        last_victims = _kill_first_sent(trainer, peers[1], "loss", 3)
        tokens, targets = batch(10)  # one batch, again and again: its loss must fall
        reports = [trainer.step(tokens, targets) for _ in range(6)]
        first, second = first_victims[0].address, last_victims[0].address
        survivors = [p.address for stage in peers for p in stage if p.address not in
                     (first, second)]
        survivor_steps = [trainer.call(p, wire.Message("ping")).meta["steps"] for p in survivors]
    finally:
        stop_pipeline(peers)
    assert [r.step for r in reports] == [1, 2, 3, 4, 5, 6]
    killed_at = [(peer, i) for i, r in enumerate(reports) for peer in r.failed_peers]
    # each victim fails once, in the step its kill was due (or the first after that routed
    # work to its stage), and that step re-routed its work
    assert sorted(p for p, _ in killed_at) == sorted([first, second]), killed_at
    step_of = dict(killed_at)
    assert step_of[first] >= 1 and step_of[second] >= 3, killed_at
    assert all(reports[i].reroutes >= 1 for _, i in killed_at)
    assert survivor_steps == [6, 6]  # every step committed on every live peer
    assert all(r.lost_stage_gradients == 0 for r in reports)  # no finished work died
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in reports)
    assert reports[-1].loss < reports[0].loss


def test_peers_of_a_stage_average_and_a_joiner_takes_the_stage_weights() -> None:
    with pipeline_in_threads(MICRO, 2, peers_per_stage=2) as peers:
        trainer = PipelineTrainer(_addresses(peers), micro_batches=4, in_flight=4)
        trainer.step(*batch(20))
        states = [trainer.call(p.address, wire.Message("state")).tensors for p in peers[1]]
        served = [trainer.router.load[p.address].served for p in peers[1]]
        assert min(served) > 0, served  # both peers trained on part of the batch ...
        name = "blocks.0.mlp.up.weight"
        assert not torch.equal(states[0][name], states[1][name])  # ... so they drifted apart
        trainer.average_stages()
        states = [trainer.call(p.address, wire.Message("state")).tensors for p in peers[1]]
        for n in states[0]:
            assert torch.equal(states[0][n], states[1][n]), n
        joiner = start_thread_peer(MICRO, trainer.router.bottleneck(), 2)
        peers.append([joiner])  # stopped with the others
        trainer.add_peer(joiner.stage, joiner.address)
        joined = trainer.call(joiner.address, wire.Message("state")).tensors
        donor = trainer.call(trainer.router.live(joiner.stage)[0], wire.Message("state")).tensors
        assert all(torch.equal(joined[n], donor[n]) for n in donor)
        report = trainer.step(*batch(21))
        assert trainer.router.load[joiner.address].served > 0 and report.failed_peers == []


def test_placement_keeps_stage_boundaries_inside_sites_and_beats_random() -> None:
    from farlink.parallel.placement import (
        PipelineCost,
        evaluate,
        grouped_links,
        place,
        random_placements,
    )

    # two sites of two peers: 1 Gbit/s, 1 ms inside; home links (50 Mbit/s, 120 ms RTT) across
    links = grouped_links([[0, 2], [1, 3]], (1000.0, 1.0), (50.0, 120.0))
    cost = PipelineCost(activation_bytes=1e6, stage_compute_s=0.01, micro_batches=4)
    best = place(links, 2, cost)
    assert {frozenset(row) for row in best.grid} == {frozenset({0, 2}), frozenset({1, 3})}
    # by hand: boundary 0.5 ms + 8 Mbit / 1 Gbit/s = 8.5 ms; fill 2 x 10 ms + 2 x 8.5 ms;
    # then 3 more micro-batches at the 10 ms compute bottleneck
    assert best.step_s == pytest.approx(0.020 + 0.017 + 3 * 0.010)
    across = evaluate(links, [0, 1, 2, 3], 2, cost)  # both boundaries cross the home link
    assert across.slowest_link_s == pytest.approx(0.060 + 8e6 / 50e6)
    randoms = [p.step_s for p in random_placements(links, 2, cost, samples=100)]
    assert best.step_s <= min(randoms) and best.step_s < sum(randoms) / len(randoms) / 3


def test_random_baselines_differ_from_the_chosen_placement_by_site_pattern() -> None:
    """Two sites of two peers: relabelling peers inside a site is not another placement; of
    the four site patterns only three differ from the chosen one, and all three are drawn."""
    from farlink.parallel.placement import (
        PipelineCost,
        distinct_random_placements,
        grouped_links,
        place,
        site_pattern,
    )

    site_of = {0: 0, 2: 0, 1: 1, 3: 1}
    links = grouped_links([[0, 2], [1, 3]], (1000.0, 1.0), (5.0, 200.0))
    cost = PipelineCost(activation_bytes=1e5, micro_batches=2)
    chosen = place(links, 2, cost)
    assert site_pattern(chosen.grid, site_of) == ((0, 0), (1, 1))
    randoms = distinct_random_placements(links, 2, cost, chosen, samples=5, site_of=site_of)
    patterns = {site_pattern(p.grid, site_of) for p in randoms}
    assert patterns == {((0, 1), (1, 0)), ((0, 1), (0, 1)), ((1, 0), (1, 0))}
    assert all(p.step_s > 10 * chosen.step_s for p in randoms)


def test_messages_sharing_an_emulated_wire_queue_behind_each_other() -> None:
    """Two frames sent at once over one ShapedLink take twice one frame's wire time (as two
    micro-batches on one real link do); over a LinkModel each is held on its own."""
    import socket
    import threading
    import time

    from farlink.comm.base import LinkModel
    from farlink.emulate.shaper import ShapedLink
    from farlink.links import LinkProfile

    message = wire.Message("forward", {}, {"x": torch.zeros(50_000)})  # ~200 kB frame
    seconds = len(wire.encode(message)) * 8 / 8e6  # at 8 Mbit/s: ~0.2 s
    for link, expected in ((ShapedLink(LinkProfile(bandwidth_mbit=8.0)), 2 * seconds),
                           (LinkModel.of(8.0, 0.0), seconds)):
        pairs = [socket.socketpair() for _ in range(2)]
        started = time.perf_counter()
        senders = [threading.Thread(target=wire.send, args=(a, message, None, link))
                   for a, _ in pairs]
        for t in senders:
            t.start()
        for _, b in pairs:
            assert wire.recv(b).tensors["x"].shape == (50_000,)
        elapsed = time.perf_counter() - started
        for t in senders:
            t.join()
        for a, b in pairs:
            a.close()
            b.close()
        assert expected * 0.95 <= elapsed < expected + 0.15, (type(link).__name__, elapsed)


def test_placement_search_beyond_exhaustive_finds_the_site_pipelines() -> None:
    from farlink.parallel.placement import PipelineCost, grouped_links, place

    sites = [[0, 5, 7], [1, 3, 8], [2, 4, 6], [9, 10, 11]]
    links = grouped_links(sites, (1000.0, 1.0), (50.0, 120.0))
    best = place(links, 3, PipelineCost(activation_bytes=1e6, micro_batches=8))
    assert {frozenset(row) for row in best.grid} == {frozenset(s) for s in sites}
    with pytest.raises(ValueError, match="multiple of the stage count"):
        place(links, 5, PipelineCost(activation_bytes=1.0))


def test_pipelined_evaluation_equals_the_unsplit_model() -> None:
    from farlink.data import evaluate

    batches = [batch(30 + i, rows=3) for i in range(2)]
    torch.manual_seed(0)
    expected = evaluate(GPT(MICRO), batches)
    with pipeline_in_threads(MICRO, 2) as peers:
        trainer = PipelineTrainer(_addresses(peers), micro_batches=1)
        assert trainer.evaluate(batches) == pytest.approx(expected, abs=1e-5)


def test_router_counts_backward_work_it_did_not_choose() -> None:
    from farlink.parallel.swarm_router import ThroughputRouter

    router = ThroughputRouter([["a"], ["b"]])
    router.finished(router.choose(0), 1.0)  # forward
    router.begin("a")  # its backward goes to the same peer, unchosen
    assert router.load["a"].in_flight == 1
    router.finished("a", 1.0)
    assert router.load["a"].in_flight == 0 and router.load["a"].served == 2


def test_fixed_pipelines_wire_micro_batch_i_to_pipeline_i_mod_p() -> None:
    with pipeline_in_threads(MICRO, 2, peers_per_stage=2) as peers:
        # both pipelines through the first peer of stage 0: the router alone would share out
        pipelines = [[peers[0][0].address, peers[1][1].address],
                     [peers[0][0].address, peers[1][0].address]]
        trainer = PipelineTrainer(_addresses(peers), micro_batches=4, pipelines=pipelines)
        trainer.step(*batch(40))
    served = {a: trainer.router.load[a].served for stage in _addresses(peers) for a in stage}
    # stage 0: 4 forward + 4 backward passes on the shared peer; stage 1: 2 loss passes each
    assert served == {peers[0][0].address: 8, peers[0][1].address: 0,
                      peers[1][0].address: 2, peers[1][1].address: 2}
    with pytest.raises(ValueError, match="one peer per stage"):
        PipelineTrainer(_addresses(peers), pipelines=[[peers[0][0].address]])


def test_bench_reuse_keeps_rows_of_the_same_settings_only(tmp_path) -> None:
    import json

    from farlink.bench.pipeline import _finished_rows

    path = tmp_path / "pipeline.json"
    assert _finished_rows(path, "tiny", 100, 8, "home") == {}
    path.write_text(json.dumps({"created": "2026-01-01T00:00:00", "model": "tiny", "steps": 100,
                                "batch_size": 8, "link": "home",
                                "rows": [{"label": "pipeline", "final_heldout_loss": 5.5}]}))
    kept = _finished_rows(path, "tiny", 100, 8, "home")
    assert kept == {"pipeline": {"label": "pipeline", "final_heldout_loss": 5.5,
                                 "run_at": "2026-01-01T00:00:00"}}
    assert _finished_rows(path, "tiny", 50, 8, "home") == {}  # other steps: run everything


@pytest.mark.slow
def test_placement_bench_writes_distinct_baselines_and_a_plot(tmp_path) -> None:
    """One trial of ``bench pipeline --placement``: the chosen placement, three random ones
    with other site patterns, the chosen one faster; JSON and PNG written."""
    from farlink.bench.pipeline import run_placement

    found = run_placement(tmp_path, trials=1, steps=1)
    patterns = [tuple(map(tuple, r["site_pattern"])) for r in found["rows"]]
    assert len(patterns) == 4 and len(set(patterns)) == 4
    assert found["rows"][0]["predicted_step_s"] < min(r["predicted_step_s"]
                                                      for r in found["rows"][1:])
    assert found["chosen_vs_best_random"] < 1
    assert (tmp_path / "pipeline_placement.json").exists()
    assert (tmp_path / "pipeline_placement.png").stat().st_size > 10_000


def test_trainer_reuses_its_connections_to_a_stage_peer() -> None:
    """Every request used to open a TCP connection: a round trip before each request could
    leave, on every link. The trainer keeps them: after 3 steps of 4 micro-batches (each stage
    serves at least 12 requests), a peer has accepted no more connections than requests were
    in flight at once, plus the step's side-by-side calls."""
    with pipeline_in_threads(MICRO, 2) as peers:
        trainer = PipelineTrainer(_addresses(peers), micro_batches=4, in_flight=2)
        for step in range(3):
            trainer.step(*batch(30 + step))
        accepted = [trainer.call(p.address, wire.Message("ping")).meta["connections"]
                    for stage in peers for p in stage]
    assert all(1 <= n <= 4 for n in accepted), accepted


def test_each_fixed_pipeline_steps_as_the_unsplit_model_on_its_own_micro_batches() -> None:
    """2 stages x 2 peers wired as two fixed pipelines: micro-batches 0 and 2 go through
    pipeline 0, 1 and 3 through pipeline 1. Each pipeline's peers step exactly as an unsplit
    model on that pipeline's micro-batches alone, both copies of the tied embedding included:
    the embedding's gradient from the other end is its own pipeline partner's, not the mean
    over both pipelines."""
    lr = 1e-2
    tokens, targets = batch(60)
    chunks = list(zip(tokens.chunk(4), targets.chunk(4)))
    with pipeline_in_threads(MICRO, 2, peers_per_stage=2, lr=lr) as peers:
        pipelines = [[peers[0][p].address, peers[1][p].address] for p in range(2)]
        trainer = PipelineTrainer(_addresses(peers), micro_batches=4, lr=lr,
                                  pipelines=pipelines)
        trainer.step(tokens, targets)
        states = [[{model_parameter_name(n, trainer.call(a, wire.Message("ping")).meta["start"]):
                    t for n, t in trainer.call(a, wire.Message("state")).tensors.items()}
                   for a in pipeline] for pipeline in pipelines]
    for p, (first, last) in enumerate(states):
        torch.manual_seed(0)
        model = GPT(MICRO)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                      weight_decay=0.1)
        for x, y in chunks[p::2]:
            (model(x, y)[1] / 2).backward()
        optimizer.step()
        expected = dict(model.named_parameters())
        assert torch.allclose(last.pop("lm_head.weight"), expected["embed.weight"], atol=1e-5,
                              rtol=0), f"pipeline {p}: head"
        for name, weight in (first | last).items():
            assert torch.allclose(weight, expected[name], atol=1e-5, rtol=0), f"{p}: {name}"


@pytest.mark.slow
def test_bench_rows_train_on_equal_tokens_when_the_preset_context_differs(tmp_path) -> None:
    """The nano preset's own context is 64 tokens, data parallel's runs 128: the pipeline rows
    used the preset's and trained on half the tokens of the data-parallel row."""
    from farlink.bench.pipeline import run

    found = run(tmp_path, model="nano", steps=3, codecs=(), eval_every=3)
    tokens = [row["tokens"] for row in found["rows"]]
    assert tokens == [3 * 8 * 128] * 2, tokens
