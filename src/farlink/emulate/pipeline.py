"""Pipelines across the emulated WAN: stage peers and the trainer each in a namespace of its own.

Every stage peer listens on its namespace's address behind its shaped, delayed link
(``links.toml``), and the pipeline trainer runs in one more namespace, so every activation,
gradient, tied-embedding and averaging message crosses two real emulated links (the trainer
relays between stages, see :mod:`farlink.parallel.pipeline`). The trainer runs as
``python -m farlink.emulate.pipeline`` inside its namespace and prints one JSON report: the
loss of every step, held-out loss before and after, and the frame bytes it counted by kind,
which the kernel's counters of the trainer's interface can be checked against.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time
from pathlib import Path

from farlink.emulate.errors import EmulationError
from farlink.emulate.topology import Topology
from farlink.model import GPTConfig
from farlink.parallel.stage_auth import TOKEN_ENV, driver_token
from farlink.parallel.stage_server import config_json


def start_stage_peers(topo: Topology, config: GPTConfig, stages: int, peers_per_stage: int,
                      seed: int = 0, lr: float = 3e-3,
                      ready_timeout: float = 120.0) -> list[list[str]]:
    """Stage peers in namespaces 0 .. S x P - 1 (stage s, peer p in namespace s x P + p), all
    started at once; their ``host:port`` addresses, one list per stage."""
    import subprocess

    processes = []
    for s in range(stages):
        for p in range(peers_per_stage):
            index = s * peers_per_stage + p
            argv = [sys.executable, "-m", "farlink.parallel.stage_server", "--stage", str(s),
                    "--stages", str(stages), "--config", config_json(config), "--seed",
                    str(seed), "--lr", str(lr), "--host", topo.address(index)]
            processes.append((s, index, topo.spawn(index, argv, {TOKEN_ENV: driver_token()},
                                                   stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True)))
    addresses: list[list[str]] = [[] for _ in range(stages)]
    deadline = time.monotonic() + ready_timeout
    for s, index, process in processes:
        while True:
            if time.monotonic() > deadline or process.poll() is not None:
                err = process.stderr.read() if process.poll() is not None else ""
                raise EmulationError(f"stage {s} peer in namespace {topo.namespace(index)} did "
                                     f"not start: {err.strip()[-500:]}")
            ready, _, _ = select.select([process.stdout], [], [], 0.5)
            if ready:
                line = process.stdout.readline()
                if line.startswith("READY "):
                    addresses[s].append(f"{topo.address(index)}:{int(line.split()[1])}")
                    break
    return addresses


def interface_bytes(topo: Topology, index: int) -> dict[str, int]:
    """The kernel's byte counters of worker ``index``'s interface (frames, headers included)."""
    import subprocess

    from farlink.emulate import sysnet

    counters = {}
    for direction in ("tx_bytes", "rx_bytes"):
        out = subprocess.run([sysnet.tool("ip"), "netns", "exec", topo.namespace(index), "cat",
                              f"/sys/class/net/{topo.ifname(index)}/statistics/{direction}"],
                             capture_output=True, text=True, check=True)
        counters[direction] = int(out.stdout)
    return counters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="the pipeline trainer inside its namespace")
    p.add_argument("--stages", required=True, help="JSON: one list of host:port per stage")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--average-every", type=int, default=5)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--activation-codec", default="fp32")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--cache-dir", type=Path, required=True)
    p.add_argument("--eval-batches", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from farlink.data import ShardSampler, heldout_batches, prepare_data
    from farlink.parallel.pipeline import PipelineTrainer

    args = parse_args(argv)
    stages = json.loads(args.stages)
    data = prepare_data("kjv", args.vocab_size, args.cache_dir)
    replicas = len(stages[0])
    trainer = PipelineTrainer(stages, micro_batches=args.micro_batches,
                              activation_codec=args.activation_codec, lr=args.lr,
                              average_every=args.average_every,
                              pipelines=[[stage[p] for stage in stages]
                                         for p in range(replicas)])
    sampler = ShardSampler(data.train, 0, 1, args.seq_len, args.batch_size, 0)
    heldout = heldout_batches(data.heldout, args.seq_len, args.batch_size, args.eval_batches)
    before = trainer.evaluate(heldout)
    reports = [trainer.step(*sampler.next_batch()) for _ in range(args.steps)]
    after = trainer.evaluate(heldout)
    trainer.close()
    print(json.dumps({"heldout_before": before, "heldout_after": after,
                      "losses": [r.loss for r in reports],
                      "seconds": [r.seconds for r in reports],
                      "reroutes": sum(r.reroutes for r in reports),
                      "bytes": dict(trainer.bytes)}), flush=True)


if __name__ == "__main__":
    main()
