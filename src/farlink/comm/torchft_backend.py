"""Organizational mode: the collective interface on torchft (Lighthouse quorum + Gloo).

Every worker is a torchft replica group: one rank with its own TCPStore, or the K ranks of a site
(:mod:`farlink.parallel.sharding`) sharing the store its rank 0 hosts; rank ``r`` of a site then
talks across sites only with rank ``r`` of the others, about its own shard. Each outer round is a
torchft *step*: ``begin_round`` asks the Lighthouse for a quorum (which drops peers whose heartbeat
stopped and admits newcomers), reconfigures the Gloo process group to the quorum, and heals this
worker from a live peer's committed state when it is behind; ``commit`` is torchft's
``should_commit``, which is False on every participant as soon as any collective failed.

Timeouts are derived from what the round must move: the Gloo timeout of the next process group is
``round_timeout + safety * (bytes this worker must move) / (measured bytes per second)``, so a link
that is slow but alive is never cut off, while a stalled peer is dropped after a bounded wait.

With ``admission`` (a run with ``--auth``) the worker reaches the Lighthouse's gate through a local
:class:`~farlink.robust.gate.Tunnel` that proves membership first (a refused peer fails at
construction with :class:`~farlink.robust.gate.GateRefused`), and serves its healing state only
through a gate of its own (:mod:`farlink.comm.torchft_admission`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
import time
from datetime import timedelta

import torch

from farlink.comm.base import Collective, RoundInfo, ring_allgather_bytes, ring_allreduce_bytes
from farlink.robust.auth import Authenticator
from farlink.robust.gate import GateRefused, answers_as_gate

log = logging.getLogger(__name__)

_TIMEOUT_SAFETY = 4.0


class QuorumUnavailable(RuntimeError):
    """The Lighthouse gave no quorum in time (down, unreachable, or too few peers)."""


class DaemonExecutor:
    """Stands in for the torchft Manager's one-thread executor, which runs each quorum attempt:
    the same ``submit``, but on a daemon thread. A ``concurrent.futures`` thread is joined at
    interpreter exit, so a worker leaving on Ctrl-C / SIGTERM while an attempt is blocked in
    torchft (on a Lighthouse that is gone: up to ``attempt_timeout``, which ``shutdown`` does not
    cut short) would stay up until the attempt timed out. The abandoned attempt only talks to
    the Lighthouse and fills memory; checkpoints are written from snapshots taken on the
    training thread and landed before the collective closes."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)

        self._thread = threading.Thread(target=run, daemon=True, name="torchft-quorum")
        self._thread.start()
        return future

    def shutdown(self, wait: bool = True, **_: object) -> None:
        if wait and self._thread is not None:
            self._thread.join()


def quorum_attempt_timeout(join_timeout: float) -> float:
    """How long one quorum request may wait before it is retried.

    With enough live peers the Lighthouse answers within ``join_timeout`` (it waits that long
    for stragglers), so a request that outlives it by a margin (RPC latency, quorum ticks) is
    stuck, e.g. on a Lighthouse that restarted. It does not depend on ``quorum_timeout``: the
    retries that follow are what the quorum timeout bounds (see ``_start_quorum``).
    """
    return join_timeout + 10.0


