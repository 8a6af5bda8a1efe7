"""One training variant with its workers as threads of one process (``InProcessGroup``).

The algorithms, the exchange, the codecs and the byte accounting are the real ones; only the
process boundary and the backend are replaced by the in-process collective. On a machine with
few cores this makes a hyperparameter sweep affordable (one interpreter, one tokenizer load, no
Lighthouse) while the numbers it reports are the same quantities ``bench algorithms`` reports:
held-out loss of the replicas' final state at equal tokens, and bytes each worker sent.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from farlink.comm.inprocess import InProcessGroup
from farlink.compose import build_handoff, build_scorer, global_params_of, wire
from farlink.config import RunConfig, load_config
from farlink.robust.aggregators import make_aggregator
from farlink.sync import algorithm_class
from farlink.sync.exchange import Exchange


def train_in_process(label: str, values: dict[str, Any], eval_points: int = 4,
                     exchange_factory=None, link=None) -> dict:  # noqa: ANN001
    """Train ``values`` (RunConfig fields) with ``workers`` threads; return a result row with
    held-out loss at ``eval_points`` evenly spaced token counts (worker 0's replica).

    ``exchange_factory(collective, rank, cfg, compressor=, combine=, scorer=)``: the exchange
    of each worker, built with the algorithm's codec and combine (:func:`farlink.compose.wire`)
    and the ``--score loss`` scorer or None (default: the config's aggregator, no
    authentication); ``link``: in-process link emulation
    (:class:`~farlink.comm.base.LinkModel`) for every worker's collectives."""
    from farlink.data import ShardSampler, evaluate, heldout_batches, prepare_data
    from farlink.model import GPT, preset_config
    from farlink.train.compute import accumulate_gradients, autocast, micro_batches, resolve_device

    cfg: RunConfig = load_config(None, values)
    torch.set_num_threads(cfg.threads)
    data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
    heldout = heldout_batches(data.heldout, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    model_cfg = preset_config(cfg.model, vocab_size=data.vocab_size, seq_len=cfg.seq_len)
    marks = {round(cfg.steps * (i + 1) / eval_points) for i in range(eval_points)}
    init_lock = threading.Lock()
    started = time.perf_counter()

    def member(rank: int, collective) -> dict:  # noqa: ANN001
        with init_lock:  # the global RNG is shared by threads: seed and build atomically
            torch.manual_seed(cfg.seed)
            model = GPT(model_cfg)
        device = resolve_device(cfg.device, rank)
        model.to(device)
        sampler = ShardSampler(data.train, shard=rank, num_shards=cfg.workers,
                               seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
        cls = algorithm_class(cfg.algorithm)
        # the scorer reads the algorithm's global parameters when it scores (see
        # farlink.compose.global_params_of): the exchange is built once, with its scorer
        scorer = build_scorer(cfg, model, global_params_of(lambda: algo), data) \
            if cfg.score == "loss" else None
        parts = {**wire(cls, cfg, cfg.codec), "scorer": scorer}
        exchange = exchange_factory(collective, rank, cfg, **parts) if exchange_factory \
            else Exchange(collective, sender=f"w{rank}",
                          aggregator=make_aggregator(cfg.aggregator), **parts)
        algo = cls(model, cfg, collective, exchange, **build_handoff(cls, exchange))
        evals, compute_s = [], 0.0
        while not algo.finished():
            began = time.perf_counter()
            _, tokens = accumulate_gradients(
                model, micro_batches(sampler.next_batch, cfg.grad_accum), device, cfg.precision)
            compute_s += time.perf_counter() - began
            algo.step(tokens)
            if rank == 0 and algo.inner_steps_done in marks:
                evals.append({"step": algo.inner_steps_done,
                              "tokens": algo.inner_steps_done * tokens * cfg.workers,
                              "bytes_sent": collective.stats.bytes_sent,
                              "loss": heldout_loss(model, device)})
        algo.finish()
        scorer, ledger = getattr(exchange, "scorer", None), getattr(exchange, "ledger", None)
        return {"evals": evals, "bytes_sent": collective.stats.bytes_sent,
                "final_loss": heldout_loss(model, device),
                "params": sum(p.numel() for p in algo.params), "compute_s": compute_s,
                "score_s": scorer.seconds if scorer is not None else 0.0,
                "score_sequences": scorer.sequences if scorer is not None else 0,
                "ratings": scorer.history if scorer is not None else [],
                "ledger": ledger.to_dict() if ledger is not None else None}

    def heldout_loss(model, device) -> float:  # noqa: ANN001
        with autocast(device, cfg.precision):
            return evaluate(model, heldout)

    results = InProcessGroup(cfg.workers, link=link).run(member, timeout=24 * 3600)
    tokens = cfg.steps * cfg.tokens_per_step  # per worker
    bytes_sent = max(r["bytes_sent"] for r in results)
    return {
        "label": label,
        "config": {k: v for k, v in values.items() if k not in ("run_dir", "cache_dir")},
        "final_heldout_loss": results[0]["final_loss"],
        "worker_losses": [r["final_loss"] for r in results],
        "evals": results[0]["evals"],
        "params": results[0]["params"],
        "tokens_per_worker": tokens,
        "bytes_per_worker": bytes_sent,
        "bytes_per_token": bytes_sent / tokens,
        "wall_s": time.perf_counter() - started,
        # each worker's forward and backward seconds per inner step, measured (the mean over
        # workers; threads share the cores, so it is what this machine gave under its load)
        "compute_s_per_step": sum(r["compute_s"] for r in results) / len(results) / cfg.steps,
        # loss scoring's cost: its seconds against the inner steps' forward and backward
        "score_share": (sum(r["score_s"] for r in results)
                        / max(sum(r["compute_s"] for r in results), 1e-9)),
        # the same in work, which load does not change: sequences the scorer ran forward over
        # 3 x the sequences trained (a forward and a backward cost about 3 forwards)
        "score_share_counted": (sum(r["score_sequences"] for r in results)
                                / (3 * len(results) * cfg.steps * cfg.batch_size
                                   * cfg.grad_accum)),
        "ratings": results[0]["ratings"],
        "ledgers": [r["ledger"] for r in results],
    }
