"""Replica groups of several ranks: FSDP2 inside each, DiLoCo across them (INTELLECT-1's shape).

    python examples/fsdp_replica_groups.py --replica-groups 2 --ranks 2   # a Lighthouse, 2x2 ranks

One replica group is one ``torchrun``, as on a real node (set the Lighthouse and the replica
group's number the way torchft's own examples do)::

    TORCHFT_LIGHTHOUSE=http://HOST:29510 REPLICA_GROUP_ID=0 \\
        torchrun --nnodes 1 --nproc-per-node 8 \\
        examples/fsdp_replica_groups.py --replica-group-worker

(torchrun's store listens on every interface; ``python -m farlink.parallel.replica_group_agent
--host ADDR`` in its place, with the same arguments, keeps it on ADDR. This script starts its
replica groups so.)

Inside a replica group the model is sharded over its ranks with ``fully_shard`` (Gloo on CPU, NCCL
on GPUs) and each rank takes its slice of the replica group's batch; across replica groups
farlink's DiLoCo averages pseudo-gradients, each rank only its own shard, with the same rank of
the other replica groups. The lines marked ``# farlink`` are all farlink adds to an FSDP2 loop.
``--ranks 1`` runs the same replicas unsharded, one process per replica group: both shapes train
the same model from the same batches, which is what makes their losses comparable.

With ``--max-restarts 1`` torchrun restarts a replica group one of whose ranks died; the replica
group resumes from its newest checkpoint (``WORKDIR/groupI/step-N``, all its ranks' parts) and
heals from the other replica groups at its first round. The others wait for it there, since
``--min-replicas`` defaults to the number of replica groups: with fewer, a survivor could finish
alone and the replica groups end on different models.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import farlink  # farlink
from farlink.model.config import preset_config
from farlink.model.gpt import GPT
from farlink.parallel.sharding import ReplicaGroup, shard_model  # farlink

VOCAB, SEQ = 256, 32


def batch(index: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica group ``index``'s batch ``step``: token runs with a group-independent rule (next =
    3x+1 mod V) and noise, deterministic, so any rank layout (and a resumed replica group) sees
    the same rows."""
    gen = torch.Generator().manual_seed(1_000_003 * index + step)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    rows = [start]
    for _ in range(SEQ):
        rows.append((rows[-1] * 3 + 1) % VOCAB)
    tokens = torch.cat(rows, dim=1)
    noise = torch.rand(tokens.shape, generator=gen) < 0.1
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=gen), tokens)
    return tokens[:, :-1], tokens[:, 1:]


def heldout_loss(model: nn.Module, rank: int, ranks: int) -> float:
    x, y = batch(index=-1, step=0, size=64)
    share = len(x) // ranks
    with torch.no_grad():
        _, loss = model(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
    if ranks > 1:
        dist.all_reduce(loss)  # every rank's part of the held-out set
        loss = loss / ranks
    return float(loss)


def replica_group_total(value: int, group: ReplicaGroup) -> int:
    """``value`` summed over the replica group's ranks (bytes: each rank sends its own shard)."""
    if group.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor)
    return int(tensor.item())


