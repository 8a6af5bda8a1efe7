"""``farlink bench gpu``: what one GPU gives farlink's training, in at most about five minutes.

Three measurements, printed and written to ``OUT/gpu.json`` and ``OUT/gpu.png``:

1. **step**: tokens/s and model FLOPs utilization (MFU) of the ``125m`` preset (GPT-2 small
   shapes: 12 x 768, vocabulary 50304, 1024-token context) under bf16 autocast, timed over the
   worker's own inner step (micro-batch forward/backward, clipping, AdamW) after a warm-up, on
   synthetic tokens (throughput does not depend on the text);
2. **workers**: ``farlink train --model 125m --precision bf16`` with DiLoCo through torchft, one
   worker of one rank and then two workers sharing the GPU (``--device cuda:0``), tokens/s from the
   workers' own metrics (the framework and its rounds included), the vocabulary that of the
   shipped corpus's tokenizer;
3. **loss**: one short DiLoCo run of the ``tiny`` preset (two workers) on the CPU in fp32 and on
   the GPU in bf16, held-out losses side by side (bf16 should land within 2% of fp32).

MFU = achieved FLOP/s / the GPU's peak. FLOPs per token = ``6 N + 12 L d T`` (PaLM, appendix
B): ``6 N`` for the forward and backward pass through every weight (``N`` all parameters, the
tied embedding counted once, as the output projection), ``12 L d T`` for attention scores and
values over a context of ``T`` tokens in ``L`` layers of width ``d``. The peak is the dense bf16
tensor-core rate of the GPU model named by ``torch.cuda.get_device_name`` (:data:`PEAK_BF16`),
or ``--peak-tflops``. On a machine without CUDA the benchmark refuses to run.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from farlink.bench.report import pyplot, write_json

#: dense bf16 tensor-core FLOP/s by a substring of the device name (first match wins: the more
#: specific names come first); vendors' datasheets, without structured sparsity
PEAK_BF16: list[tuple[str, float]] = [
    ("GH200", 989e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12),
    ("H100", 989e12), ("H800", 989e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12), ("RTX 4090", 165e12),
]


class NoGpu(RuntimeError):
    """The benchmark was asked for on a machine where torch sees no CUDA device."""


def peak_flops(name: str) -> float | None:
    for key, flops in PEAK_BF16:
        if key.lower() in name.lower():
            return flops
    return None


def flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """Training FLOPs per token: ``6 N + 12 L d T`` (see the module docstring)."""
    return 6 * n_params + 12 * n_layer * d_model * seq_len


def require_gpu() -> torch.device:
    if not torch.cuda.is_available():
        raise NoGpu(f"farlink bench gpu measures a CUDA GPU, and torch {torch.__version__} sees "
                    "none on this machine; run it where one is (its CPU counterparts: farlink "
                    "bench overhead, or farlink train --precision bf16 --device cpu)")
    return torch.device("cuda", 0)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(device: torch.device, batch_size: int, steps: int, warmup: int = 5,
                 model_name: str = "125m") -> dict:
    """Tokens/s of the worker's inner step on the real ``125m`` shape, bf16 autocast."""
    from farlink.model import GPT, preset_config
    from farlink.sync.base import SyncAlgorithm, SyncOptions
    from farlink.train.compute import accumulate_gradients

    shape = preset_config(model_name)
    torch.manual_seed(0)
    model = GPT(shape).to(device)
    opt = SyncAlgorithm.default_inner_optimizer(list(model.parameters()), SyncOptions(lr=3e-4))
    gen = torch.Generator(device=device).manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, shape.vocab_size, (batch_size, shape.seq_len + 1),
                               generator=gen, device=device)
        return tokens[:, :-1], tokens[:, 1:]

    tokens = 0
    for step in range(warmup + steps):
        if step == warmup:
            _synchronize(device)
            start, tokens = time.perf_counter(), 0
        _, counted = accumulate_gradients(model, [batch()], device, "bf16")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += counted
    _synchronize(device)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": tokens / seconds, "n_params": model.num_parameters(),
            "n_layer": shape.n_layer, "d_model": shape.d_model, "seq_len": shape.seq_len,
            "batch_size": batch_size, "steps": steps,
            "max_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                               if device.type == "cuda" else None)}


def _worker_tokens_per_s(run_dir: Path, workers: int, warm: int) -> list[float]:
    """Each worker's steady tokens/s from its ``step`` records (rounds and checkpoints at the
    run's end fall outside them)."""
    from farlink.train.metrics import read_metrics

    rates = []
    for w in range(workers):
        steps = [r for r in read_metrics(run_dir / "metrics" / f"w{w}.jsonl")
                 if r["kind"] == "step" and r["step"] >= warm]
        first, last = steps[0], steps[-1]
        rates.append((last["tokens"] - first["tokens"]) / (last["time"] - first["time"]))
    return rates


