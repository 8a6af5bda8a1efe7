"""A Hugging Face ``LlamaForCausalLM`` trained with farlink's Streaming DiLoCo and int8 updates.

    python examples/hf_llama.py                     # a Lighthouse and 2 replicas on this machine
    python examples/hf_llama.py --lighthouse http://HOST:29510 --rank R   # one replica each

The model is built from a small ``LlamaConfig`` (nothing is downloaded) and trained by the
ordinary ``transformers`` recipe: ``model(input_ids=..., labels=...).loss``, backward, and one
farlink call where ``optimizer.step()`` was. The lines marked ``# farlink`` are all it adds.
Swap ``algorithm=`` for ``diloco``, ``ddp``, ``demo``... or ``codec=`` for ``fp16``, ``int4+ef``,
``topk:0.01+ef``: the loop stays the same.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import farlink  # farlink

VOCAB, SEQ = 64, 32


def batch(rank: int, step: int, size: int = 8) -> torch.Tensor:
    """Replica ``rank``'s token batch ``step``: counting sequences mod VOCAB from random starts,
    an easy language a tiny Llama learns in a few dozen steps."""
    gen = torch.Generator().manual_seed(7919 * rank + step)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    return (start + torch.arange(SEQ)) % VOCAB


def train(lighthouse: str, rank: int, steps: int, checkpoints: Path) -> dict:
    torch.manual_seed(0)  # the same initial model on every replica
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    heldout = batch(rank=-1, step=0, size=32)
    sync = farlink.Optimizer(model, optimizer, algorithm="streaming_diloco",  # farlink
                             codec="int8", inner_steps=10, fragments=2, overlap_steps=2,  # farlink
                             backend="torchft", lighthouse=lighthouse, index=rank)  # farlink
    start = (sync.load(checkpoints) or {}).get("step", 0)  # farlink
    for step in range(start, steps):
        x = batch(rank, step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        sync.step(tokens=x.numel())  # farlink
        if (step + 1) % 10 == 0:  # farlink
            sync.save(checkpoints, step=step + 1)  # farlink
    sync.finish()  # farlink: land the fragment still in flight
    with torch.no_grad():
        after = float(model(input_ids=heldout, labels=heldout).loss)
    result = {"rank": rank, "heldout_after": after, "outer_steps": sync.outer_step,
              "fingerprint": sync.fingerprint(), "bytes_sent": sync.bytes_sent()}
    sync.close()  # farlink
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", help="join this torchft Lighthouse as one replica")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workdir", type=Path, default=Path("runs/hf_llama"))
    args = parser.parse_args()
    if args.lighthouse:
        result = train(args.lighthouse, args.rank, args.steps,
                       args.workdir / "checkpoints" / f"r{args.rank}")
        print(json.dumps(result), flush=True)
        return 0
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas,
                                  join_timeout_ms=10_000)
    procs = [subprocess.Popen([sys.executable, __file__, "--lighthouse", lighthouse.address(),
                               "--rank", str(r), "--steps", str(args.steps),
                               "--workdir", str(args.workdir)], stdout=subprocess.PIPE, text=True)
             for r in range(args.replicas)]
    outputs = [p.communicate()[0] for p in procs]
    lighthouse.shutdown()
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs if out.strip()]
    for result in results:
        print(json.dumps(result))
    print(f"log(vocab) = {torch.log(torch.tensor(float(VOCAB))):.3f} (an untrained model's loss)")
    agree = len({r["fingerprint"] for r in results}) == 1
    print(f"replicas agree: {agree}")
    return 0 if all(p.returncode == 0 for p in procs) and agree else 1


if __name__ == "__main__":
    sys.exit(main())
