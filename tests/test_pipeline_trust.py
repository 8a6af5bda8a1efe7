"""Stage peers serve only their run's driver, refuse a peer's broken answers and route the work
to a healthy peer of the stage: strangers on the stage port, NaN and wrong-shaped answers,
corrupt frames, NaN members of a stage average."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch

from farlink.model import GPTConfig
from farlink.parallel import wire
from farlink.parallel.peers import start_pipeline, stop_pipeline
from farlink.parallel.pipeline import PipelineTrainer

torch.set_num_threads(1)

MICRO = GPTConfig(vocab_size=97, n_layer=4, n_head=2, d_model=32, d_ff=64, seq_len=16)


def batch(seed: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, MICRO.vocab_size, (rows, MICRO.seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _stranger(address: str, message: wire.Message) -> wire.Message | None:
    """A local process that knows the stage port and the wire format but not the run's token:
    its reply, or None when the peer closed the connection without obeying."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            wire.send(sock, message)
            return wire.recv(sock)
        except (OSError, wire.CodecError):
            return None


def test_a_stranger_on_the_stage_port_can_neither_read_change_save_nor_stop_a_peer(
        tmp_path: Path) -> None:
    """Real stage processes: a stranger's state read, weight write (zeros), checkpoint into a
    directory of its choosing and shutdown are all refused; the driver still trains."""
    peers = start_pipeline(MICRO, 2)
    try:
        trainer = PipelineTrainer([[p.address for p in stage] for stage in peers],
                                  micro_batches=2)
        address = peers[0][0].address
        before = trainer.call(address, wire.Message("state")).tensors
        stolen = _stranger(address, wire.Message("state"))
        assert stolen is None or not stolen.tensors, "a stranger read the weights"
        zeros = {n: torch.zeros_like(t) for n, t in before.items()}
        _stranger(address, wire.Message("load", {}, zeros))
        chosen = tmp_path / "stranger-dir"
        _stranger(address, wire.Message("save", {"root": str(chosen), "step": 1}))
        _stranger(address, wire.Message("shutdown"))
        time.sleep(0.5)
        assert not chosen.exists(), "the peer wrote a checkpoint where a stranger said"
        assert peers[0][0].process.poll() is None, "a stranger shut the peer down"
        after = trainer.call(address, wire.Message("state")).tensors
        for name, tensor in before.items():
            assert torch.equal(after[name], tensor), f"a stranger changed {name}"
        report = trainer.step(*batch(1))
        assert report.failed_peers == [] and torch.isfinite(torch.tensor(report.loss))
    finally:
        stop_pipeline(peers)


# -- in-process stage peers on loopback (the subject is the protocol) ---------------------------
def _serve(stage: int, stages: int = 2, worker_class=None, checkpoint_dir: Path | None = None,
           token: str | None = None, server_class=None, **server_options):
    """A real StageServer of a real (or subclassed) StageWorker, on a thread; its address."""
    import threading

    from farlink.parallel import stage_auth
    from farlink.parallel.stage_server import StageServer, StageWorker
    from farlink.parallel.stages import build_stage

    worker = (worker_class or StageWorker)(build_stage(MICRO, 0, stage, stages),
                                           checkpoint_dir=checkpoint_dir)
    server = (server_class or StageServer)(worker, auth=stage_auth.driver_auth(token),
                                           **server_options)
    server.on_shutdown = server.stop
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.port}"


def test_stage_peer_refuses_a_wrong_token_and_a_member_that_is_not_the_driver(
        tmp_path: Path) -> None:
    from farlink.parallel import stage_auth
    from farlink.parallel.pipeline import StageError
    from farlink.robust.auth import SharedSecretAuth

    server, address = _serve(0, checkpoint_dir=tmp_path / "own")
    try:
        outsider = PipelineTrainer([[address], [address]],
                                   auth=stage_auth.driver_auth(stage_auth.new_token()))
        with pytest.raises(StageError, match=f"stage peer {address} refused this driver"):
            outsider.call(address, wire.Message("state"))
        deadline = time.monotonic() + 5  # the verdict reaches the driver before the peer
        while not server.refusals and time.monotonic() < deadline:  # records its refusal
            time.sleep(0.01)
        assert server.refusals and "does not verify" in server.refusals[-1][1]
        # holds the token but proves another id: may compute, not control
        helper = PipelineTrainer([[address], [address]], auth=SharedSecretAuth(
            stage_auth.driver_token(), peer_id="helper"))
        assert helper.call(address, wire.Message("ping")).meta["stage"] == 0
        with pytest.raises(StageError, match="only the run's driver"):
            helper.call(address, wire.Message("save", {"step": 1}))
        driver = PipelineTrainer([[address], [address]])
        # the driver's save goes under the peer's own directory, whatever the request names
        driver.call(address, wire.Message("save", {"root": str(tmp_path / "named"), "step": 1}))
        assert (tmp_path / "own").is_dir() and not (tmp_path / "named").exists()
        driver.close()  # its shutdown is obeyed
        server.stopped.wait(5)
        assert server.stopped.is_set()
    finally:
        server.stop()


