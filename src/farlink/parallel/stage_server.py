"""One peer serving one pipeline stage: forward, backward and optimizer steps on request.

A stage peer is a small server (SWARM's and Petals' shape): a trainer sends it a micro-batch's
activations, it runs its blocks and keeps the autograd graph until the matching activation
gradient comes back, then returns the gradient of its input. Parameter gradients accumulate
over the micro-batches of a step; ``step`` applies this peer's AdamW. Work runs on one compute
thread in priority order, backward before forward (the 1F1B rule: finishing a micro-batch frees
its activations before a new one is started), while connection threads carry bytes, so a stage
computes while its links move the previous micro-batch.

Run as ``python -m farlink.parallel.stage_server --stage I --stages S --model tiny ...``; it
prints ``READY <port>`` once it accepts connections. SIGKILL at any time loses only this peer's
uncommitted work: the trainer re-routes its micro-batches to another peer of the stage.

A stage peer serves only its run's driver (:mod:`farlink.parallel.stage_auth`): every
connection proves the driver's per-run token (``FARLINK_STAGE_TOKEN``) before any request is
read, and checkpoints go only under the peer's own ``--checkpoint-dir``, never a directory a
request names.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from farlink.codecs import CodecError
from farlink.comm.base import LinkModel
from farlink.model import GPTConfig
from farlink.parallel import stage_auth, wire
from farlink.robust.auth import Authenticator
from farlink.robust.gate import LogLimiter
from farlink.parallel.stages import PipelineStage, build_stage

#: work an optimizer step costs per parameter: weights, gradients and AdamW's two moments (fp32)
TRAINING_BYTES_PER_PARAMETER = 16


def training_memory_bytes(parameters: int) -> int:
    """Bytes of weights + gradients + AdamW moments, the floor a peer needs to train them."""
    return TRAINING_BYTES_PER_PARAMETER * parameters


class StageWorker:
    """The stage's state and its operations; transport-free so it can be tested in-process."""

    def __init__(self, stage: PipelineStage, lr: float = 3e-3, weight_decay: float = 0.1,
                 slowdown: float = 1.0, checkpoint_dir: Path | None = None) -> None:
        self.stage = stage
        self.checkpoint_dir = checkpoint_dir  # the only place this peer writes checkpoints
        self.params = dict(stage.named_parameters())
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr, betas=(0.9, 0.95),
                                           weight_decay=weight_decay)
        self.slowdown = slowdown
        self.pending: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.steps = 0
        self.micro_batches = 0  # backward passes accumulated since the last step
        self.connections = 0  # accepted by its server (a trainer keeps and reuses them)

    def handle(self, request: wire.Message) -> wire.Message:
        started = time.perf_counter()
        reply = getattr(self, f"op_{request.op}")(request)
        if self.slowdown > 1 and request.op in ("forward", "loss", "backward"):
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        return reply

    def op_ping(self, request: wire.Message) -> wire.Message:
        return wire.Message("ok", {"stage": self.stage.stage, "start": self.stage.start,
                                   "steps": self.steps, "pid": os.getpid(),
                                   "connections": self.connections})

    def _input(self, request: wire.Message) -> torch.Tensor | None:
        x = request.tensors["x"]
        if self.stage.is_first:
            return x
        return x.requires_grad_(True)

    def op_forward(self, request: wire.Message) -> wire.Message:
        x = self._input(request)
        y = self.stage(x)
        self.pending[request.meta["mb"]] = (None if self.stage.is_first else x, y)
        return wire.Message("ok", {}, {"y": y.detach()})

    def op_loss(self, request: wire.Message) -> wire.Message:
        x = self._input(request)
        loss = self.stage.loss(x, request.tensors["targets"])
        (loss * float(request.meta.get("scale", 1.0))).backward()
        self.micro_batches += 1
        return wire.Message("ok", {"loss": float(loss.detach())}, {"dx": x.grad})

    def op_backward(self, request: wire.Message) -> wire.Message:
        mb = request.meta["mb"]
        if mb not in self.pending:
            raise KeyError(f"no forward pass pending for micro-batch {mb}")
        x, y = self.pending.pop(mb)
        y.backward(request.tensors["dy"])
        self.micro_batches += 1
        return wire.Message("ok", {}, {} if x is None else {"dx": x.grad})

    def op_evaluate(self, request: wire.Message) -> wire.Message:
        """Forward only, nothing kept: activations, or on the last stage the mean loss."""
        was_training = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad():
                if self.stage.is_last:
                    loss = self.stage.loss(request.tensors["x"], request.tensors["targets"])
                    return wire.Message("ok", {"loss": float(loss)})
                return wire.Message("ok", {}, {"y": self.stage(request.tensors["x"])})
        finally:
            self.stage.train(was_training)

    def op_grads(self, request: wire.Message) -> wire.Message:
        names = request.meta.get("names") or list(self.params)
        return wire.Message("ok", {}, {n: self._grad(n) for n in names})

    def _grad(self, name: str) -> torch.Tensor:
        grad = self.params[name].grad
        return torch.zeros_like(self.params[name]) if grad is None else grad

    def op_tied_grad(self, request: wire.Message) -> wire.Message:
        tied = self.stage.tied_weight()
        if tied is None:
            raise ValueError(f"stage {self.stage.stage} holds no tied embedding")
        grad = torch.zeros_like(tied) if tied.grad is None else tied.grad
        return wire.Message("ok", {"micro_batches": self.micro_batches}, {"g": grad})

    def op_step(self, request: wire.Message) -> wire.Message:
        """Scale the accumulated gradients, add the other end's tied-weight gradient, step."""
        scale = float(request.meta.get("scale", 1.0))
        for p in self.params.values():
            if p.grad is not None:
                p.grad.mul_(scale)
        tied = self.stage.tied_weight()
        if tied is not None and "tied" in request.tensors:
            extra = request.tensors["tied"]
            tied.grad = extra.clone() if tied.grad is None else tied.grad.add_(extra)
        for group in self.optimizer.param_groups:
            group["lr"] = float(request.meta["lr"])
        if self.micro_batches or "tied" in request.tensors:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending.clear()
        self.steps += 1
        self.micro_batches = 0
        return wire.Message("ok", {"steps": self.steps})

    def op_state(self, request: wire.Message) -> wire.Message:
        return wire.Message("ok", {"steps": self.steps},
                            {n: p.detach() for n, p in self.params.items()})

    def op_load(self, request: wire.Message) -> wire.Message:
        with torch.no_grad():
            for name, value in request.tensors.items():
                self.params[name].copy_(value)
        return wire.Message("ok")

    def _checkpoints(self) -> Path:
        """This peer's own checkpoint directory, fixed when it started: a request never names
        where the peer writes or reads."""
        if self.checkpoint_dir is None:
            raise ValueError(f"stage {self.stage.stage} peer was started without "
                             "--checkpoint-dir, so it keeps no checkpoints")
        return self.checkpoint_dir

    def op_save(self, request: wire.Message) -> wire.Message:
        """Checkpoint this peer's own state (its weights and AdamW moments) under its own
        checkpoint directory, atomically and with digests, as every farlink checkpoint
        (:mod:`farlink.state.checkpoint`): the peer writes its own files, so its state never
        crosses a link to be saved."""
        from farlink.sync.base import optimizer_state
        from farlink.state.checkpoint import save_checkpoint

        tensors = {f"param.{n}": p.detach() for n, p in self.params.items()}
        tensors.update(optimizer_state(self.optimizer, "inner"))
        meta = {"stage": self.stage.stage, "stages": self.stage.stages, "steps": self.steps,
                **request.meta.get("meta", {})}
        path = save_checkpoint(self._checkpoints(), int(request.meta["step"]), tensors, meta)
        return wire.Message("ok", {"path": str(path)})

    def op_restore(self, request: wire.Message) -> wire.Message:
        """Load this peer's checkpoint of step ``step`` from its own checkpoint directory (every
        digest checked: a corrupt one is an error naming it, and the trainer decides what
        replaces it)."""
        from farlink.sync.base import load_optimizer_state
        from farlink.state.checkpoint import checkpoint_path, load_checkpoint

        path = checkpoint_path(self._checkpoints(), int(request.meta["step"]))
        tensors, meta = load_checkpoint(path)
        if (meta.get("stage"), meta.get("stages")) != (self.stage.stage, self.stage.stages):
            raise ValueError(f"{path} holds stage {meta.get('stage')} of {meta.get('stages')}, "
                             f"not stage {self.stage.stage} of {self.stage.stages}")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(tensors[f"param.{name}"])
        load_optimizer_state(self.optimizer, tensors, "inner")
        self.steps = int(meta["steps"])
        self.optimizer.zero_grad(set_to_none=True)
        self.pending.clear()
        self.micro_batches = 0
        return wire.Message("ok", {"steps": self.steps})


