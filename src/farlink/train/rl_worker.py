"""``farlink rl-worker``: one rollout worker as its own process, talking to a trainer over TCP.

It asks the trainer side (``farlink rl --listen``) what to build (the model's architecture:
farlink's GPT or a transformers causal LM, from its config alone, so the worker's machine needs
no model directory; the delta codec; the sampling settings), builds an empty model of it, and
runs the same
:class:`~farlink.rl.workers.RolloutWorker` loop a thread runs, through
:class:`~farlink.rl.remote.RemoteBoard` and :class:`~farlink.rl.remote.RemotePublisher`: the
first job fetches the policy in hashed chunks, later ones take deltas. It exits when the
trainer turns it away (banned), when the trainer stays unreachable for ``reconnect_s``
seconds, or on SIGTERM/Ctrl-C between jobs.
"""

from __future__ import annotations

import argparse
import signal
import threading

import torch

from farlink.codecs import make_codec
from farlink.model.build import model_from_description, module_description
from farlink.rl.broadcast import PolicyReplica
from farlink.rl.remote import Connection, RemoteBoard, RemotePublisher
from farlink.rl.trainer import RLConfig
from farlink.rl.workers import RolloutWorker


def hello_for(model: torch.nn.Module, codec: str, config: RLConfig, eot: int) -> dict:
    """What the trainer side tells a new worker process: enough to build its side (the
    policy's architecture as ``model.json`` would describe it: farlink's GPT or hf:DIR's)."""
    from dataclasses import asdict

    return {"model": module_description(model), "codec": codec, "config": asdict(config),
            "eot": eot}


def connect_worker(name: str, host: str, port: int, pace_seconds: float = 0.0,
                   reconnect_s: float = 60.0) -> RolloutWorker:
    connection = Connection(host, port, reconnect_s)
    hello, _ = connection.call({"op": "hello"})
    config = RLConfig(**hello["config"])
    torch.manual_seed(0)  # the weights arrive by fetch; this only makes the empty model
    model = model_from_description(hello["model"]).eval()
    replica = PolicyReplica(model, make_codec(hello["codec"]), max_chain=config.max_staleness + 1)
    return RolloutWorker(name, RemoteBoard(connection, hello["eot"]), RemotePublisher(connection),
                         replica, config, pace_seconds=pace_seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="farlink rl-worker", description=__doc__)
    parser.add_argument("--connect", required=True, help="HOST:PORT of `farlink rl --listen`")
    parser.add_argument("--name", required=True, help="this worker's name (the ledger's key)")
    parser.add_argument("--pace-seconds", type=float, default=0.0)
    parser.add_argument("--reconnect-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    torch.set_num_threads(1)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        worker = connect_worker(args.name, host, int(port), args.pace_seconds, args.reconnect_s)
        worker.run(stop)
    except OSError as exc:
        print(f"rl-worker {args.name}: trainer unreachable for {args.reconnect_s:.0f} s ({exc})",
              flush=True)
        return 1
    print(f"rl-worker {args.name}: {worker.jobs_done} jobs, {worker.rollouts_done} rollouts",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
