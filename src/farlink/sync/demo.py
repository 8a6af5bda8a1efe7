"""DeMo, decoupled momentum optimization (arXiv 2411.19870; reference: bloc97/DeMo).

Each worker keeps its own momentum and never synchronizes it. Every step:

1. ``m <- beta * m + lr * g`` (``beta`` = ``--demo-beta``, 0.999; ``lr`` the step's learning
   rate, as the reference accumulates it);
2. chunked DCT of ``m``, the top-k coefficients of every chunk (the ``dct_topk`` codec: 64-wide
   chunks, 64x64 tiles for matrices, k = 32);
3. ``m <- m - sent``, where ``sent`` is the inverse DCT of exactly those coefficients (error
   feedback: what was not sent keeps accumulating);
4. all-gather the sparse coefficients, encoded once: the bytes a peer receives decode to exactly
   the ``sent`` this worker subtracted;
5. average each DCT coefficient over the peers that sent it (the reference's scatter-mean,
   ``reduce="contributors"``), one inverse DCT, and a sign-SGD step with decoupled weight decay:
   ``p <- p * (1 - lr * wd) - lr * sign(avg)``.

Replicas stay identical (everyone applies the same average) while sending
``n_chunks * k * (4 + 2)`` bytes per tensor instead of the dense gradient.

Where farlink differs from the reference, on purpose:

- chunking: a dimension that is not a multiple of the chunk is zero-padded to whole chunks (the
  reference picks the largest divisor of the dimension not above the chunk, which degrades to
  1-wide chunks for a prime size such as a tokenizer's vocabulary); on dimensions that are
  multiples of the chunk both are the same. Padding only changes which coefficients exist; error
  feedback stays exact because what is subtracted is what is sent.
- tensors with more than two dimensions are viewed as matrices ``(prod(shape[:-1]), shape[-1])``.
- peers whose update carries no tokens (a newcomer healing in this round) do not count as
  contributors. With a Byzantine-robust ``--aggregator`` the rule replaces the scatter-mean and
  sees each peer's decoded (dense) update.
- the wire may carry fp16 values (``--codec dct_topk:64:32:fp16``); the momentum then subtracts
  the fp16-rounded values, i.e. still exactly what peers decode.

On a replica group of several ranks (FSDP2 inside) each rank runs all of the above on its own shard
of each tensor, with the same rank of the other replica groups: the update is DeMo's, but of the
shard. The DCT tiles of a shard match the whole tensor's only where the shard's rows are a multiple
of the chunk (a 512-row embedding split in two: yes; a 64-row matrix split into 32-row shards, or a
64-element norm weight: no, those are tiled by 32), so the replica groups stay identical to each
other but differ from one-rank replicas in the coefficients chosen for those tensors, and in bytes.

Knobs (:class:`DeMoOptions`): ``demo_beta``, ``demo_chunk``, ``demo_topk`` and ``demo_lr`` (the
sign step's lr, warmed up and decayed like the inner lr). Capabilities: a round after every step;
no inner optimizer (the sign step replaces it); the wire carries DCT top-k coefficients.
"""

from __future__ import annotations

import torch
from pydantic import Field

from farlink.codecs import Compressor, DctTopKCodec, make_compressor
from farlink.comm.base import RoundInfo
from farlink.sync.base import (
    Capabilities,
    StepOutcome,
    SyncAlgorithm,
    SyncOptions,
    TensorState,
    lr_at,
)
from farlink.sync.exchange import Combine, Encoded, ExchangeResult


class DeMoOptions(SyncOptions):
    demo_beta: float = Field(0.999, ge=0, lt=1, description="DeMo momentum decay")
    demo_chunk: int = Field(64, ge=2, description="DeMo DCT chunk size")
    demo_topk: int = Field(32, ge=1, description="DeMo coefficients kept per chunk")
    demo_lr: float = Field(1e-3, gt=0, description="DeMo sign-step learning rate")


