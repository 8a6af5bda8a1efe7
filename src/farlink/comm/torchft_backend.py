"""Organizational mode: the collective interface on torchft (Lighthouse quorum + Gloo).

Every worker is a torchft replica group: one rank with its own TCPStore, or the K ranks of a
replica group (:mod:`farlink.parallel.sharding`) sharing the store its rank 0 hosts; rank ``r`` of
a replica group then talks across replica groups only with rank ``r`` of the others, about its own
shard. Each outer round is a torchft *step*: ``begin_round`` asks the Lighthouse for a quorum
(which drops peers whose heartbeat stopped and admits newcomers), reconfigures the Gloo process
group to the quorum, and heals this worker from a live peer's committed state when it is behind;
``commit`` is torchft's ``should_commit``, which is False on every participant as soon as any
collective failed.

Timeouts are derived from what the round must move: the Gloo timeout of the next process group is
``round_timeout + safety * (bytes this worker must move) / (measured bytes per second)``, so a link
that is slow but alive is never cut off, while a stalled peer is dropped after a bounded wait.

With ``admission`` (a run with ``--auth``) the worker reaches the Lighthouse's gate through a local
:class:`~farlink.robust.gate.Tunnel` that proves membership first (a refused peer fails at
construction with :class:`~farlink.robust.gate.GateRefused`), and serves its healing state only
through a gate of its own (:mod:`farlink.comm.torchft_admission`).

Healing is checked, not obeyed: torchft's Lighthouse heals every replica below the highest step any
participant reports from that replica, and a step is self-reported. So the state torchft fetches
is only stashed; once the quorum stands, the participants all-gather what each held before it
(its committed step, the fingerprint of its committed state, its checkpoint address, and the step
and fingerprint of what torchft fetched for it) and each applies the policy of
:mod:`farlink.robust.heal` to the same announcements: it adopts the fetched state only if the
group's round (the step most participants hold) is the step torchft healed it to, the state hashes
to the fingerprint the most participants at that step announced, holds no NaN/Inf, and the jump is
plausible. Otherwise it keeps its own state and step and names the replica(s) that claimed the
step. A replica behind the group's round that torchft did not bring the group's state (it healed
it from a replica claiming a higher step) catches up by a second route that every participant
plans alike (:func:`~farlink.robust.heal.plan_catch_up`): up to three participants at the group's
round with the most-shared fingerprint offer their state on their checkpoint server (the same
transport, gated with ``--auth``), and it fetches and checks one the same way; only if none
passes is it left behind, and it fails the round (torchft fails it for every participant), while
replicas at the group's round go on among themselves (an update sent for another round is
rejected by the exchange).
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
import time
from datetime import timedelta

import msgpack
import torch

from farlink.comm.base import (Collective, LinkModel, RoundInfo, ring_allgather_bytes,
                               ring_allreduce_bytes)
from farlink.comm.errors import CommError
from farlink.robust.auth import Authenticator
from farlink.robust.gate import GateRefused, answers_as_gate
from farlink.robust.heal import (
    CatchUp,
    first_non_finite,
    implausible,
    plan_catch_up,
    plan_heal,
    state_fingerprint,
)

log = logging.getLogger(__name__)

_TIMEOUT_SAFETY = 4.0


def _is_tensor_state(state: object) -> bool:
    return isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())


def _parse_announcement(raw: bytes) -> tuple:
    """(pre-quorum step, fingerprint, replica id, checkpoint address, (step, fingerprint) of the
    state torchft fetched or None, round tag or None) from a participant's announcement; a
    malformed one holds no round (-1) and offers nothing."""
    try:
        a = msgpack.unpackb(raw)
        fetched = a[4]
        if not (isinstance(fetched, list) and len(fetched) == 2 and isinstance(fetched[0], int)
                and isinstance(fetched[1], str)):
            fetched = None
        address = a[3] if isinstance(a[3], str) and a[3].startswith(("http://", "https://")) \
            else None
        tag = str(a[5])[:80] if len(a) > 5 and a[5] is not None else None
        return (int(a[0]), a[1] if isinstance(a[1], str) else None, str(a[2])[:80], address,
                tuple(fetched) if fetched else None, tag)
    except Exception:  # noqa: BLE001 - a malformed announcement holds no round
        return (-1, None, "?", None, None, None)


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
    from farlink.comm.sockets import parse_address

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
        emulated_link: LinkModel | None = None,
    ) -> None:
        super().__init__(emulated_link)
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
        self._quorum_wait, self._joining = quorum_timeout, False  # the current round's
        self.min_replicas = min_replicas
        self.attempt_timeout = quorum_attempt_timeout(join_timeout)
        self.round_timeout = round_timeout
        self._transport = transport  # torchft's checkpoint transport, also for catching up
        self._healed = False
        self._round_tags: list[str | None] | None = None  # the group's, this round
        self._stash: dict | None = None  # a state torchft fetched, until it is checked
        self._fingerprint: tuple[int, str] | None = None  # (step, fingerprint) of our state
        self._last_commit_at: float | None = None  # for plausibility (farlink.robust.heal)
        self._shortest_round: float | None = None
        #: why the last fetched state was refused (None: nothing refused)
        self.last_refusal: str | None = None
        self._get_state = self._set_state = None
        self._bytes_per_second: float | None = None  # measured on earlier rounds
        self._round_bytes = 0
        # every listener on ``host`` only (torchft's defaults bind all interfaces)
        self.group_rank, self.group_world_size = group_rank, group_world_size
        if group_world_size > 1:
            if store_port is None:
                raise ValueError("a replica group of several ranks shares its rank 0's store: "
                                 "give store_addr and store_port (ReplicaGroup.start() provides "
                                 "them)")
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
        """torchft hands over the state it fetched: kept aside until ``_check_heal`` accepts it."""
        if self._set_state is None:
            raise RuntimeError("no state registered with the collective")
        self._stash = state

    # --- rounds --------------------------------------------------------------------------------
    def begin_round(self, final: bool = False, *, joining: bool = False,
                    timeout: float | None = None,
                    tag: str | None = None) -> RoundInfo:  # one quorum: final is moot
        self._joining = joining
        self._quorum_wait = self.quorum_timeout if timeout is None else timeout
        self._adapt_timeout()
        self._healed = False
        self._round_bytes = 0
        self._round_start = time.perf_counter()
        step, batches = self.manager.current_step(), self.manager.batches_committed()
        if self._get_state is not None and (self._fingerprint is None
                                            or self._fingerprint[0] != step):
            self._fingerprint = (step, state_fingerprint(self._get_state()))
        self._stash = None
        self._round_tags = None
        self._start_quorum()
        self._check_heal(step, batches, tag)
        rank = self.manager.participating_rank()
        return RoundInfo(
            round_id=self.manager.current_step(),
            rank=rank if rank is not None else 0,
            world_size=max(1, self.manager.num_participants()),
            healed=self._healed,
            tags=self._round_tags,
        )

    def _check_heal(self, step: int, batches: int, tag: str | None = None) -> None:
        """Adopt what torchft fetched only if the participants' announcements back it (see the
        module docstring); otherwise keep this replica's state and step, and name the source."""
        stash, self._stash = self._stash, None
        target = self.manager.current_step()
        fetched = None
        if stash is not None and _is_tensor_state(stash):
            fetched = [target, state_fingerprint(stash)]
        mine = [step, self._fingerprint[1] if self._fingerprint and not self._joining else None,
                self.replica_id,
                self._transport.metadata(), fetched, tag]
        gathered = self._gather_quiet(msgpack.packb(mine))
        announced = [_parse_announcement(raw) for raw in gathered]
        plan = plan_heal([a[0] for a in announced], [a[1] for a in announced],
                         list(range(len(announced))))
        self._round_tags = [a[5] for a in announced if a[0] == plan.round_id]
        catch_up = None
        if self.manager.errored() is None and len(announced) == self.manager.num_participants():
            catch_up = plan_catch_up([a[0] for a in announced], [a[1] for a in announced],
                                     [a[4] for a in announced])
        me = self.manager.participating_rank()
        if catch_up is not None and me in catch_up.sources:
            self._serve_catch_up(catch_up)
        if stash is None:
            if step > plan.round_id > 0:
                log.warning("this replica's step %d is ahead of the step %d most participants "
                            "hold; they will reject its updates as another round's. Fix: restart "
                            "it from the run's latest checkpoint", step, plan.round_id)
            return
        claimed = [a[2] for a in announced if a[0] == target]
        expected = plan.expected.get(plan.sources[0]) if plan.sources else None
        why = None
        if self.manager.errored() is not None:
            why = "the participants' announcements could not be gathered"
        elif target != plan.round_id:
            why = (f"torchft healed to step {target}, but the step most participants hold is "
                   f"{plan.round_id}")
        else:
            why = self._unfit(stash, target, expected, step)
        if why is None:
            self._adopt(stash, target, batches)
            return
        if catch_up is None or me not in catch_up.receivers:
            catch_up = None
        self._refuse(step, batches, why, announced, target, claimed, catch_up)

    def _unfit(self, state: object, target: int, expected: str | None, step: int) -> str | None:
        """Why a fetched state must not be adopted at step ``target`` (None: it may be): not a
        state of tensors, not the fingerprint its sources announced, NaN/Inf, or an implausible
        jump from this replica's ``step``."""
        if not _is_tensor_state(state):
            return "it is not a state of tensors"
        fingerprint = state_fingerprint(state)
        if expected is not None and fingerprint != expected:
            return (f"its fingerprint {fingerprint} is not the {expected} the participants at "
                    f"step {target} announced")
        if (name := first_non_finite(state)) is not None:
            return f"tensor {name!r} holds NaN or Inf"
        if self._last_commit_at is not None:
            return implausible(target, step, time.monotonic() - self._last_commit_at,
                               self._shortest_round)
        return None

    def _adopt(self, state: dict, step: int, batches: int) -> None:
        self._set_state(state)
        self.manager.load_state_dict({"step": step, "batches_committed": batches})
        self._healed = True
        self._fingerprint = None
        self._last_commit_at = time.monotonic()

    def _serve_catch_up(self, catch_up: CatchUp) -> None:
        """Offer this replica's state (it holds the group's step and fingerprint) to the replicas
        that must catch up, on the checkpoint server torchft heals through (gated with --auth);
        it stops serving at ``commit`` (torchft's ``should_commit`` disallows the checkpoint)."""
        try:
            self._transport.send_checkpoint(catch_up.receivers, catch_up.round_id, self._state(),
                                            timedelta(seconds=self.round_timeout))
        except Exception as exc:  # noqa: BLE001 - the receivers try the other sources
            log.warning("could not offer this replica's state at step %d to the replicas "
                        "catching up (%s); they fetch it from the other sources",
                        catch_up.round_id, exc)

    def _catch_up(self, catch_up: CatchUp, announced: list, step: int,
                  batches: int) -> tuple[str | None, str | None]:
        """Fetch the group's state from the participants holding it, through this replica's own
        checkpoint transport (so through the sources' gates with --auth), and adopt the first copy
        that passes the checks torchft's heal gets. Returns (source adopted, None) or (None, why
        every source failed)."""
        timeout = timedelta(seconds=self.round_timeout)
        failures = []
        for src in catch_up.sources:
            name, address = announced[src][2], announced[src][3]
            if address is None:
                failures.append(f"{name} announced no checkpoint address")
                continue
            try:
                state = self._transport.recv_checkpoint(src, address, catch_up.round_id, timeout)
            except Exception as exc:  # noqa: BLE001 - the next source may serve it
                failures.append(f"{name} did not serve it ({exc})")
                continue
            why = self._unfit(state, catch_up.round_id, catch_up.fingerprint, step)
            if why is None:
                self._adopt(state, catch_up.round_id, batches)
                return name, None
            failures.append(f"{name} served a state that is refused: {why}")
        return None, "; ".join(failures) or "no participant holds it"

    def _refuse(self, step: int, batches: int, why: str, announced: list, target: int,
                claimed: list[str] | None = None, catch_up: CatchUp | None = None) -> None:
        """Keep this replica's state and step, or, with ``catch_up``, take the group's state
        from the participants holding it; fail the round if that leaves this replica off the
        group's round (behind it, or ahead of it)."""
        self.manager.load_state_dict({"step": step, "batches_committed": batches})
        group_round = plan_heal([a[0] for a in announced], [a[1] for a in announced],
                                []).round_id
        claimed = claimed or [a[2] for a in announced if a[0] == target]
        self.last_refusal = (
            f"refused the state torchft fetched from the replica(s) announcing step {target} "
            f"({', '.join(claimed) or 'unknown'}): {why}")
        if catch_up is not None:
            source, failed = self._catch_up(catch_up, announced, step, batches)
            if source is not None:
                log.warning("%s; healed instead from replica %s, which holds the group's step %d "
                            "with the state most participants there announced", self.last_refusal,
                            source, catch_up.round_id)
                return
            self.last_refusal += f"; fetching the group's step {group_round} failed too: {failed}"
        self.last_refusal += f". This replica keeps its state at step {step}"
        if step != group_round:
            self.manager.report_error(CommError(
                f"{self.last_refusal}; it is not at the group's step {group_round}, so the round "
                "fails. Fix: stop the replica that claims a step it does not hold."))
            log.warning("%s; the round fails", self.last_refusal)
        else:
            log.warning("%s and goes on with the replicas at that step", self.last_refusal)

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
                deadline = now + self._quorum_wait if deadline is None else deadline
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
        waited = f"no quorum within {self._quorum_wait:.0f}s of the first failed attempt ({exc})"
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
        self._last_commit_at = time.monotonic() if step > 0 else None

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

    def _gather_quiet(self, payload: bytes) -> list[bytes]:
        """``all_gather_bytes`` outside the round's byte and collective counts (the healing
        check's announcements are a few dozen bytes of control traffic)."""
        bytes_sent, collectives = self.stats.bytes_sent, self.stats.collectives
        round_bytes, seconds = self._round_bytes, self.stats.comm_seconds
        try:
            return self.all_gather_bytes(payload)
        finally:
            self.stats.bytes_sent, self.stats.collectives = bytes_sent, collectives
            self._round_bytes, self.stats.comm_seconds = round_bytes, seconds

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

    native_all_to_all = True

    def round_members(self) -> int:
        return max(1, self.manager.num_participants())

    def round_rank(self) -> int:
        rank = self.manager.participating_rank()
        return rank if rank is not None else 0

    def all_to_all_bytes(self, outgoing: list[bytes]) -> list[bytes]:
        """Gloo's ``alltoall`` (pairwise sends): first each message's length (8 bytes to each
        member), then the messages; a transport failure fails the round (torchft's
        ``should_commit``) and returns ``b""`` for every other member."""
        from torch.distributed.distributed_c10d import AllToAllOptions

        n, me = self.round_members(), self.round_rank()
        if len(outgoing) != n:
            raise ValueError(f"all-to-all of {len(outgoing)} messages in a round of {n}")
        nothing = [outgoing[k] if k == me else b"" for k in range(n)]
        if n == 1:
            return list(outgoing)
        if self.manager.errored():
            return nothing
        start = time.perf_counter()

        def exchange(output: torch.Tensor, data: torch.Tensor, out_splits: list[int],
                     in_splits: list[int]) -> None:
            work = self.pg.alltoall_base(output, data, out_splits, in_splits, AllToAllOptions())
            self.manager.wrap_future(work.get_future(), [output]).wait()

        sent = 8 * (n - 1) + sum(len(outgoing[j]) for j in range(n) if j != me)
        try:
            lengths = torch.tensor([len(m) for m in outgoing], dtype=torch.int64)
            theirs = torch.zeros(n, dtype=torch.int64)
            exchange(theirs, lengths, [1] * n, [1] * n)
            if self.manager.errored():
                return nothing
            sizes = [int(v) for v in theirs]
            joined = b"".join(outgoing)
            data = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined \
                else torch.zeros(0, dtype=torch.uint8)
            output = torch.zeros(sum(sizes), dtype=torch.uint8)
            exchange(output, data, sizes, [len(m) for m in outgoing])
        except Exception as exc:  # noqa: BLE001 - any transport failure fails the round
            log.warning("all-to-all failed: %s", exc)
            self.manager.report_error(exc)
        finally:
            self.emulate_transfer(sent, 1)
            self.stats.bytes_sent += sent
            self._round_bytes += sent
            self.stats.collectives += 1
            self.stats.comm_seconds += time.perf_counter() - start
        if self.manager.errored():
            return nothing
        raw, out, offset = output.numpy().tobytes(), [], 0
        for size in sizes:
            out.append(raw[offset:offset + size])
            offset += size
        return out

    def fail_round(self, error: Exception, blame=()) -> None:  # noqa: ANN001 - ranks
        """torchft's own way: a reported error makes ``should_commit`` False on every replica."""
        log.warning("%s", error)
        self.manager.report_error(error)

    def commit(self) -> bool:
        ok = self.manager.should_commit()
        if ok:
            now = time.monotonic()
            if self._last_commit_at is not None and now > self._last_commit_at:
                gap = now - self._last_commit_at
                self._shortest_round = min(self._shortest_round or gap, gap)
            self._last_commit_at = now
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
