"""The pipeline trainer: micro-batches through stage peers, forward then backward, then a step.

The trainer holds the data and wires each micro-batch through the stages (SWARM's trainer, as in
Petals): it sends tokens to a first-stage peer, that peer's activations to a peer of the next
stage, and so on; the last stage computes the loss and returns the gradient of its input, which
flows back stage by stage. Every stage's input stays with the trainer until the micro-batch is
done, so when a peer fails mid-micro-batch (connection refused or reset: a crash, a SIGKILL) the
trainer re-runs that stage's part on another live peer of the stage instead of losing the
micro-batch. Up to ``in_flight`` micro-batches move at once (default: one per stage); stage
peers run backward before forward, so the schedule settles into 1F1B: each stage alternates one
forward and one backward while its links carry other micro-batches' activations.

A step commits when every micro-batch of the batch has gone all the way back; then each live
peer steps its optimizer on its accumulated gradients, normalised to the micro-batches it served
(one peer per stage: exactly the unsplit model's gradient of the mean loss). The tied embedding's
two copies (first stage's input embedding, last stage's head) receive each other's gradient
first: with fixed pipelines, that of the peer at the other end of the same pipeline, so every
pipeline steps as the unsplit model on its own micro-batches. Peers of one stage drift apart
between averages, and every ``average_every`` steps the trainer averages their parameters
(local SGD within a stage; Adam moments stay per peer).

Activations and their gradients go through a codec (``activation_codec``, ``gradient_codec``:
``fp32``, ``int8``, ``int4``, ``topk:F``...): the bytes reported are the exact frames sent.

Every answer is checked before it is used (:mod:`farlink.parallel.answers`): a corrupt frame,
a wrong-shaped tensor or a NaN/inf activation, gradient or loss is refused, its peer named and
taken out (as a peer that failed), and the work goes to another peer of the stage; a stage
with no peer left stops the run with every refusal's reason. A peer that answers nothing for
``timeout`` seconds counts as failed the same way.
"""

from __future__ import annotations

import itertools
import logging
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from farlink.codecs import CodecError
from farlink.comm.base import LinkModel
from farlink.robust.auth import Authenticator
from farlink.parallel import stage_auth, wire
from farlink.parallel.answers import Shape, answer_problem, usable_states
from farlink.parallel.stages import model_parameter_name
from farlink.parallel.swarm_router import ThroughputRouter
from farlink.sync.base import lr_at


log = logging.getLogger(__name__)


class PeerFailure(ConnectionError):
    """A stage peer could not be reached or vanished mid-request."""


class BadAnswer(PeerFailure):
    """A stage peer's answer was refused (a corrupt frame, a wrong shape, NaN/inf): routed
    around as a failure, its peer taken out."""


class StageError(RuntimeError):
    """A stage peer answered with an error: a bug or bad input, not a failure to route around."""


@dataclass
class StepReport:
    step: int
    loss: float  # mean over the step's micro-batches
    tokens: int
    seconds: float
    reroutes: int  # stage passes redone on another peer because a peer failed
    failed_peers: list[str]
    lost_stage_gradients: int  # micro-batch gradients that died with a peer before its step
    bytes: dict[str, int] = field(default_factory=dict)  # frame bytes this step, by kind
    refused: dict[str, str] = field(default_factory=dict)  # peer -> why its answer was refused


def _addr(peer: str) -> tuple[str, int]:
    host, _, port = peer.rpartition(":")
    return host, int(port)


