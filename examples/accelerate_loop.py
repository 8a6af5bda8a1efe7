"""Hugging Face Accelerate: ``accelerator.prepare(model, optimizer, dataloader, scheduler)`` with
farlink's DiLoCo as the optimizer, two replicas on torchft.

    python examples/accelerate_loop.py              # a Lighthouse and 2 replicas on this machine
    python examples/accelerate_loop.py --lighthouse http://HOST:29510 --rank R   # one replica each

The loop is Accelerate's own (``accelerator.backward``, ``clip_grad_norm_``, ``optimizer.step()``,
``scheduler.step()``, ``optimizer.zero_grad()``) around a small ``LlamaForCausalLM`` built from a
config (nothing is downloaded). ``farlink.Optimizer`` is a ``torch.optim.Optimizer`` around the
user's AdamW, so ``prepare`` wraps it like any other and the scheduler drives AdamW's lr; every
10th step is a DiLoCo round. The lines marked ``# farlink`` are all it adds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

import farlink  # farlink

VOCAB, SEQ = 64, 32


def counting(rank: int, size: int = 512) -> torch.utils.data.TensorDataset:
    """Replica ``rank``'s shard: counting sequences mod VOCAB from random starts."""
    gen = torch.Generator().manual_seed(7919 * rank)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    return torch.utils.data.TensorDataset((start + torch.arange(SEQ)) % VOCAB)


def heldout_loss(model: LlamaForCausalLM) -> float:
    rows = counting(rank=-1, size=32).tensors[0]
    with torch.no_grad():
        return float(model(input_ids=rows, labels=rows).loss)


def train(lighthouse: str, rank: int, steps: int, workdir: Path) -> dict:
    torch.manual_seed(0)  # the same initial model on every replica
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)
    before = heldout_loss(model)
    accelerator = Accelerator(cpu=True)
    loader = torch.utils.data.DataLoader(counting(rank), batch_size=8, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    optimizer = farlink.Optimizer(model, optimizer, algorithm="diloco", inner_steps=10,  # farlink
                                  backend="torchft", lighthouse=lighthouse, index=rank)  # farlink
    scheduler = get_cosine_schedule_with_warmup(optimizer, 5, steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    losses = []
    for _, (rows,) in zip(range(steps), loader):
        loss = model(input_ids=rows, labels=rows).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    sync = optimizer.optimizer  # the farlink.Optimizer inside Accelerate's wrapper
    result = {"rank": rank, "heldout_before": before, "heldout_after": heldout_loss(model),
              "losses": losses[::5], "outer_steps": sync.outer_step,
              "fingerprint": sync.fingerprint()}
    sync.close()  # farlink
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", help="join this torchft Lighthouse as one replica")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", type=Path, default=Path("runs/accelerate_loop"))
    args = parser.parse_args()
    if args.lighthouse:  # one replica
        result = train(args.lighthouse, args.rank, args.steps, args.workdir)
        print(json.dumps(result), flush=True)
        return 0
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas,
                                  join_timeout_ms=10_000)
    procs = [subprocess.Popen([sys.executable, __file__, "--lighthouse", lighthouse.address(),
                               "--rank", str(r), "--steps", str(args.steps),
                               "--workdir", str(args.workdir)],
                              stdout=subprocess.PIPE, text=True)
             for r in range(args.replicas)]
    outputs = [p.communicate()[0] for p in procs]
    lighthouse.shutdown()
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs if out.strip()]
    for result in results:
        print(json.dumps(result))
    agree = len({r["fingerprint"] for r in results}) == 1
    print(f"replicas agree: {agree}")
    return 0 if all(p.returncode == 0 for p in procs) and agree else 1


if __name__ == "__main__":
    sys.exit(main())