def _launch(out: Path, name: str, **values) -> Path:  # noqa: ANN003 - RunConfig fields
    from farlink.config import load_config
    from farlink.train.launcher import launch

    cfg = load_config(None, {"run_dir": out / "runs" / name, "overwrite": True,
                             "join_timeout": 10, **values})
    result = launch(cfg, show_progress=False)
    if any(code != 0 for code in result.returncodes):
        raise RuntimeError(f"run {name} failed (exit codes {result.returncodes}); see the "
                           f"worker logs under {cfg.run_dir}")
    return cfg.run_dir


def measure_workers(out: Path, workers: int, steps: int, batch_size: int, vocab_size: int,
                    device: str = "cuda:0", model_name: str = "125m") -> dict:
    """``workers`` DiLoCo workers of the ``125m`` preset in bf16, all on one GPU."""
    from farlink.model import preset_config

    seq_len = preset_config(model_name).seq_len
    run_dir = _launch(out, f"workers-{workers}", model=model_name, precision="bf16", device=device,
                      workers=workers, min_replicas=workers, steps=steps, inner_steps=steps,
                      batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size,
                      eval_batches=1, log_every=1, warmup_steps=2, threads=2)
    rates = _worker_tokens_per_s(run_dir, workers, warm=3)
    shape = preset_config(model_name, vocab_size=_vocab_of(run_dir))
    return {"workers": workers, "tokens_per_s": sum(rates), "per_worker_tokens_per_s": rates,
            "n_params": shape.num_parameters(), "n_layer": shape.n_layer,
            "d_model": shape.d_model, "seq_len": shape.seq_len}


def _vocab_of(run_dir: Path) -> int:
    import json

    return json.loads((run_dir / "model.json").read_text())["config"]["vocab_size"]


def measure_loss(out: Path, steps: int, vocab_size: int, device: str = "cuda:0") -> dict:
    """The same short DiLoCo run on the CPU (fp32) and the GPU (bf16): final held-out losses."""
    from farlink.train.metrics import read_metrics

    losses = {}
    for label, where, precision in (("cpu_fp32", "cpu", "fp32"), ("gpu_bf16", device, "bf16")):
        run_dir = _launch(out, f"loss-{label}", model="tiny", device=where, precision=precision,
                          workers=2, min_replicas=2, steps=steps, inner_steps=20,
                          seq_len=128, batch_size=8, eval_batches=8, threads=4, warmup_steps=10,
                          vocab_size=vocab_size)
        evals = [r for r in read_metrics(run_dir / "metrics" / "w0.jsonl") if r["kind"] == "eval"]
        losses[label] = evals[-1]["loss"]
    gap = abs(losses["gpu_bf16"] - losses["cpu_fp32"]) / losses["cpu_fp32"]
    return {**losses, "relative_gap": gap, "within_2_percent": gap < 0.02, "steps": steps}


def run(out: Path, batch_size: int = 16, steps: int = 20, worker_steps: int = 30,
        loss_steps: int = 100, vocab_size: int = 8192, peak_tflops: float | None = None) -> dict:
    device = require_gpu()
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops * 1e12 if peak_tflops else peak_flops(name)
    started = time.time()
    rows = []

    def add(label: str, figures: dict) -> None:
        flops = flops_per_token(figures["n_params"], figures["n_layer"], figures["d_model"],
                                figures["seq_len"])
        mfu = figures["tokens_per_s"] * flops / peak if peak else None
        rows.append({"label": label, **figures, "flops_per_token": flops, "mfu": mfu})

    add("step 125m bf16 (1 rank)", measure_step(device, batch_size, steps))
    for workers in (1, 2):
        add(f"farlink train 125m bf16, {workers} worker(s) on one GPU",
            measure_workers(out, workers, worker_steps, max(1, batch_size // 2), vocab_size))
    loss = measure_loss(out, loss_steps, vocab_size)
    extra = {"gpu": name, "peak_bf16_flops": peak,
             "peak_source": "--peak-tflops" if peak_tflops else "farlink.bench.gpu.PEAK_BF16",
             "flops_formula": "6*N + 12*n_layer*d_model*seq_len per token (PaLM appendix B)",
             "loss": loss, "torch": torch.__version__, "cuda": torch.version.cuda,
             "seconds": time.time() - started}
    write_json(out / "gpu.json", "gpu", rows, extra)
    _plot(out / "gpu.png", rows, name)
    return {"rows": rows, **extra}


def _plot(path: Path, rows: list[dict], gpu: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r["label"].replace(", ", "\n") for r in rows]
    axes[0].barh(labels, [r["tokens_per_s"] for r in rows])
    axes[0].set_xlabel("tokens/s")
    axes[1].barh(labels, [100 * (r["mfu"] or 0) for r in rows])
    axes[1].set_xlabel("MFU (%)")
    axes[1].set_yticks([])
    fig.suptitle(f"farlink bench gpu: {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
