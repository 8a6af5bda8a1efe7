"""PyTorch Lightning: ``configure_optimizers`` returns farlink's DiLoCo (and a scheduler on it),
two replicas on torchft.

    python examples/lightning_module.py             # a Lighthouse and 2 replicas on this machine
    python examples/lightning_module.py --lighthouse http://HOST:29510 --rank R   # one replica each

A ``LightningModule`` around a small ``LlamaForCausalLM`` built from a config (nothing is
downloaded), trained by Lightning's own loop: automatic optimization calls
``optimizer.step(closure)``, where the closure runs ``training_step`` and the backward pass,
clips gradients (``gradient_clip_val``) and zeroes them; the scheduler steps every batch.
``farlink.Optimizer`` is a ``torch.optim.Optimizer``, so ``configure_optimizers`` returning it is
all Lightning needs: no strategy, no callback (Lightning's checkpoints hold its
``state_dict()``, which carries farlink's whole state). The lines marked ``# farlink`` are all it
adds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

import farlink  # farlink

VOCAB, SEQ = 64, 32


def counting(rank: int, size: int = 512) -> torch.utils.data.TensorDataset:
    """Replica ``rank``'s shard: counting sequences mod VOCAB from random starts."""
    gen = torch.Generator().manual_seed(7919 * rank)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    return torch.utils.data.TensorDataset((start + torch.arange(SEQ)) % VOCAB)


class CountingLM(L.LightningModule):
    def __init__(self, steps: int, lighthouse: str, rank: int) -> None:
        super().__init__()
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=SEQ)
        self.model = LlamaForCausalLM(config)
        self.steps, self.lighthouse, self.rank = steps, lighthouse, rank
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)
        optimizer = farlink.Optimizer(self, optimizer, algorithm="diloco",  # farlink
                                      inner_steps=10, backend="torchft",  # farlink
                                      lighthouse=self.lighthouse, index=self.rank)  # farlink
        scheduler = get_cosine_schedule_with_warmup(optimizer, 5, self.steps)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def heldout_loss(self) -> float:
        rows = counting(rank=-1, size=32).tensors[0]
        with torch.no_grad():
            return float(self.model(input_ids=rows, labels=rows).loss)


def train(lighthouse: str, rank: int, steps: int, workdir: Path) -> dict:
    torch.manual_seed(0)  # the same initial model on every replica
    module = CountingLM(steps, lighthouse, rank)
    before = module.heldout_loss()
    loader = torch.utils.data.DataLoader(counting(rank), batch_size=8, shuffle=True)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, gradient_clip_val=1.0,
                        default_root_dir=workdir / f"r{rank}", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, loader)
    sync = trainer.optimizers[0]  # the farlink.Optimizer configure_optimizers returned
    result = {"rank": rank, "heldout_before": before, "heldout_after": module.heldout_loss(),
              "losses": module.losses[::5], "outer_steps": sync.outer_step,
              "fingerprint": sync.fingerprint()}
    sync.close()  # farlink
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", help="join this torchft Lighthouse as one replica")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", type=Path, default=Path("runs/lightning_module"))
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