def lighthouse_reachable(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at the Lighthouse's (or its gate's) address."""
    from farlink.robust.gate import parse_address

    try:
        with socket.create_connection(parse_address(address), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


class TorchftCollective(Collective):
    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        host: str = "127.0.0.1",
        min_replicas: int = 1,
        round_timeout: float = 30.0,
        quorum_timeout: float = 120.0,
        connect_timeout: float = 30.0,
        join_timeout: float = 30.0,
        admission: Authenticator | None = None,
        group_rank: int = 0,
        group_world_size: int = 1,
        store_addr: str | None = None,
        store_port: int | None = None,
    ) -> None:
        super().__init__()
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        self.replica_id = replica_id
        self.lighthouse_addr = lighthouse_addr
        self._tunnel = transport = None
        if admission is None and answers_as_gate(lighthouse_addr):
            raise GateRefused(
                f"the Lighthouse at {lighthouse_addr} admits members only (the run uses --auth) "
                "and this peer has no --auth. Fix: start it with the run's --auth and its secret "
                "(--secret or FARLINK_SECRET), or an ed25519 --key-file listed in --allowed-keys."
            )
        from farlink.comm import torchft_listeners as listeners

        if admission is not None:
            from farlink.comm.torchft_admission import GatedHTTPTransport
            from farlink.robust.gate import open_tunnel

            self._tunnel = open_tunnel(lighthouse_addr, admission, name="Lighthouse",
                                       timeout=min(connect_timeout, 30.0))
            lighthouse_addr = self._tunnel.url
            try:
                transport = GatedHTTPTransport(admission, host, timedelta(seconds=round_timeout))
            except BaseException:
                self._tunnel.close()
                raise
        else:
            transport = listeners.HostHTTPTransport(host, timedelta(seconds=round_timeout))
        self.quorum_timeout = quorum_timeout
        self.min_replicas = min_replicas
        self.attempt_timeout = quorum_attempt_timeout(join_timeout)
        self.round_timeout = round_timeout
        self._healed = False
        self._get_state = self._set_state = None
        self._bytes_per_second: float | None = None  # measured on earlier rounds
        self._round_bytes = 0
        # every listener on ``host`` only (torchft's defaults bind all interfaces)
        self.group_rank, self.group_world_size = group_rank, group_world_size
        if group_world_size > 1:
            if store_port is None:
                raise ValueError("a replica group of several ranks shares its rank 0's store: "
                                 "give store_addr and store_port (Site.start() provides them)")
            self._store = None
        else:
            listen_fd = listeners.store_listener(host)
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   master_listen_fd=listen_fd)
            store_addr, store_port = host, self._store.port
        listeners.bind_gloo_to(host)
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=round_timeout))
        with listeners.manager_bound_to(host):
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=self._load_state,
                state_dict=self._state,
                min_replica_size=min_replicas,
                use_async_quorum=False,
                replica_id=replica_id,
                store_addr=store_addr,
                store_port=store_port,
                rank=group_rank,
                world_size=group_world_size,
                lighthouse_addr=lighthouse_addr,
                hostname=host,
                timeout=timedelta(seconds=round_timeout),
                quorum_timeout=timedelta(seconds=quorum_timeout),
                connect_timeout=timedelta(seconds=connect_timeout),
                init_sync=False,
                checkpoint_transport=transport,
            )

    # --- state transfer (called from torchft's quorum thread / eager heal) ---------------------
    def _state(self) -> dict:
        if self._get_state is None:
            raise RuntimeError("no state registered with the collective")
        return self._get_state()

    def _load_state(self, state: dict) -> None:
        if self._set_state is None:
            raise RuntimeError("no state registered with the collective")
        self._set_state(state)
        self._healed = True

    # --- rounds --------------------------------------------------------------------------------
    def begin_round(self) -> RoundInfo:
        self._adapt_timeout()
        self._healed = False
        self._round_bytes = 0
        self._round_start = time.perf_counter()
        self._start_quorum()
        rank = self.manager.participating_rank()
        return RoundInfo(
            round_id=self.manager.current_step(),
            rank=rank if rank is not None else 0,
            world_size=max(1, self.manager.num_participants()),
            healed=self._healed,
        )

    def _start_quorum(self) -> None:
        """Ask for a quorum; ride out a Lighthouse restart by retrying.

        The wait is counted from the first failed attempt, not from the round's start: an attempt
        in flight when the Lighthouse dies can hang for a whole ``attempt_timeout``, and the
        outage only begins to show then. So a Lighthouse back within ``quorum_timeout`` of that
        failure (hence of its death) is always reached: attempts go on until the deadline, the
        last one starts at it, and if the Lighthouse answers by then one more whole attempt is
        made (an attempt sent while it was down may hang on past the deadline). torchft keeps the failed quorum future and re-raises it on every
        later call, so it is dropped before retrying; the Manager's own client reconnects.
        """
        from farlink import interrupt

        if not isinstance(self.manager._executor, DaemonExecutor):  # before its first attempt
            self.manager._executor = DaemonExecutor()
        deadline = None
        delay = 0.5
        last_chance = False
        waiting_for = lambda: (  # noqa: E731 - what the log lines and the interruption name
            f"a quorum of >= {self.min_replicas} replicas from the Lighthouse at "
            f"{self.lighthouse_addr}")
        while True:
            # torchft blocks in ``start_quorum`` until the attempt ends (up to attempt_timeout)
            # and a stop request only sets a flag, so the attempt runs in a daemon thread and
            # this one waits in slices, leaving on Ctrl-C / SIGTERM and saying what it waits for
            attempt: concurrent.futures.Future = concurrent.futures.Future()
            device = (torch.accelerator.current_device_index()
                      if torch.accelerator.is_available() else -1)

            def run(attempt=attempt) -> None:
                try:
                    if device >= 0:  # torchft takes its device from the calling thread
                        torch.accelerator.set_device_index(device)
                    self.manager.start_quorum(
                        allow_heal=True, timeout=timedelta(seconds=self.attempt_timeout)
                    )
                    attempt.set_result(None)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                    attempt.set_exception(exc)

            threading.Thread(target=run, daemon=True, name="farlink-quorum").start()
            try:
                interrupt.wait_future(attempt, float("inf"), waiting_for, log,
                                      every=interrupt.WAIT_LOG_EVERY)
                return
            except KeyboardInterrupt:
                log.warning("interrupted while waiting for %s; leaving", waiting_for())
                raise
            except Exception as exc:
                self.manager._quorum_future = None
                if self._tunnel is not None and isinstance(self._tunnel.failure, GateRefused):
                    raise QuorumUnavailable(str(self._tunnel.failure)) from exc
                now = time.monotonic()
                deadline = now + self.quorum_timeout if deadline is None else deadline
                if now >= deadline:
                    # an attempt started while it was down can hang past the deadline; a
                    # Lighthouse that is back by then gets one whole attempt of its own
                    if last_chance or not lighthouse_reachable(self.lighthouse_addr):
                        raise QuorumUnavailable(self._no_quorum_message(exc)) from exc
                    last_chance = True
                    continue
                log.warning("quorum failed (%s); retrying in %.1fs, waiting for %s", exc, delay,
                            waiting_for())
                if interrupt.STOP.wait(min(delay, deadline - now)):
                    log.warning("interrupted while waiting for %s; leaving", waiting_for())
                    raise KeyboardInterrupt(f"interrupted while waiting for {waiting_for()}")
                delay = min(delay * 2, 5.0)

    def _no_quorum_message(self, exc: Exception) -> str:
        """Why the wait ended, told from whether the Lighthouse answers now."""
        waited = f"no quorum within {self.quorum_timeout:.0f}s of the first failed attempt ({exc})"
        if lighthouse_reachable(self.lighthouse_addr):
            return (f"{waited}. The Lighthouse at {self.lighthouse_addr} is up, but fewer than "
                    f"min_replicas={self.min_replicas} peers asked for this round in time. Fix: "
                    "check that the other workers are running (their logs), or lower "
                    "--min-replicas, or raise --quorum-timeout.")
        return (f"{waited}. The Lighthouse at {self.lighthouse_addr} does not answer. Fix: "
                "restart it on the same address within --quorum-timeout (workers reconnect "
                "then), or raise --quorum-timeout to ride out longer outages.")

    def load_committed_step(self, step: int) -> None:
        """Restore torchft's step counter on resume so peers do not heal from each other."""
        self.manager.load_state_dict({"step": step, "batches_committed": step})

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        from torch.distributed import ReduceOp

        n = self.manager.num_participants()
        start = time.perf_counter()
        for tensor in tensors:
            self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
            sent = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), n)
            self.emulate_transfer(sent, 2 * (n - 1))
            self.stats.bytes_sent += sent
            self._round_bytes += sent
            self.stats.collectives += 1
        self.stats.comm_seconds += time.perf_counter() - start

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        from torch.distributed.distributed_c10d import AllgatherOptions

        n = self.manager.num_participants()
        if self.manager.errored():
            return [tensor.clone() for _ in range(n)]
        outputs = [torch.empty_like(tensor) for _ in range(n)]
        try:
            work = self.pg.allgather([outputs], [tensor], AllgatherOptions())
            fut = self.manager.wrap_future(work.get_future(), [outputs])
            fut.wait()
        except Exception as exc:  # noqa: BLE001 - any transport failure fails the round
            log.warning("all-gather failed: %s", exc)
            self.manager.report_error(exc)
        sent = ring_allgather_bytes(tensor.numel() * tensor.element_size(), n)
        self.emulate_transfer(sent, n - 1)
        self.stats.bytes_sent += sent
        self._round_bytes += sent
        self.stats.collectives += 1
        return outputs

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        start = time.perf_counter()
        lengths = self._all_gather(torch.tensor([len(payload)], dtype=torch.int64))
        if self.manager.errored():
            self.stats.comm_seconds += time.perf_counter() - start
            return [payload]
        sizes = [int(t.item()) for t in lengths]
        buffer = torch.zeros(max(sizes), dtype=torch.uint8)
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = self._all_gather(buffer)
        self.stats.comm_seconds += time.perf_counter() - start
        if self.manager.errored():
            return [payload]
        return [bytes(t[:size].numpy().tobytes()) for t, size in zip(gathered, sizes)]

    def commit(self) -> bool:
        ok = self.manager.should_commit()
        elapsed = time.perf_counter() - self._round_start
        if ok and self._round_bytes > 0 and elapsed > 0:
            rate = self._round_bytes / elapsed
            prev = self._bytes_per_second
            self._bytes_per_second = rate if prev is None else 0.5 * prev + 0.5 * rate
        return ok

    def _adapt_timeout(self) -> None:
        """Size the next process group's timeout to the bytes the last round moved."""
        if self._bytes_per_second is None or self._round_bytes == 0:
            return
        expected = self._round_bytes / self._bytes_per_second
        seconds = self.round_timeout + _TIMEOUT_SAFETY * expected
        self.pg._timeout = timedelta(seconds=seconds)
        self.timeout_seconds = seconds

    def close(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.debug("manager shutdown: %s", exc)
        if self._tunnel is not None:
            self._tunnel.close()