#: lower runs first: finish micro-batches (backward, loss) before starting new ones
_PRIORITY = {"loss": 0, "backward": 0, "forward": 1, "evaluate": 1}


class StageServer:
    """TCP front of a :class:`StageWorker`: one thread per connection, one compute thread.

    Every connection proves ``auth``'s credential first (:func:`stage_auth.admit`); control
    operations come only from a peer id in ``drivers``. ``on_shutdown`` runs on the driver's
    ``shutdown`` (a process exits; an in-process server stops)."""

    def __init__(self, worker: StageWorker, host: str = "127.0.0.1", port: int = 0,
                 link: LinkModel | None = None, *, auth: Authenticator,
                 drivers: frozenset[str] = frozenset({stage_auth.DRIVER}),
                 on_shutdown=None) -> None:
        self.worker, self.link = worker, link
        self.auth, self.drivers = auth, drivers
        self.on_shutdown = on_shutdown or (lambda: os._exit(0))
        self.listener = socket.create_server((host, port))
        self.listener.settimeout(0.5)  # accept polls the stop flag
        self.port = self.listener.getsockname()[1]
        self.work: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self.stopped = threading.Event()
        self.refusals: list[tuple[str, str]] = []  # (address, why), the last 100
        self._log_limit = LogLimiter()

    def serve_forever(self) -> None:
        threading.Thread(target=self._compute, daemon=True).start()
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()
        self.listener.close()

    def stop(self) -> None:
        """Stop accepting, and end the compute thread once the work queued before is done (an
        in-process server leaves no thread behind)."""
        self.stopped.set()
        self.work.put((float("inf"), next(self._order), None, None))  # after all queued work

    def _refuse(self, where: str, why: str) -> None:
        """Keep and log (rate-limited) a refusal: who, and that nothing of theirs ran."""
        self.refusals = [*self.refusals[-99:], (where, why)]
        write, skipped = self._log_limit.admit("refused")
        if write:
            more = f" ({skipped} more refusals left out)" if skipped else ""
            print(f"stage {self.worker.stage.stage} peer refused {where}: {why}; nothing it "
                  f"sent was run{more}", file=sys.stderr, flush=True)

    def _compute(self) -> None:
        while True:
            _, _, request, done = self.work.get()
            if request is None:  # stop()
                return
            try:
                done.append(self.worker.handle(request))
            except Exception as exc:  # noqa: BLE001 - sent back to the trainer as an error
                done.append(wire.Message("error", {"error": f"{type(exc).__name__}: {exc}"}))
            done[0].set()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                host, port = conn.getpeername()[:2]
                where = f"{host}:{port}"
                peer_id, why = stage_auth.admit(conn, self.auth)
                if peer_id is None:
                    self._refuse(where, why)
                    return
                self.worker.connections += 1
                while not self.stopped.is_set():
                    try:
                        request = wire.recv(conn)
                    except CodecError as exc:
                        self._refuse(f"{peer_id} at {where}", f"{exc}; connection closed")
                        return
                    why = stage_auth.may_send(request.op, peer_id, self.drivers)
                    if why is not None:
                        self._refuse(f"{peer_id} at {where}", why)
                        wire.send(conn, wire.Message("error", {"error": f"refused: {why}"}))
                        continue
                    if request.op == "shutdown":
                        self.on_shutdown()
                        return
                    done: list = [threading.Event()]
                    self.work.put((_PRIORITY.get(request.op, 2), next(self._order), request, done))
                    done[0].wait()
                    self._reply(conn, done[1], request.meta.get("reply_codecs"))
            except (ConnectionError, OSError):
                return

    def _reply(self, conn: socket.socket, message: wire.Message,
               codecs: dict[str, str] | None) -> None:
        wire.send(conn, message, codecs, self.link)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--config", required=True, help="GPTConfig as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--slowdown", type=float, default=1.0, help="emulated device slowdown")
    p.add_argument("--link-mbit", type=float, default=None, help="emulated link bandwidth")
    p.add_argument("--link-ms", type=float, default=0.0, help="emulated one-way latency")
    p.add_argument("--memory-cap-mb", type=float, default=None,
                   help="refuse to serve a stage whose training state exceeds this")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="where this peer keeps its checkpoints (requests never name one)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from farlink import lifeline

    try:
        auth = stage_auth.auth_from_env()
    except ValueError as exc:
        sys.exit(str(exc))
    lifeline.watch_parent(grace=0.0)  # started by farlink train: end with it
    torch.set_num_threads(args.threads)
    config = GPTConfig(**json.loads(args.config))
    stage = build_stage(config, args.seed, args.stage, args.stages)
    need = training_memory_bytes(sum(p.numel() for p in stage.parameters()))
    if args.memory_cap_mb is not None and need > args.memory_cap_mb * 2**20:
        sys.exit(f"stage {args.stage} of {args.stages} needs {need / 2**20:.1f} MiB to train, "
                 f"over the {args.memory_cap_mb:g} MiB cap: use more pipeline stages")
    link = None
    if args.link_mbit is not None or args.link_ms:
        link = LinkModel.of(args.link_mbit, args.link_ms)
    worker = StageWorker(stage, args.lr, args.weight_decay, args.slowdown, args.checkpoint_dir)
    server = StageServer(worker, args.host, args.port, link, auth=auth)
    print(f"READY {server.port}", flush=True)
    server.serve_forever()


def config_json(config: GPTConfig) -> str:
    return json.dumps(asdict(config))


if __name__ == "__main__":
    main()
