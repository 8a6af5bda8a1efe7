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

Its name on the trainer side (jobs, the ledger, bans) is the id of its Ed25519 key, kept in
``--identity`` (made there at first start; by default one file per ``--name`` under the user's
state directory), which it proves on every connection; ``--name`` is only a label for logs.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farlink.codecs import make_codec
from farlink.model.build import model_from_description, module_description
from farlink.rl.broadcast import PolicyReplica
from farlink.rl.remote import Connection, RemoteBoard, RemotePublisher
from farlink.rl.trainer import RLConfig
from farlink.rl.workers import RolloutWorker
from farlink.robust.auth import OpenKeyAuth
from farlink.robust.keys import key_id, load_or_generate


def hello_for(model: torch.nn.Module, codec: str, config: RLConfig, eot: int) -> dict:
    """What the trainer side tells a new worker process: enough to build its side (the
    policy's architecture as ``model.json`` would describe it: farlink's GPT or hf:DIR's)."""
    from dataclasses import asdict

    return {"model": module_description(model), "codec": codec, "config": asdict(config),
            "eot": eot}


def default_identity(label: str) -> Path:
    """Where a worker labelled ``label`` keeps its key unless told: under
    ``$XDG_STATE_HOME`` (``~/.local/state``), one file per label, so two workers of one machine
    are two keys."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    filename = re.sub(r"[^A-Za-z0-9._-]", "_", label) + ".key"
    return Path(state) / "farlink" / "rl-worker" / filename


def connect_worker(label: str, host: str, port: int, key: Ed25519PrivateKey,
                   pace_seconds: float = 0.0, reconnect_s: float = 60.0) -> RolloutWorker:
    """A worker named by ``key``'s id, connected to the trainer at ``host:port`` (proving the
    key on every connection) and built from its hello."""
    connection = Connection(host, port, reconnect_s, identity=OpenKeyAuth(key), label=label)
    hello, _ = connection.call({"op": "hello"})
    config = RLConfig(**hello["config"])
    torch.manual_seed(0)  # the weights arrive by fetch; this only makes the empty model
    model = model_from_description(hello["model"]).eval()
    replica = PolicyReplica(model, make_codec(hello["codec"]), max_chain=config.max_staleness + 1)
    return RolloutWorker(connection.worker, RemoteBoard(connection, hello["eot"]),
                         RemotePublisher(connection), replica, config, pace_seconds=pace_seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="farlink rl-worker", description=__doc__)
    parser.add_argument("--connect", required=True, help="HOST:PORT of `farlink rl --listen`")
    parser.add_argument("--name", required=True, help="this worker's label in the trainer's "
                        "logs (the ledger knows it by its key id)")
    parser.add_argument("--identity", type=Path, default=None,
                        help="this worker's Ed25519 key file, made at first start (default: "
                        "$XDG_STATE_HOME/farlink/rl-worker/NAME.key)")
    parser.add_argument("--pace-seconds", type=float, default=0.0)
    parser.add_argument("--reconnect-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    torch.set_num_threads(1)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    identity = args.identity or default_identity(args.name)
    key = load_or_generate(identity)
    print(f"rl-worker {args.name}: key id {key_id(key.public_key())} ({identity})", flush=True)
    try:
        worker = connect_worker(args.name, host, int(port), key, args.pace_seconds,
                                args.reconnect_s)
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