def test_stage_peer_closes_a_connection_that_sends_garbage_instead_of_a_proof() -> None:
    server, address = _serve(1)
    try:
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"\x00" * 64)
            sock.settimeout(10)
            try:
                while sock.recv(4096):  # challenge, then the refusal, then the close
                    pass
            except ConnectionResetError:  # closed with our unread garbage in its buffer
                pass
        assert "not a farlink handshake" in server.refusals[-1][1]
        assert PipelineTrainer([[address], [address]]).call(
            address, wire.Message("ping")).meta["stage"] == 1
    finally:
        server.stop()


def test_control_operations_policy() -> None:
    from farlink.parallel.stage_auth import DRIVER, may_send

    drivers = frozenset({DRIVER})
    for op in ("load", "step", "save", "restore", "shutdown"):
        assert may_send(op, DRIVER, drivers) is None
        assert "only the run's driver" in may_send(op, "someone", drivers)
    assert may_send("forward", "someone", drivers) is None
    assert "unknown operation" in may_send("__init__", DRIVER, drivers)


# -- broken answers: a hostile stage peer built from the library's own StageWorker --------------
from farlink.parallel.stage_server import StageServer, StageWorker  # noqa: E402

NAN = float("nan")


class NaNActivations(StageWorker):
    def op_forward(self, request: wire.Message) -> wire.Message:
        y = super().op_forward(request).tensors["y"]
        return wire.Message("ok", {}, {"y": y * NAN})


class WrongShape(StageWorker):
    def op_forward(self, request: wire.Message) -> wire.Message:
        y = super().op_forward(request).tensors["y"]
        return wire.Message("ok", {}, {"y": y[:, :-1]})


class NaNLoss(StageWorker):
    def op_loss(self, request: wire.Message) -> wire.Message:
        reply = super().op_loss(request)
        return wire.Message("ok", {"loss": NAN}, reply.tensors)


class NaNGradient(StageWorker):
    def op_loss(self, request: wire.Message) -> wire.Message:
        reply = super().op_loss(request)
        return wire.Message("ok", reply.meta, {"dx": reply.tensors["dx"] * NAN})


class NaNWeights(StageWorker):
    def op_state(self, request: wire.Message) -> wire.Message:
        reply = super().op_state(request)
        return wire.Message("ok", reply.meta, {n: t * NAN for n, t in reply.tensors.items()})


class CorruptFrames(StageServer):
    """Sends every reply with its JSON header overwritten by bytes that are not JSON."""

    def _reply(self, conn, message, codecs) -> None:
        frame = bytearray(wire.encode(message, codecs))
        frame[8:12] = b"\xff\xfe\xfd\xfc"
        conn.sendall(bytes(frame))


def _two_by_two(hostile_stage: int, worker_class=None, server_class=StageServer):
    """2 stages x 2 in-process peers; peer 0 of ``hostile_stage`` is the hostile one."""
    servers = [[_serve(s, worker_class=worker_class if (s, p) == (hostile_stage, 0) else None,
                       server_class=server_class if (s, p) == (hostile_stage, 0) else StageServer)
                for p in range(2)] for s in range(2)]
    return servers, [[address for _, address in row] for row in servers]


def _finite(server: StageServer) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in server.worker.params.values())


@pytest.mark.parametrize("stage,worker_class,server_class", [
    (0, NaNActivations, StageServer), (0, WrongShape, StageServer), (1, NaNLoss, StageServer),
    (1, NaNGradient, StageServer), (0, None, CorruptFrames)],
    ids=["nan-activations", "wrong-shape", "nan-loss", "nan-gradient", "corrupt-frame"])
