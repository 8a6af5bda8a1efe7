"""SparseLoCo (arXiv 2508.15706): DiLoCo's inner loop, a sparse 2-bit outer exchange.

Each worker runs H inner AdamW steps from the shared parameters θ, as in DiLoCo. Instead of an
outer Nesterov momentum, every worker keeps an error-feedback accumulator ``e`` per tensor:

1. ``e <- beta * e + Δ`` with Δ = θ - θ_local (beta = 0.95, the paper's);
2. ``e`` is cut into chunks of ``sparseloco_chunk`` (4096) consecutive elements and the
   ``sparseloco_topk`` (64) largest-magnitude entries of each chunk are kept (1.56% density, in
   the paper's 1-3% range; fewer kept entries trade loss for bytes);
3. their values are quantized to 2 bits: the sign and whether the magnitude is above the median
   magnitude of the kept values, four bins, each decoded as the mean of the values in it (four
   fp32 numbers per tensor); indices are bit-packed, ``ceil(log2(CHUNK))`` bits each;
4. ``e <- e - sent``, ``sent`` being exactly what peers decode from those bytes (encoded once),
   so what is not sent, including the quantization error, stays in ``e``;
5. peers average the sparse updates (token-weighted, like DiLoCo) and take a plain outer SGD step
   ``θ <- θ - lr_outer * avg`` (lr 1.0, no momentum: the accumulator stands in for it).

Bytes per tensor of ``n`` elements, ``c = min(CHUNK, n)`` elements per chunk,
``m = ceil(n / c)`` chunks and ``k = min(c, max(1, ceil(TOPK * c / CHUNK)))`` kept per chunk
(``CHUNK``, ``TOPK`` being ``sparseloco_chunk`` and ``sparseloco_topk``)::

    16 + ceil(2 * m * k / 8) + ceil(b * m * k / 8),   b = max(1, (c - 1).bit_length())

(a tensor smaller than a chunk keeps the same density). Knobs (:class:`SparseLoCoOptions`, its
own fields so its defaults are the paper's however the run is built): ``--sparseloco-lr`` (1.0)
and ``--sparseloco-beta`` (0.95); DiLoCo's ``--outer-lr``/``--outer-momentum`` do not apply;
``--sparseloco-chunk`` and ``--sparseloco-topk`` (the density, ``topk / chunk``). A failed round
leaves the accumulator as it was before the round (the next round's Δ spans the missed steps, as
in DiLoCo).

``--sparseloco-variant authors`` runs it as its authors' code does instead (2-D tiles, 1-D
tensors whole, their quantizer, median-norm clipping and a per-position mean over contributors:
:mod:`farlink.sync.sparseloco_tiles`).

Choices of this implementation: the chunks are consecutive elements of the flattened tensor (the
last one zero-padded); the 2-bit bins are sign x (above/below the median kept magnitude) with
bin-mean reconstruction; the average is weighted by tokens (equal to the plain mean when every
worker processes the same batch).
"""

from __future__ import annotations

import math

import logging
from collections.abc import Callable

import numpy as np
import torch
from typing import Literal

from pydantic import Field

from farlink.codecs import Compressor, make_compressor
from farlink.codecs._util import all_finite, as_flat_float32, require_finite, top_positions
from farlink.codecs.base import Codec, CodecError
from farlink.comm.base import RoundInfo
from farlink.sync.base import Capabilities, StepOutcome, TensorState
from farlink.sync.diloco import DiLoCo, DiLoCoOptions
from farlink.sync.exchange import Combine, Encoded, dense_of
from farlink.sync.sparseloco_tiles import TILE, TiledTwoBitCodec, clipped_contributor_mean

CHUNK = 4096
TOPK = 64
BETA = 0.95
OUTER_LR = 1.0
_LOOKUP_BYTES = 4 * 4  # four fp32 bin means

log = logging.getLogger(__name__)