class PipelineTrainer:
    """Drives stage peers (``"host:port"`` lists, one list per stage) through training steps."""

    def __init__(self, stages: list[list[str]], micro_batches: int = 4,
                 in_flight: int | None = None, activation_codec: str = "fp32",
                 gradient_codec: str | None = None, lr: float = 3e-3, warmup_steps: int = 0,
                 average_every: int = 0, links: dict[str, LinkModel] | None = None,
                 timeout: float = 120.0, total_steps: int | None = None,
                 pipelines: list[list[str]] | None = None,
                 path_links: dict[tuple[str, str], LinkModel] | None = None,
                 auth: Authenticator | None = None, width: int | None = None) -> None:
        if len(stages) < 2:
            raise ValueError("a pipeline needs at least 2 stages")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        wire.codec_for(activation_codec)  # bad specs fail here, not mid-step
        wire.codec_for(gradient_codec or activation_codec)
        self.n_stages = len(stages)
        self.router = ThroughputRouter(stages)
        self.micro_batches = micro_batches
        self.in_flight = in_flight or self.n_stages
        self.activation_codec = activation_codec
        self.gradient_codec = gradient_codec or activation_codec
        self.lr, self.warmup_steps, self.average_every = lr, warmup_steps, average_every
        self.total_steps = total_steps
        self.pipelines = pipelines
        self.path_links = path_links
        if pipelines is not None and any(len(p) != self.n_stages for p in pipelines):
            raise ValueError(f"every fixed pipeline needs one peer per stage ({self.n_stages})")
        self.links = links or {}
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.timeout = timeout
        # the driver's credential every stage peer checks (default: this process's token, the
        # one start_stage_peer hands the peers it starts)
        self.auth = auth or stage_auth.driver_auth()
        self.width = width  # the model's d_model: the last dimension of every activation
        self.steps = 0
        self.bytes: dict[str, int] = {}
        self._served: dict[str, int] = {}  # backward passes per peer in the current step
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._idle: dict[str, list[socket.socket]] = {}  # open connections, by peer

    # -- transport ----------------------------------------------------------------------------
    def _count(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def call(self, peer: str, message: wire.Message, kind: str = "control",
             codecs: dict[str, str] | None = None,
             reply_codecs: dict[str, str] | None = None,
             reply_kind: str | None = None, source: str | None = None) -> wire.Message:
        """One request and its reply; PeerFailure when the peer is unreachable or dies. Frame
        bytes are counted under ``kind`` (the reply's under ``reply_kind``, default the same):
        ``tokens``, ``activations``, ``gradients``, ``tied``, ``averaging``, ``control``.
        With ``path_links``, a message that carries ``source``'s output is held for the link
        from ``source`` to ``peer`` (the trainer relays it on loopback), else for ``peer``'s
        own link in ``links``."""
        link = self.links.get(peer)
        if self.path_links is not None and source is not None:
            link = self.path_links.get((source, peer))
        if reply_codecs:
            message.meta["reply_codecs"] = reply_codecs
        sock = self._connection(peer)
        try:
            self._count(kind, wire.send(sock, message, codecs, link))
            reply = wire.recv(sock)
        except OSError as exc:  # refused, reset, closed mid-message, timed out
            sock.close()
            raise PeerFailure(f"stage peer {peer}: {exc}") from exc
        except CodecError as exc:
            sock.close()
            raise BadAnswer(f"stage peer {peer}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._idle.setdefault(peer, []).append(sock)
        self._count(reply_kind or kind, reply.nbytes)
        if reply.op == "error":
            raise StageError(f"stage peer {peer}: {reply.meta.get('error')}")
        if reply.op != "ok":
            raise BadAnswer(f"stage peer {peer}: an answer {reply.op!r}, neither ok nor error")
        return reply

    @staticmethod
    def _check(peer: str, reply: wire.Message, expected: dict[str, Shape | None],
               loss: bool = False) -> wire.Message:
        """``reply`` when its tensors (and loss) are usable; else BadAnswer naming ``peer``."""
        problem = answer_problem(reply.tensors, expected, reply.meta, loss)
        if problem is not None:
            raise BadAnswer(f"stage peer {peer} answered {problem}")
        return reply

    def _connection(self, peer: str) -> socket.socket:
        """An idle connection to ``peer`` kept from an earlier request, else a new one. Each
        new TCP connection costs a round trip before the request can leave (and starts slow),
        which on a 60 ms home link is as long as the request itself; a stage peer serves any
        number of requests on one connection, one at a time, so each thread takes its own."""
        with self._lock:
            idle = self._idle.get(peer)
            if idle:
                return idle.pop()
        return self._open(peer)

    def _open(self, peer: str) -> socket.socket:
        """A new connection to ``peer`` on which this driver has proven its credential."""
        try:
            sock = socket.create_connection(_addr(peer), timeout=self.timeout)
        except OSError as exc:
            raise PeerFailure(f"stage peer {peer}: {exc}") from exc
        try:
            stage_auth.prove(sock, self.auth, peer, min(self.timeout, 30.0))
        except OSError as exc:
            sock.close()
            raise PeerFailure(f"stage peer {peer}: {exc}") from exc
        except stage_auth.StageAuthError as exc:
            sock.close()
            raise StageError(str(exc)) from None
        return sock

    # -- one micro-batch ----------------------------------------------------------------------
    def _timed(self, stage: int, message: wire.Message, kind: str, reply_kind: str,
               codecs: dict[str, str] | None, reply_codecs: dict[str, str] | None,
               stats: dict, source: str | None = None, wired: int | None = None,
               expected: dict[str, Shape | None] | None = None,
               loss: bool = False) -> tuple[str, wire.Message]:
        """Send to the best live peer of ``stage`` (with fixed pipelines, pipeline ``wired``'s
        peer while it lives), re-routing until one gives a usable answer (``expected``: the
        tensors it must hold, of these shapes, finite; ``loss``: and a finite loss)."""
        while True:
            peer = self._fixed_peer(stage, wired)
            if peer is not None:
                self.router.begin(peer)
            else:
                peer = self.router.choose(stage)
            started = time.perf_counter()
            try:
                reply = self._check(peer, self.call(
                    peer, wire.Message(message.op, dict(message.meta), message.tensors), kind,
                    codecs, reply_codecs, reply_kind, source), expected or {}, loss)
            except PeerFailure as exc:
                self._peer_failed(peer, stats, exc)
                continue
            self.router.finished(peer, time.perf_counter() - started)
            return peer, reply

    def _fixed_peer(self, stage: int, wired: int | None) -> str | None:
        if self.pipelines is None or wired is None:
            return None
        peer = self.pipelines[wired % len(self.pipelines)][stage]
        return peer if peer in self.router.live(stage) else None

    def _peer_failed(self, peer: str, stats: dict, exc: PeerFailure | None = None) -> None:
        """Take ``peer`` out; a refused answer is named with its reason (log and report)."""
        self.router.failed(peer, str(exc) if exc is not None else None)
        with self._lock:
            stats["reroutes"] += 1
            if peer not in stats["failed"]:
                stats["failed"].append(peer)
            if isinstance(exc, BadAnswer):
                stats.setdefault("refused", {})[peer] = str(exc)
        if isinstance(exc, BadAnswer):
            log.warning("%s: its answer is dropped, it is taken out, and its stage's other "
                        "peers take its work", exc)

    def _micro_batch(self, tokens: torch.Tensor, targets: torch.Tensor, scale: float,
                     stats: dict, index: int = 0) -> float:
        last = self.n_stages - 1
        act = {"x": self.activation_codec}
        inputs: list[torch.Tensor] = [tokens]
        peers: list[str] = []
        keys: list[str] = []
        for s in range(last):
            key = f"{self.steps}:{next(self._keys)}"
            message = wire.Message("forward", {"mb": key}, {"x": inputs[s]})
            peer, reply = self._timed(s, message, "tokens" if s == 0 else "activations",
                                      "activations", act if s else None,
                                      {"y": self.activation_codec}, stats,
                                      peers[-1] if peers else None, index,
                                      {"y": self._activation_shape(tokens)})
            inputs.append(reply.tensors["y"])
            peers.append(peer)
            keys.append(key)
        message = wire.Message("loss", {"scale": scale},
                               {"x": inputs[last], "targets": targets.to(torch.int32)})
        peer, reply = self._timed(last, message, "activations", "gradients", act,
                                  {"dx": self.gradient_codec}, stats, peers[-1], index,
                                  {"dx": tuple(inputs[last].shape)}, loss=True)
        self._served_by(peer)
        loss, dy = reply.meta["loss"], reply.tensors["dx"]
        source = peer
        for s in reversed(range(last)):
            dy, source = self._backward(s, peers[s], keys[s], inputs[s], dy, stats, source,
                                        peers[s - 1] if s else None)
        return loss

    def _backward(self, s: int, peer: str, key: str, x: torch.Tensor, dy: torch.Tensor,
                  stats: dict, source: str | None = None,
                  upstream: str | None = None) -> tuple[torch.Tensor | None, str]:
        """Stage ``s``'s backward pass; (its input's gradient, the peer that ran it)."""
        reply_codecs = {"dx": self.gradient_codec}
        while True:
            self.router.begin(peer)
            try:
                started = time.perf_counter()
                reply = self.call(peer, wire.Message("backward", {"mb": key}, {"dy": dy}),
                                  "gradients", {"dy": self.gradient_codec}, reply_codecs,
                                  source=source)
                self._check(peer, reply, {"dx": tuple(x.shape)} if s else {})
                self.router.finished(peer, time.perf_counter() - started)
                self._served_by(peer)
                return reply.tensors.get("dx"), peer
            except PeerFailure as exc:
                self._peer_failed(peer, stats, exc)
            # the graph died with the peer: redo this stage's forward on another peer of it
            key = f"{self.steps}:{next(self._keys)}"
            message = wire.Message("forward", {"mb": key}, {"x": x})
            peer, _ = self._timed(s, message, "tokens" if s == 0 else "activations",
                                  "activations", {"x": self.activation_codec} if s else None,
                                  {"y": self.activation_codec}, stats, upstream,
                                  expected={"y": self._activation_shape(x)})

    def _activation_shape(self, x: torch.Tensor) -> Shape:
        """What a stage's output must be for input ``x``: [batch, time, width], the width
        every stage shares (``width`` when known, else any)."""
        return (x.shape[0], x.shape[1], self.width)

    def _served_by(self, peer: str) -> None:
        with self._lock:
            self._served[peer] = self._served.get(peer, 0) + 1

    # -- one step -----------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        """farlink's schedule (linear warmup, then cosine decay over ``total_steps``), or a
        constant rate after the warmup when the total is not known."""
        if self.total_steps is None:
            return self.lr * min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps \
                else self.lr
        return lr_at(step, self.lr, self.warmup_steps, self.total_steps)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor,
             lr_step: int | None = None) -> StepReport:
        """One optimizer step on ``tokens``/``targets`` ([batch, time]), split into
        ``micro_batches`` along the batch; ``lr_step``: the step the lr schedule reads (default
        this step; a time-budgeted run reads its share of rounds behind)."""
        started = time.perf_counter()
        before = dict(self.bytes)
        stats: dict = {"reroutes": 0, "failed": [], "refused": {}}
        losses = self.forward_backward(tokens, targets, stats)
        if not all(math.isfinite(loss) for loss in losses):  # every answer is checked: a bug
            raise StageError(f"step {self.steps + 1}: a non-finite loss {losses}; nothing is "
                             "stepped")
        lost = self._apply(len(losses), stats, self.steps if lr_step is None else lr_step)
        self.steps += 1
        if self.average_every and self.steps % self.average_every == 0:
            self.average_stages()
        delta = {k: v - before.get(k, 0) for k, v in self.bytes.items()}
        return StepReport(self.steps, sum(losses) / len(losses), tokens.numel(),
                          time.perf_counter() - started, stats["reroutes"], stats["failed"],
                          lost, delta, dict(stats["refused"]))

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor,
                         stats: dict | None = None) -> list[float]:
        """Every micro-batch of the batch forward and backward, gradients left accumulated on
        the peers (no step); the micro-batches' losses, in order."""
        if tokens.shape[0] % self.micro_batches:
            raise ValueError(f"a batch of {tokens.shape[0]} rows does not split into "
                             f"{self.micro_batches} equal micro-batches; use a batch size that "
                             "is a multiple of the micro-batch count")
        stats = stats if stats is not None else {"reroutes": 0, "failed": []}
        self._served = {}
        chunks = list(zip(tokens.chunk(self.micro_batches), targets.chunk(self.micro_batches)))
        scale = 1.0 / len(chunks)  # equal chunks: the mean of their means is the batch mean
        with ThreadPoolExecutor(self.in_flight) as pool:
            futures = [pool.submit(self._micro_batch, x, y, scale, stats, i)
                       for i, (x, y) in enumerate(chunks)]
            return [f.result() for f in futures]

    def _apply(self, n_micro: int, stats: dict, lr_step: int) -> int:
        """Sum the tied gradients across the first and last stage, then step every live peer
        (the peers are asked side by side). Returns how many micro-batch gradients died with
        peers before this step."""
        last = self.n_stages - 1

        def tied_grad(peer: str) -> torch.Tensor | None:
            try:
                reply = self.call(peer, wire.Message("tied_grad"), "tied")
                return self._check(peer, reply, {"g": None}).tensors["g"]
            except PeerFailure as exc:
                self._peer_failed(peer, stats, exc)
                return None

        tied: dict[int, torch.Tensor] = {}
        tied_of: dict[str, torch.Tensor] = {}
        ends = [(s, p) for s in (0, last) for p in self.router.live(s)]
        with ThreadPoolExecutor(max(1, len(ends))) as pool:
            for (s, p), g in zip(ends, pool.map(lambda e: tied_grad(e[1]), ends)):
                if g is not None:
                    tied_of[p] = g
                    tied[s] = g if s not in tied else tied[s] + g
        lost = sum(n for p, n in self._served.items() if p in stats["failed"])
        lr = self.lr_at(lr_step)

        def step(stage: int, peer: str) -> None:
            served = self._served.get(peer, 0)
            meta = {"lr": lr, "scale": n_micro / served if served else 0.0}
            other_end = last if stage == 0 else 0
            tensors = {}
            if served and stage in (0, last):
                partner = self._pipeline_partner(stage, peer, stats)
                if partner is not None and partner in tied_of:
                    # the partner's micro-batches are this peer's: the gradient of the mean
                    # over them, as this peer's own gradients are scaled to
                    tensors["tied"] = tied_of[partner] * (n_micro / self._served[partner])
                elif other_end in tied:
                    tensors["tied"] = tied[other_end]
            try:
                self.call(peer, wire.Message("step", meta, tensors),
                          "tied" if tensors else "control")
            except PeerFailure as exc:
                self._peer_failed(peer, stats, exc)

        everyone = [(s, p) for s in range(self.n_stages) for p in self.router.live(s)]
        with ThreadPoolExecutor(len(everyone)) as pool:
            list(pool.map(lambda e: step(*e), everyone))
        return lost

    def _pipeline_partner(self, stage: int, peer: str, stats: dict) -> str | None:
        """The other end's peer that served exactly ``peer``'s micro-batches this step: its
        one fixed pipeline's, when the two share no other pipeline and no peer failed this
        step (a re-routed micro-batch mixes pipelines). None otherwise: then each end gets the
        other end's gradient of the mean over every micro-batch."""
        if self.pipelines is None or stats["failed"]:
            return None
        other_end = self.n_stages - 1 if stage == 0 else 0
        rows = [row for row in self.pipelines if row[stage] == peer]
        if len(rows) != 1:
            return None
        partner = rows[0][other_end]
        shared = sum(1 for row in self.pipelines if row[other_end] == partner)
        return partner if shared == 1 and self._served.get(partner) else None

    def average_stages(self) -> None:
        """Local SGD within each stage: every live peer of a stage takes the mean weights of
        its members whose weights are finite and of the stage's shapes (the others are named
        in the log and take the mean too)."""
        for s in range(self.n_stages):
            peers = self.router.live(s)
            if len(peers) < 2:
                continue
            fetched = {}
            for peer in peers:
                try:
                    fetched[peer] = self.call(peer, wire.Message("state"), "averaging").tensors
                except PeerFailure as exc:
                    self.router.failed(peer, str(exc))
            kept, left_out = usable_states(fetched)
            for peer, why in left_out.items():
                log.warning("stage %d average leaves out stage peer %s: %s; it takes the "
                            "others' mean", s, peer, why)
            states = list(kept.values())
            if not states:
                continue
            mean = {n: torch.stack([st[n] for st in states]).mean(0) for n in states[0]}
            for peer in self.router.live(s):
                try:
                    self.call(peer, wire.Message("load", {}, mean), "averaging")
                except PeerFailure as exc:
                    self.router.failed(peer, str(exc))

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean per-token held-out loss through the stages (forward only, training codecs)."""
        stats: dict = {"reroutes": 0, "failed": []}
        total, count = 0.0, 0
        last = self.n_stages - 1
        for tokens, targets in batches:
            x = tokens
            for s in range(last):
                _, reply = self._timed(s, wire.Message("evaluate", {}, {"x": x}), "evaluation",
                                       "evaluation", {"x": self.activation_codec} if s else None,
                                       {"y": self.activation_codec}, stats,
                                       expected={"y": self._activation_shape(tokens)})
                x = reply.tensors["y"]
            message = wire.Message("evaluate", {}, {"x": x, "targets": targets.to(torch.int32)})
            _, reply = self._timed(last, message, "evaluation", "evaluation",
                                   {"x": self.activation_codec}, None, stats, loss=True)
            total += reply.meta["loss"] * targets.numel()
            count += targets.numel()
        return total / count

    # -- membership and inspection ------------------------------------------------------------
    def add_peer(self, stage: int, peer: str) -> None:
        """A peer joins ``stage``: it takes the weights of a live peer of the stage first."""
        donors = self.router.live(stage)
        if donors:
            state = self.call(donors[0], wire.Message("state"), "averaging").tensors
            self.call(peer, wire.Message("load", {}, state), "averaging")
        self.router.add(stage, peer)

    def gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients of the first live peer of every stage, named as in the
        unsplit ``GPT`` (the tied embedding's two parts summed into ``embed.weight``)."""
        grads: dict[str, torch.Tensor] = {}
        for s in range(self.n_stages):
            peer = self.router.live(s)[0]
            start = self.call(peer, wire.Message("ping")).meta["start"]
            for name, g in self.call(peer, wire.Message("grads")).tensors.items():
                grads[model_parameter_name(name, start)] = g
        grads["embed.weight"] = grads["embed.weight"] + grads.pop("lm_head.weight")
        return grads

    def close(self, shutdown: bool = True) -> None:
        with self._lock:
            for sockets in self._idle.values():
                for sock in sockets:
                    sock.close()
            self._idle.clear()
        if not shutdown:
            return
        for s in range(self.n_stages):
            for peer in self.router.live(s):
                try:
                    with self._open(peer) as sock:
                        wire.send(sock, wire.Message("shutdown"))
                except (PeerFailure, StageError, OSError):
                    pass


class PipelineOptions(BaseModel):
    """A model cut into stages served by their own peers (:class:`PipelineTrainer`): the cut,
    the peers, the micro-batches and what crosses between stages. ``RunConfig`` composes these
    fields (flat flags, ``[pipeline]`` in TOML)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    pipeline_stages: int = Field(
        1, ge=1, description="cut the model into S stages of contiguous blocks, each served by "
        "its own peer processes, micro-batches wired through them (1: every worker holds the "
        "whole model)")
    peers_per_stage: int | None = Field(
        None, ge=1, description="peers serving each pipeline stage, one per pipeline replica "
        "(default: workers / pipeline_stages; given alone, workers becomes stages x peers)")
    pipeline_micro_batches: int = Field(
        4, ge=1, description="micro-batches a pipeline splits each step's batch_size sequences "
        "into (1F1B: stages work on different micro-batches at once)")
    activation_codec: str = Field(
        "fp32", description="codec of the activations and their gradients between pipeline "
        "stages: fp32, fp16, int8, int4, topk:F")
    stage_peer_timeout: float = Field(
        120.0, gt=0, le=86400, allow_inf_nan=False, description="seconds a pipeline trainer "
        "waits for a stage peer's answer before that peer counts as failed and its stage's "
        "other peers take its work")

    @model_validator(mode="after")
    def _check_pipeline_options(self) -> PipelineOptions:
        if self.pipeline_stages > 1:
            try:
                wire.codec_for(self.activation_codec)
            except ValueError as exc:
                raise ValueError(f"activation_codec: {exc}") from None
        return self