def test_a_broken_answer_is_refused_named_and_its_work_goes_to_the_stage_s_healthy_peer(
        stage, worker_class, server_class) -> None:
    servers, addresses = _two_by_two(stage, worker_class, server_class)
    hostile = addresses[stage][0]
    try:
        trainer = PipelineTrainer(addresses, micro_batches=4, timeout=30)
        reports = [trainer.step(*batch(k)) for k in range(2)]
        trainer.average_stages()
    finally:
        for row in servers:
            for server, _ in row:
                server.stop()
    assert reports[0].failed_peers == [hostile]
    assert hostile in reports[0].refused and reports[0].refused[hostile]
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in reports)
    assert hostile not in trainer.router.live(stage)
    for s, row in enumerate(servers):
        for p, (server, _) in enumerate(row):
            if (s, p) != (stage, 0):
                assert _finite(server), f"honest peer s{s}p{p} has non-finite weights"
                assert server.worker.steps == 2


def test_a_non_finite_loss_on_every_peer_of_a_stage_stops_the_step_with_a_clear_error() -> None:
    from farlink.parallel.swarm_router import StageUnavailable

    first, a = _serve(0)
    last, b = _serve(1, worker_class=NaNLoss)
    try:
        trainer = PipelineTrainer([[a], [b]], micro_batches=2)
        with pytest.raises(StageUnavailable, match=rf"stage 1 .*{b}: .*non-finite loss"):
            trainer.step(*batch(3))
    finally:
        first.stop()
        last.stop()
    assert _finite(first)


def test_stage_average_leaves_out_a_member_with_non_finite_weights() -> None:
    servers = [[_serve(0, worker_class=NaNWeights if p == 0 else None) for p in range(2)],
               [_serve(1) for _ in range(2)]]
    addresses = [[address for _, address in row] for row in servers]
    try:
        trainer = PipelineTrainer(addresses, micro_batches=4)
        trainer.average_stages()
        honest = servers[0][1][0]
        assert _finite(honest)
    finally:
        for row in servers:
            for server, _ in row:
                server.stop()


def test_stage_outer_sync_leaves_out_a_member_with_non_finite_weights() -> None:
    from farlink import compose
    from farlink.config import RunConfig
    from farlink.parallel.stage_sync import StageAveraging

    class TwoWeights(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2))

    weights = {"a": {"w": torch.tensor([1.0, 2.0])}, "b": {"w": torch.tensor([3.0, 4.0])},
               "bad": {"w": torch.tensor([NAN, 1.0])}, "odd": {"w": torch.zeros(3)}}
    stored: dict[str, torch.Tensor] = {}
    stage = compose.build_stage_members(RunConfig(algorithm="local_sgd"), 0, list(weights),
                                        TwoWeights)
    sync = StageAveraging([stage], lambda stage: list(weights), lambda peer: weights[peer],
                          lambda peer, theta: stored.__setitem__(peer, theta["w"].clone()))
    sync.sync(tokens=64)
    assert torch.equal(sync.globals[0]["w"], torch.tensor([2.0, 3.0]))  # mean of a and b
    assert {peer for _, peer, _ in sync.left_out} == {"bad", "odd"}
    assert all(torch.isfinite(w).all() for w in stored.values())
    assert set(stored) == set(weights)  # the left-out members take the new θ too
    assert torch.equal(stored["bad"], torch.tensor([2.0, 3.0]))


class Silent(StageWorker):
    """Takes its time: answers a forward pass only after 5 s."""

    def op_forward(self, request: wire.Message) -> wire.Message:
        time.sleep(5)
        return super().op_forward(request)


def test_a_peer_silent_past_the_stage_peer_timeout_is_routed_around() -> None:
    servers, addresses = _two_by_two(0, Silent)
    try:
        trainer = PipelineTrainer(addresses, micro_batches=4, timeout=1.0)
        started = time.monotonic()
        report = trainer.step(*batch(4))
        assert time.monotonic() - started < 4.5
    finally:
        for row in servers:
            for server, _ in row:
                server.stop()
    assert report.failed_peers == [addresses[0][0]]
    assert "timed out" in trainer.router.load[addresses[0][0]].why


def test_stage_peer_timeout_is_a_validated_run_option() -> None:
    from pydantic import ValidationError

    from farlink.config import RunConfig

    assert RunConfig().stage_peer_timeout == 120.0
    assert RunConfig(stage_peer_timeout=5).stage_peer_timeout == 5.0
    for bad in (0, -1, float("inf"), float("nan"), 1e9):
        with pytest.raises(ValidationError, match="stage_peer_timeout"):
            RunConfig(stage_peer_timeout=bad)
    with pytest.raises(ValueError, match="finite number of seconds"):
        PipelineTrainer([["127.0.0.1:1"], ["127.0.0.1:2"]], timeout=float("inf"))