def _pack_bits(values: np.ndarray, bits: int) -> bytes:
    """``values`` (non-negative ints < 2**bits) as a little-endian bit stream."""
    planes = (values.astype(np.int64)[:, None] >> np.arange(bits)) & 1
    return np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def _unpack_bits(buffer: bytes | memoryview, count: int, bits: int) -> np.ndarray:
    raw = np.frombuffer(buffer, dtype=np.uint8)
    planes = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits)
    return (planes.astype(np.int64) << np.arange(bits)).sum(1)


class SparseTwoBitCodec(Codec):
    """Chunk-wise top-k with 2-bit values and bit-packed indices (see the module doc)."""

    def __init__(self, chunk: int = CHUNK, topk: int = TOPK) -> None:
        if chunk <= 0 or not 0 < topk <= chunk:
            raise ValueError(f"need 0 < topk <= chunk, got chunk={chunk}, topk={topk}")
        self.chunk, self.topk = chunk, topk
        self.name = f"sparseloco:{chunk}:{topk}"

    def geometry(self, numel: int) -> tuple[int, int, int, int]:
        """(elements per chunk, chunks, kept per chunk, bits per index) for ``numel``."""
        c = max(1, min(self.chunk, numel))
        k = min(c, max(1, math.ceil(self.topk * c / self.chunk)))
        return c, -(-max(numel, 1) // c), k, max(1, (c - 1).bit_length())

    def max_payload_nbytes(self, shape: tuple[int, ...]) -> int:
        c, m, k, b = self.geometry(math.prod(shape))
        return _LOOKUP_BYTES + math.ceil(2 * m * k / 8) + math.ceil(b * m * k / 8)

    def encode(self, tensor: torch.Tensor) -> bytes:
        flat = as_flat_float32(tensor)
        require_finite(flat, self.name)
        c, m, k, b = self.geometry(flat.numel())
        chunks = torch.nn.functional.pad(flat, (0, m * c - flat.numel())).view(m, c)
        positions = top_positions(chunks.abs(), k)  # on the tensor's device, sorted per chunk
        # only the kept k of every c values go to the host, where they are quantized
        idx = positions.cpu().numpy()
        vals = torch.gather(chunks, 1, positions).reshape(-1).cpu().numpy()
        large = np.abs(vals) > np.median(np.abs(vals))
        codes = 2 * (vals >= 0) + large
        lookup = np.array([vals[codes == i].mean() if (codes == i).any() else 0.0
                           for i in range(4)], dtype=np.float32)
        return lookup.tobytes() + _pack_bits(codes, 2) + _pack_bits(idx.reshape(-1), b)

    def decode(self, payload: bytes, shape: torch.Size, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
        numel = math.prod(shape)
        c, m, k, b = self.geometry(numel)
        expected = self.max_payload_nbytes(tuple(shape))
        if len(payload) != expected:
            raise CodecError(f"{self.name} payload for shape {tuple(shape)} must be {expected} "
                             f"bytes, got {len(payload)}")
        view = memoryview(payload)
        lookup = torch.from_numpy(np.frombuffer(view[:_LOOKUP_BYTES], dtype="<f4").copy())
        if not all_finite(lookup):
            raise CodecError(f"{self.name} payload has NaN or Inf values")
        code_end = _LOOKUP_BYTES + math.ceil(2 * m * k / 8)
        codes = _unpack_bits(view[_LOOKUP_BYTES:code_end], m * k, 2)
        idx = _unpack_bits(view[code_end:], m * k, b).reshape(m, k)
        if idx.size and int(idx.max()) >= c:
            raise CodecError(f"{self.name} index >= {c} (chunk size)")
        if k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            raise CodecError(f"{self.name} indices within a chunk are not strictly increasing")
        out = torch.zeros(m, c, device=device)
        values = lookup[torch.from_numpy(codes)].view(m, k)
        out.scatter_(1, torch.from_numpy(idx).to(out.device), values.to(out.device))
        return out.reshape(-1)[:numel].reshape(shape).to(dtype)


class SparseLoCoOptions(DiLoCoOptions):
    """DiLoCo's schedule (H, time budgets) with SparseLoCo's own outer step: fields of their own
    rather than DiLoCo's ``outer_lr``/``outer_momentum`` with other defaults, so a run built
    from flags, a TOML file, a saved ``config.json`` or the API gets the same values."""

    sparseloco_lr: float = Field(OUTER_LR, gt=0, description="sparseloco: outer SGD learning "
                                 "rate on the averaged sparse update (no momentum)")
    sparseloco_beta: float = Field(BETA, ge=0, lt=1, description="sparseloco: decay of the "
                                   "error-feedback accumulator (it stands in for outer momentum)")
    sparseloco_chunk: int = Field(CHUNK, ge=1, description="sparseloco: elements per top-k chunk")
    sparseloco_topk: int = Field(TOPK, ge=1, description="sparseloco: entries kept per chunk "
                                 "(density = topk / chunk; per tile with the authors' variant)")
    sparseloco_variant: Literal["paper", "authors"] = Field(
        "paper", description="sparseloco: 'paper' (chunks of consecutive elements, sign/median "
        "2-bit bins, token-weighted mean) or 'authors' (their code: 2-D tiles, 1-D tensors "
        "whole, 6-sigma 2-bit bins, median-norm clipping and per-position contributor mean)")
    sparseloco_tile: int = Field(TILE, ge=1, description="sparseloco (authors' variant): "
                                 "largest tile side; each side is the largest divisor of its "
                                 "dimension up to this")


class SparseLoCo(DiLoCo):
    name = "sparseloco"
    Options = SparseLoCoOptions
    # DiLoCo's rounds; its plain outer SGD is part of the method (not injected), and it sends
    # with its own codec (the planner prices it: farlink.plan.payload)
    capabilities = Capabilities(planned=True, sharded=True, wire_codec="sparseloco",
                                time_budget=True, partial_groups=True, stage_averaging=True,
                                delayed_outer=True)

    @classmethod
    def check_run(cls, cfg) -> None:  # noqa: ANN001 - a RunConfig
        super().check_run(cfg)
        if cfg.sparseloco_topk > cfg.sparseloco_chunk:
            raise ValueError(f"--sparseloco-topk ({cfg.sparseloco_topk}) keeps more entries than a "
                             f"chunk holds; lower it or raise --sparseloco-chunk "
                             f"({cfg.sparseloco_chunk})")

    @classmethod
    def wire_spec(cls, cfg) -> str:  # noqa: ANN001 - a RunConfig
        if cfg.sparseloco_variant == "authors":
            return f"sparseloco:tiles:{cfg.sparseloco_tile}:{cfg.sparseloco_topk}"
        return f"sparseloco:{cfg.sparseloco_chunk}:{cfg.sparseloco_topk}"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        diloco = DiLoCoOptions.model_fields
        if (cfg.outer_lr, cfg.outer_momentum) != (diloco["outer_lr"].default,
                                                   diloco["outer_momentum"].default):
            log.warning("sparseloco takes its outer step with --sparseloco-lr and "
                        "--sparseloco-beta; --outer-lr/--outer-momentum (DiLoCo's) are ignored")
        compressor = self.exchange.compressor
        authors = cfg.sparseloco_variant == "authors"
        wanted = TiledTwoBitCodec if authors else SparseTwoBitCodec
        if type(compressor.codec) is not wanted or compressor.error_feedback \
                or (self.exchange.combine is None) == authors:
            raise ValueError(f"sparseloco sends its own sparse 2-bit values ({wanted.__name__}, "
                             f"its variant's) and the authors' variant averages them itself: "
                             f"build its exchange with compressor=SparseLoCo.wire_compressor"
                             f"(options, codec) and combine=SparseLoCo.wire_combine(compressor), "
                             f"not {compressor.spec}")
        self.codec = compressor.codec  # the codec the exchange was built with
        self.beta = cfg.sparseloco_beta
        self.outer_opt = torch.optim.SGD(self.global_params, lr=cfg.sparseloco_lr, momentum=0.0)
        self.error = [torch.zeros_like(p) for p in self.params]

    @classmethod
    def wire_compressor(cls, options: SparseLoCoOptions, codec: str) -> Compressor:
        """The sparse 2-bit codec of ``options`` (the paper's chunks, or the authors' tiles);
        another ``--codec`` than none, or ``+ef`` (the accumulator is its error feedback), is
        refused."""
        given = make_compressor(codec)
        if given.codec.name != "fp32" or given.error_feedback:
            raise ValueError(f"sparseloco sends its own sparse 2-bit values with its own error "
                             f"feedback; drop --codec {given.spec}")
        if options.sparseloco_variant == "authors":
            return Compressor(TiledTwoBitCodec(options.sparseloco_tile, options.sparseloco_topk))
        return Compressor(SparseTwoBitCodec(options.sparseloco_chunk, options.sparseloco_topk))

    @classmethod
    def wire_combine(cls, compressor: Compressor) -> Combine | None:
        """The authors' variant: median-norm clipping, then a mean over each position's
        contributors (:func:`farlink.sync.sparseloco_tiles.clipped_contributor_mean`); the
        paper's: None (the token-weighted mean of the decoded updates)."""
        codec = compressor.codec
        if not isinstance(codec, TiledTwoBitCodec):
            return None

        def clipped_mean(name: str, payloads: list[bytes], shape: torch.Size,
                         device: torch.device) -> torch.Tensor:
            return clipped_contributor_mean(
                [codec.decode_with_mask(p, tuple(shape), device) for p in payloads])

        return clipped_mean

    def sync_now(self) -> StepOutcome:
        before = [e.clone() for e in self.error]
        update = self._sparse_update()
        weight = float(self.tokens_since_sync)

        def build(info: RoundInfo) -> dict[str, Encoded | torch.Tensor]:
            if info.healed:  # a healed worker's Δ belongs to its old state: send nothing
                return {n: torch.zeros_like(e.tensor) for n, e in update.items()}
            return update

        committed, seconds, info = self.run_round(build, self._apply, weight)
        if not committed or weight == 0 or (info is not None and info.healed):
            with torch.no_grad():  # nothing of this round was applied: keep e as it was
                for e, old in zip(self.error, before):
                    e.copy_(old)
        return self.round_outcome(committed, seconds, info)

    # --- the delayed outer step (farlink.sync.delayed): Δ from the phase's start -----------
    def round_update(self) -> dict[str, Encoded]:
        return self._sparse_update(self.delayed.start)

    def round_failed(self, update: dict) -> None:
        """What a failed delayed round sent goes back into the error feedback (sent again
        later), as the blocking round restores the accumulator."""
        with torch.no_grad():
            for n, e in zip(self.names, self.error):
                e.add_(dense_of(update[n]))

    def _sparse_update(self, start: list[torch.Tensor] | None = None) -> dict[str, Encoded]:
        """``e <- beta e + Δ``; the top-k 2-bit part of ``e`` leaves it and is sent."""
        out = {}
        start = self.global_params if start is None else start
        with torch.no_grad():
            for n, g, p, e in zip(self.names, start, self.params, self.error):
                e.mul_(self.beta).add_(g - p.detach())
                payload = self.codec.encode(e)
                sent = self.codec.decode(payload, e.shape, e.dtype, e.device)
                e.sub_(sent)
                out[n] = Encoded(payload, sent)
        return out

    def state_parts(self) -> tuple[TensorState, Callable[[], TensorState]]:
        state, rest = super().state_parts()  # e is the training thread's: read now
        state.update({f"error.{n}": e.clone() for n, e in zip(self.names, self.error)})
        return state, rest

    def load_state_dict(self, state: TensorState) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            for n, e in zip(self.names, self.error):
                e.copy_(state[f"error.{n}"])
