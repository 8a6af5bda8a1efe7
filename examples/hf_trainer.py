"""A Hugging Face ``Trainer`` whose optimizer is farlink's DiLoCo: two replicas on torchft.

    python examples/hf_trainer.py                   # a Lighthouse and 2 replicas on this machine
    python examples/hf_trainer.py --lighthouse http://HOST:29510 --rank R   # one replica each
    python examples/hf_trainer.py --stop-at 15 && python examples/hf_trainer.py --resume

The model is a small ``LlamaForCausalLM`` built from a config (nothing is downloaded), the
dataset and ``TrainingArguments`` are the user's, and the optimizer and scheduler go to
``Trainer(optimizers=(optimizer, scheduler))`` as for any torch optimizer: ``farlink.Optimizer``
is one, around the user's AdamW, so the scheduler drives AdamW's lr, Trainer clips gradients,
and every Trainer checkpoint holds farlink's whole state (``optimizer.pt``):
``resume_from_checkpoint`` continues the run exactly, mid-round too. The lines marked
``# farlink`` are all it adds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments, get_cosine_schedule_with_warmup)

import farlink  # farlink

VOCAB, SEQ = 64, 32


class Counting(torch.utils.data.Dataset):
    """Replica ``rank``'s shard: counting sequences mod VOCAB from random starts."""

    def __init__(self, rank: int, size: int = 512) -> None:
        gen = torch.Generator().manual_seed(7919 * rank)
        start = torch.randint(0, VOCAB, (size, 1), generator=gen)
        self.rows = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class StopAt(TrainerCallback):
    """Stops training after step ``step`` (a job's time running out, say)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if state.global_step == self.step:
            control.should_training_stop = control.should_save = True


def heldout_loss(model: LlamaForCausalLM) -> float:
    rows = Counting(rank=-1, size=32).rows
    with torch.no_grad():
        return float(model(input_ids=rows, labels=rows).loss)


def train(lighthouse: str, rank: int, steps: int, workdir: Path, stop_at: int | None,
          resume: bool) -> dict:
    torch.manual_seed(0)  # the same initial model on every replica
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)
    before = heldout_loss(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    optimizer = farlink.Optimizer(model, optimizer, algorithm="diloco", inner_steps=10,  # farlink
                                  backend="torchft", lighthouse=lighthouse, index=rank)  # farlink
    scheduler = get_cosine_schedule_with_warmup(optimizer, 5, steps)
    args = TrainingArguments(output_dir=str(workdir / f"r{rank}"), max_steps=steps,
                             per_device_train_batch_size=8, save_steps=5, logging_steps=5,
                             report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Counting(rank),
                      optimizers=(optimizer, scheduler),
                      callbacks=[StopAt(stop_at)] if stop_at else [])
    trainer.train(resume_from_checkpoint=resume or None)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {"rank": rank, "heldout_before": before, "heldout_after": heldout_loss(model),
              "losses": losses, "step": trainer.state.global_step,
              "outer_steps": optimizer.outer_step, "fingerprint": optimizer.fingerprint()}
    optimizer.close()  # farlink
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", help="join this torchft Lighthouse as one replica")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stop-at", type=int, help="stop after this step (a checkpoint)")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    parser.add_argument("--workdir", type=Path, default=Path("runs/hf_trainer"))
    args = parser.parse_args()
    if args.lighthouse:  # one replica
        result = train(args.lighthouse, args.rank, args.steps, args.workdir, args.stop_at,
                       args.resume)
        print(json.dumps(result), flush=True)
        return 0
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas,
                                  join_timeout_ms=10_000)
    extra = [*(["--stop-at", str(args.stop_at)] if args.stop_at else []),
             *(["--resume"] if args.resume else [])]
    procs = [subprocess.Popen([sys.executable, __file__, "--lighthouse", lighthouse.address(),
                               "--rank", str(r), "--steps", str(args.steps),
                               "--workdir", str(args.workdir), *extra],
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
