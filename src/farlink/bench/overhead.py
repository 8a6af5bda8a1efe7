"""``farlink bench overhead``: one farlink worker vs a plain PyTorch loop on the same model.

Both run as separate processes with the same thread count, model, batch shape and data; each is
timed over its steady-state steps only (setup and the final evaluation excluded), alternated
``repeats`` times so machine noise hits both alike. The farlink side includes everything the
framework adds to a step: the sync algorithm, metrics, quorum rounds and checkpoints.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from farlink.bench.report import write_json
from farlink.bench.runner import set_aside_earlier_runs
from farlink.train.metrics import read_metrics

PLAIN_LOOP = r"""
import json, sys, time, torch
from farlink.config import RunConfig
from farlink.data import ShardSampler, prepare_data
from farlink.model import GPT, preset_config
cfg = RunConfig.model_validate_json(sys.argv[1])
torch.set_num_threads(cfg.threads); torch.manual_seed(cfg.seed)
data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
model = GPT(preset_config(cfg.model, vocab_size=data.vocab_size, seq_len=cfg.seq_len))
opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
sampler = ShardSampler(data.train, 0, 1, cfg.seq_len, cfg.batch_size, cfg.seed)
warm, tokens = 10, 0
for step in range(cfg.steps):
    if step == warm:
        start = time.perf_counter(); tokens = 0
    x, y = sampler.next_batch()
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    tokens += x.numel()
print(json.dumps({"tokens_per_s": tokens / (time.perf_counter() - start)}))
"""


def farlink_tokens_per_s(run_dir: Path, warm: int = 10) -> float:
    records = [r for r in read_metrics(run_dir / "metrics" / "w0.jsonl")
               if r["kind"] in ("step", "sync")]
    first = next(r for r in records if r["step"] >= warm)
    last = records[-1]
    return (last["tokens"] - first["tokens"]) / (last["time"] - first["time"])


def run(out: Path, steps: int, repeats: int, model: str) -> dict:
    set_aside_earlier_runs(out)
    from farlink.config import load_config
    from farlink.train.launcher import launch

    rows = []
    for i in range(repeats):
        cfg = load_config(None, {"workers": 1, "steps": steps, "model": model, "log_every": 1,
                                 "inner_steps": 50, "run_dir": out / "runs" / f"farlink-{i}"})
        proc = subprocess.run([sys.executable, "-c", PLAIN_LOOP, cfg.model_dump_json()],
                              capture_output=True, text=True, check=True)
        plain = json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"]
        t0 = time.time()
        launch(cfg, show_progress=False)
        ours = farlink_tokens_per_s(cfg.run_dir)
        rows.append({"repeat": i, "plain_tokens_per_s": plain, "farlink_tokens_per_s": ours,
                     "overhead": 1 - ours / plain, "farlink_run_s": time.time() - t0})
    overhead = statistics.median(r["overhead"] for r in rows)
    write_json(out / "overhead.json", "overhead", rows,
               {"median_overhead": overhead, "steps": steps, "model": model})
    return {"rows": rows, "median_overhead": overhead}
