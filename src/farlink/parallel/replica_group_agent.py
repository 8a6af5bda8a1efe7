"""torchrun for one replica group on this machine, with its store listening on the run's ``--host``
only.

``torchrun --standalone`` starts an elastic agent that hosts two TCPStores for the replica group's
ranks (the c10d rendezvous store and the store it shares with them), both on every interface: a
replica group of a run on loopback would be reachable from the whole network, and a TCPStore takes
reads and writes from anyone who connects. torch's TCPStore binds one address only when it is
handed a listening socket (``master_listen_fd``), and the agent builds its store itself; but a
store made with ``multi_tenant=True`` reuses the server this process already runs on the same port.
So this module opens that server first, on ``--host``, then runs torchrun's own ``main`` with a
static rendezvous at that address and port: the agent's store is the one opened here, the ranks
meet in it (``TORCHELASTIC_USE_AGENT_STORE``), and the agent opens no other listener.
``tests/test_listeners.py`` checks that on a real run; ``docs/trust.md`` lists the sockets.

    python -m farlink.parallel.replica_group_agent --host 127.0.0.1 --nproc-per-node 2 \\
        -m farlink.worker RUN_DIR 0 --lighthouse http://127.0.0.1:29510

It is what ``farlink train --ranks-per-worker K`` runs for each worker; on a node of a run across
machines, ``--host`` is the node's address (the one in the run's config).
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from torch.distributed import TCPStore

from farlink.comm.torchft_listeners import store_listener


def replica_group_store(host: str) -> TCPStore:
    """The replica group's store server on ``host`` (a free port), shareable with torchrun's agent
    in this process. Keep the returned store alive: the server lives as long as it."""
    return TCPStore(host, 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                    timeout=timedelta(minutes=10), master_listen_fd=store_listener(host))


def torchrun_argv(host: str, port: int, ranks: int, max_restarts: int,
                  command: list[str]) -> list[str]:
    """torchrun's arguments for a one-node replica group meeting in the store at ``host:port``."""
    return ["--nnodes=1", "--node-rank=0", "--rdzv-backend=static", f"--master-addr={host}",
            f"--master-port={port}", f"--nproc-per-node={ranks}",
            f"--max-restarts={max_restarts}", *command]


def run_as_replica_group(host: str, ranks: int, command: list[str], max_restarts: int = 0) -> int:
    """Run ``python COMMAND`` as a replica group of ``ranks`` ranks on this machine (through this
    module, so its store listens on ``host`` only) and wait for it; its exit code. The ranks watch
    this process (:mod:`farlink.lifeline`): if it dies, they stop at their next step boundary. A
    Ctrl-C reaches the ranks and torchrun too (one process group): the ranks stop at their next
    step with their state written, so this waits for them rather than killing torchrun (what
    ``subprocess.run`` does 0.25 s after a KeyboardInterrupt); a second Ctrl-C leaves at once."""
    import os
    import subprocess
    import sys

    from farlink import lifeline

    argv = [sys.executable, "-m", "farlink.parallel.replica_group_agent", "--host", host,
            f"--nproc-per-node={ranks}", f"--max-restarts={max_restarts}", *command]
    replica_group = subprocess.Popen(argv, env={**os.environ, **lifeline.child_env()})
    try:
        return replica_group.wait()
    except KeyboardInterrupt:
        print("stopping the replica group's ranks at their next step (Ctrl-C again to leave now)",
              file=sys.stderr, flush=True)
        return replica_group.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m farlink.parallel.replica_group_agent",
        description="torchrun for one replica group, its store bound to --host instead of every "
                    "interface. Then the program, as for torchrun: -m MODULE ARGS or SCRIPT ARGS.")
    parser.add_argument("--host", required=True,
                        help="the address the replica group's store listens on (the run's --host)")
    parser.add_argument("--nproc-per-node", type=int, required=True,
                        help="ranks of the replica group")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="times torchrun restarts the replica group's ranks after one fails")
    parser.add_argument("-m", "--module", action="store_true",
                        help="the program is a module, run as python -m (torchrun's -m)")
    parser.add_argument("program", help="the script (or with -m, the module) every rank runs")
    parser.add_argument("program_args", nargs=argparse.REMAINDER, help="the program's arguments")
    args = parser.parse_args(argv)
    command = [*(["-m"] if args.module else []), args.program, *args.program_args]
    # held until torchrun returns: the agent's store is its server
    store = replica_group_store(args.host)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(torchrun_argv(args.host, store.port, args.nproc_per_node, args.max_restarts,
                               command))
    except SignalException as stopped:
        # the agent passed the signal on to the ranks and waited for them: a stop, not a crash
        raise SystemExit(128 + int(stopped.sigval)) from None


if __name__ == "__main__":
    main()
