"""Your own model, your own optimizer, your own loop: farlink's DiLoCo across 2 processes.

    python examples/own_model.py                    # a Lighthouse and 2 replicas on this machine
    python examples/own_model.py --lighthouse http://HOST:29510 --rank R   # one replica each

The model is a plain ``nn.Module`` (a small regressor, not farlink's GPT), the optimizer is the
user's ``torch.optim.AdamW`` with its own lr, and the loop is ordinary PyTorch. The lines marked
``# farlink`` are everything farlink adds to it: construct the wrapper, resume, call it after
``loss.backward()`` (instead of ``optimizer.step(); optimizer.zero_grad()``), checkpoint after a
committed round, close. Replicas synchronize on the torchft backend: a Lighthouse forms the quorum
of every round; a replica killed and restarted resumes from its checkpoint, and one that joins
late heals from the live ones.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import farlink  # farlink

FEATURES = 16


class Regressor(nn.Module):
    """Two layers and a GELU: anything with parameters will do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def batch(rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``rank``'s batch ``step``: its own shard of y = sin(x . w), deterministic, so a
    resumed replica sees exactly the batches it would have seen."""
    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randn(size, FEATURES, generator=gen)
    w = torch.linspace(-1, 1, FEATURES)
    return x, torch.sin(x @ w)


def heldout_loss(model: nn.Module) -> float:
    x, y = batch(rank=-1, step=0, size=512)
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def train(lighthouse: str, rank: int, steps: int, checkpoints: Path) -> dict:
    torch.manual_seed(0)  # the same initial model on every replica
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = heldout_loss(model)
    sync = farlink.Optimizer(model, optimizer, algorithm="diloco", inner_steps=10,  # farlink
                             backend="torchft", lighthouse=lighthouse, index=rank)  # farlink
    start = (sync.load(checkpoints) or {}).get("step", 0)  # farlink
    for step in range(start, steps):
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        outcome = sync.step(tokens=len(x))  # farlink
        if outcome.committed:  # farlink
            sync.save(checkpoints, step=step + 1)  # farlink
    result = {"rank": rank, "heldout_before": before, "heldout_after": heldout_loss(model),
              "outer_steps": sync.outer_step, "fingerprint": sync.fingerprint(),
              "bytes_sent": sync.bytes_sent()}
    sync.close()  # farlink
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", help="join this torchft Lighthouse as one replica")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workdir", type=Path, default=Path("runs/own_model"))
    args = parser.parse_args()
    if args.lighthouse:  # one replica
        result = train(args.lighthouse, args.rank, args.steps,
                       args.workdir / "checkpoints" / f"r{args.rank}")
        print(json.dumps(result), flush=True)
        return 0
    # this machine alone: a Lighthouse (torchft's own) and N replica processes
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas,
                                  join_timeout_ms=10_000)
    address = lighthouse.address()
    procs = [subprocess.Popen([sys.executable, __file__, "--lighthouse", address,
                               "--rank", str(r), "--steps", str(args.steps),
                               "--workdir", str(args.workdir)], stdout=subprocess.PIPE, text=True)
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