def replica_group_worker(args: argparse.Namespace) -> dict:
    group = ReplicaGroup.from_env()  # torchrun's RANK/WORLD_SIZE, REPLICA_GROUP_ID  # farlink
    group.start()  # farlink
    torch.manual_seed(0)  # the same initial model on every rank of every replica group
    model = GPT(preset_config("tiny", vocab_size=VOCAB, seq_len=SEQ))
    if group.size > 1:
        shard_model(model)  # FSDP2: each block, then the root (embeddings, head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    sync = farlink.Optimizer(model, optimizer, algorithm="diloco", steps=args.steps,  # farlink
                             inner_steps=args.inner_steps, backend="torchft",  # farlink
                             min_replicas=args.min_replicas, join_timeout=5.0,  # farlink
                             index=group.replica_index, replica_group=group)  # farlink
    resumed = sync.load(args.workdir / f"group{group.replica_index}")  # farlink
    start = sync.inner_steps
    share = args.batch // group.size
    losses = []
    while not sync.finished:  # farlink: a group healed from a peer adopts the peer's schedule
        x, y = batch(group.replica_index, sync.inner_steps, args.batch)
        rows = slice(group.rank * share, (group.rank + 1) * share)
        x, y = x[rows], y[rows]
        _, loss = model(x, y)
        loss.backward()  # FSDP2 averages the gradients over the replica group's ranks
        outcome = sync.step(tokens=x.numel())  # farlink
        losses.append(float(loss.detach()))
        if outcome.committed:  # farlink
            sync.save(args.workdir / f"group{group.replica_index}")  # farlink
    fingerprints = [None] * group.size
    if group.size > 1:
        dist.all_gather_object(fingerprints, sync.fingerprint())
    else:
        fingerprints = [sync.fingerprint()]
    result = {"replica_group": group.replica_index, "rank": group.rank, "ranks": group.size,
              "resumed_at": start if resumed else None, "outer_steps": sync.outer_step,
              "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
              "heldout": heldout_loss(model, group.rank, group.size),
              "fingerprints": fingerprints,
              "replica_group_bytes_sent": replica_group_total(sync.bytes_sent(), group),
              "last_train_loss": losses[-1] if losses else None}
    sync.close()  # farlink
    group.close()
    return result


def leave(code: int) -> None:
    """End this rank without the interpreter's teardown, once its result is printed and every
    object is closed. Gloo's worker threads release a collective's tensors a moment after the
    caller's wait returns; if the interpreter is finalizing then, the thread that takes the GIL
    back to free them is unwound by force and the process aborts (``terminate called without an
    active exception``, SIGABRT): a finished rank would fail its replica group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def replica_group_command(args: argparse.Namespace, index: int) -> list[str]:
    """How this machine starts one replica group: torchrun for several ranks (through farlink's
    replica_group_agent, whose store listens on loopback, not on every interface), python for
    one."""
    script = [__file__, "--replica-group-worker", "--steps", str(args.steps),
              "--batch", str(args.batch),
              "--inner-steps", str(args.inner_steps), "--min-replicas", str(args.min_replicas),
              "--workdir", str(args.workdir)]
    if args.ranks == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "farlink.parallel.replica_group_agent", "--host", "127.0.0.1",
            f"--nproc-per-node={args.ranks}", f"--max-restarts={args.max_restarts}", *script]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica-group-worker", action="store_true",
                        help="be one rank of one replica group")
    parser.add_argument("--replica-groups", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per replica group")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8, help="rows per replica group and step")
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--min-replicas", type=int, default=None)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("runs/fsdp_replica_groups"))
    args = parser.parse_args()
    if args.replica_group_worker:
        result = replica_group_worker(args)
        if result["rank"] == 0:
            print(json.dumps(result), flush=True)
        leave(0)
    args.min_replicas = args.min_replicas or args.replica_groups
    from farlink.train.lighthouse import Lighthouse

    lighthouse = Lighthouse(min_replicas=args.min_replicas, join_timeout=5.0).start()
    try:
        procs = [subprocess.Popen(replica_group_command(args, s), stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address,
                                       "REPLICA_GROUP_ID": str(s), "OMP_NUM_THREADS": "1"})
                 for s in range(args.replica_groups)]
        outputs = [p.communicate()[0] for p in procs]
    finally:
        lighthouse.stop()
    results = [json.loads(line) for out in outputs for line in out.splitlines()
               if line.startswith("{")]
    for result in results:
        print(json.dumps(result))
    agree = (len({tuple(r["fingerprints"]) for r in results}) == 1
             and len(results) == args.replica_groups)
    print(f"replica groups agree, rank by rank: {agree}")
    return 0 if all(p.returncode == 0 for p in procs) and agree else 1


if __name__ == "__main__":
    sys.exit(main())