class DeMo(SyncAlgorithm):
    name = "demo"
    Options = DeMoOptions
    capabilities = Capabilities(syncs_every_step=True, inner_optimizer=False,
                                wire_codec="dct_topk", sharded=True)

    @classmethod
    def wire_spec(cls, cfg) -> str:  # noqa: ANN001 - a RunConfig
        """``--codec dct_topk:...`` as given, else the DCT top-k of --demo-chunk/--demo-topk."""
        if cfg.codec.strip().lower().startswith("dct_topk"):
            return cfg.codec
        return f"dct_topk:{cfg.demo_chunk}:{cfg.demo_topk}"

    @classmethod
    def wire_compressor(cls, options: DeMoOptions, codec: str) -> Compressor:
        """``--codec dct_topk:...`` as given (the user chose the chunk, k or fp16 values), or
        for ``--codec none`` the DCT top-k of --demo-chunk/--demo-topk; any other codec, and
        ``+ef`` (DeMo's error feedback is its momentum), is refused."""
        compressor = make_compressor(codec)
        if compressor.error_feedback:
            raise ValueError("demo keeps its own error feedback in the momentum; drop '+ef' "
                             f"from --codec {compressor.spec}")
        if isinstance(compressor.codec, DctTopKCodec):
            return compressor
        if compressor.codec.name == "fp32":
            return make_compressor(DctTopKCodec(options.demo_chunk, options.demo_topk).name)
        raise ValueError(f"demo sends DCT top-k coefficients; use --codec none (then "
                         f"--demo-chunk/--demo-topk) or dct_topk[:CHUNK:K[:fp16]], "
                         f"not {compressor.spec}")

    @classmethod
    def wire_combine(cls, compressor: Compressor) -> Combine:
        """Each DCT coefficient averaged over the peers that sent it (the reference's
        scatter-mean), then one inverse DCT, built on the device of the update (its parameter's)."""
        codec = compressor.codec

        def contributor_mean(name: str, payloads: list[bytes], shape: torch.Size,
                             device: torch.device) -> torch.Tensor:
            sparse = [codec.unpack(payload, shape, device) for payload in payloads]
            return codec.decode_coefficients(sparse, reduce="contributors")

        return contributor_mean

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        compressor = self.exchange.compressor
        if not isinstance(compressor.codec, DctTopKCodec) or compressor.error_feedback \
                or self.exchange.combine is None:
            raise ValueError(f"demo sends its own DCT top-k coefficients and averages them "
                             f"itself: build its exchange with compressor=DeMo.wire_compressor"
                             f"(options, codec) and combine=DeMo.wire_combine(compressor), not "
                             f"{compressor.spec}")
        self.codec = compressor.codec  # the codec the exchange was built with
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self._extracted: dict[str, Encoded] = {}

    def current_lr(self) -> float:
        cfg = self.cfg
        if not self.lr_schedule:
            return cfg.demo_lr
        return lr_at(self.inner_steps_done, cfg.demo_lr, cfg.warmup_steps, cfg.steps)

    def step(self, tokens: int) -> StepOutcome:
        beta, lr = self.cfg.demo_beta, self.current_lr()
        self._extracted = {}
        with torch.no_grad():
            for name, m, p, grad in zip(self.names, self.momentum, self.params,
                                         self.local_gradients()):
                grad = grad if grad is not None else torch.zeros_like(p)
                m.mul_(beta).add_(grad, alpha=lr)
                sparse = self.codec.encode_coefficients(m)
                sent = self.codec.decode_coefficients(sparse).to(m.dtype)
                m.sub_(sent)  # error feedback: what was not sent stays in the momentum
                self._extracted[name] = Encoded(self.codec.pack(sparse), sent)
        committed, seconds, info = self.run_round(self._build, self._apply, float(tokens))
        self.inner_steps_done += 1
        for p in self.module_params:
            p.grad = None
        return self.round_outcome(committed, seconds, info)

    def _build(self, info: RoundInfo) -> dict[str, Encoded | torch.Tensor]:
        if info.healed:  # a healed worker's momentum belongs to its old state: send nothing
            return {n: torch.zeros_like(e.tensor) for n, e in self._extracted.items()}
        return self._extracted

    def _apply(self, result: ExchangeResult, info: RoundInfo) -> None:
        if result.total_weight <= 0:
            return
        lr, wd = self.current_lr(), self.cfg.weight_decay
        with torch.no_grad():
            for name, p in zip(self.names, self.params):
                p.mul_(1 - lr * wd)
                p.add_(torch.sign(result.tensors[name]).to(p.dtype), alpha=-lr)

    def shared_state(self) -> TensorState:
        return self.replica_state()

    def load_shared_state(self, state: TensorState) -> None:
        self.load_replica_state(state)

    def state_dict(self) -> TensorState:
        state = self.shared_state()
        state.update({f"momentum.{n}": m.clone() for n, m in zip(self.names, self.momentum)})
        return state

    def load_state_dict(self, state: TensorState) -> None:
        self.load_shared_state(state)
        for n, m in zip(self.names, self.momentum):
            m.copy_(state[f"momentum.{n}"])
