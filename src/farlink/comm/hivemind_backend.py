"""Community-mode collective on hivemind: DHT discovery, Moshpit matchmaking, butterfly all-reduce.

One :class:`HivemindCollective` per worker. Its asyncio event loop runs in a background thread and
shares the p2p daemon of a ``hivemind.DHT`` (which runs in its own process). Per outer round:

* ``begin_round`` runs hivemind's :class:`~hivemind.averaging.matchmaking.Matchmaking` under the
  run's group key: peers that are looking at the same time form a group (of up to
  ``target_group_size``, Moshpit-style; all peers when None), the leader fixes the rank order and
  every member receives every member's metadata (committed round, client mode, bandwidth). The
  round id is the largest committed round in the group; a member that is behind (a newcomer, or one
  whose last commit failed) downloads the state of an up-to-date member, checks its SHA-256 and
  adopts it through ``set_state`` before the round goes on (``RoundInfo.healed``).
* Groups smaller than the swarm (``target_group_size`` below the number of peers, Moshpit)
  leave a peer out whenever the live peers do not divide into them. With ``skip_after`` set,
  such a peer stops looking that long after its boundary and skips the round
  (:meth:`HivemindCollective.alone`: ``RoundInfo.skipped``; it exchanges and commits nothing,
  so its next group heals it and no round number ever holds two states). The run's last round
  (``begin_round(final=True)``, asked by the sync layer) is never skipped: it matchmakes under a group key of
  its own with a target of ``final_group_size``, the whole swarm, so every live peer ends on
  one model; a dead peer is waited for until ``round_timeout``, then the group starts with those
  that came.
* ``expect_round`` (the sync layer's hint that the next round is due in T seconds) starts that
  matchmaking ``matchmaking_time`` before the round is due, in the background, so the group forms
  while its members still train and ``begin_round`` at the boundary only collects it. A leader
  accepts client-mode members whatever schedule they announce
  (:mod:`farlink.comm.hivemind_matchmaking`): a client that expects the round sooner than the
  leader would otherwise be turned away until the leader's window ran out.
* ``all_reduce_sum`` runs hivemind's butterfly :class:`AllReduceRunner` with shards proportional to
  the announced bandwidths (client-mode peers reduce nothing) and turns its average into a sum.
* ``all_gather_bytes`` pushes the payload (signed by the exchange above, which verifies what
  arrives) to every member that accepts connections; client-mode members fetch the full list
  from one of them, which streams each payload on as soon as it has it, not after the last one.
  A payload of a few MB travels as up to ``STREAM_PARTS`` slices on parallel streams (a new
  stream's flow-control window opens a round trip at a time; on a home link's 100-300 ms that
  holds one stream far below the link's rate for its first megabytes).
* ``commit`` is an all-gather of one-byte votes. A member that failed anything (timeout, dead
  peer, bad state hash) votes no, and a member that is gone does not vote, so **a peer failing
  mid-round makes the round's ``commit()`` return False for the survivors**; their next
  ``begin_round`` forms a group without it. Commits are not atomic across peers (a vote can be lost
  after others counted it): a peer that did not commit a round its groupmates committed is behind
  in the next round and heals, so no divergence survives a round.

Byte accounting (``stats.bytes_sent``, per worker, payload bytes without protobuf/libp2p framing):

* all-reduce of N float32 elements in a group of S senders where this worker reduces ``e_me``
  elements: ``4 * ((N - e_me) + (S - 1) * e_me)`` (= ``2 (S-1)/S * 4N`` for equal shards), counted
  from the messages the runner writes (:mod:`farlink.comm.hivemind_allreduce`);
* all-gather of a payload of P bytes (after signing) with K members that accept connections:
  ``P * (K - [this worker accepts connections])``, plus, for a member serving client-mode peers,
  the payloads it sends them (everything except the client's own).
Votes go to ``control_bytes_sent`` and state transfers to ``state_bytes_sent``.

Membership (``admission``, a run with ``--auth``): the DHT signs and checks every RPC through
hivemind's authorizer hook, and every averaging RPC and farlink stream is refused to a peer that
has not proven membership; see :mod:`farlink.comm.hivemind_admission`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# hivemind's ServicerBase recognises streaming RPCs only by typing.AsyncIterator (its ``_name``),
# not collections.abc.AsyncIterator: keep this import from typing.
from typing import AsyncIterator  # noqa: UP035

import msgpack
import torch

from farlink.extras import require

require("hivemind", "community mode (--backend hivemind)")  # before hivemind's own imports
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import achain, anext, as_aiter, azip, cancel_and_wait

from farlink import interrupt
from farlink.comm.base import Collective, LinkModel, RoundInfo
from farlink.comm.errors import CommError, RoundTimeout
from farlink.comm.hivemind_admission import Admission, AdmittingMatchmaking, RunAuthorizer
from farlink.comm.hivemind_allreduce import (
    CountingAllReduceRunner,
    part_size_bytes,
    shard_fractions,
)
from farlink.comm.hivemind_net import dht_options, start_dht, tcp_maddr
from farlink.comm.swarm_shards import group_bounds
from farlink.comm.hivemind_wire import (
    STATE_CHUNK_BYTES,
    chunk_digests,
    chunk_ok,
    pack_state,
    recv_message,
    send_message,
    unpack_state,
)
from farlink.robust.auth import Authenticator
from farlink.robust.heal import (
    first_non_finite,
    implausible,
    parse_announcement,
    plan_heal,
    state_fingerprint,
)
from farlink.robust.strikes import Strikes

log = logging.getLogger(__name__)

VOTE_YES, VOTE_NO = b"\x01", b"\x00"


def group_prefix(run_id: str) -> str:
    """hivemind group keys are ``prefix.0bBITS``: the prefix may not contain dots."""
    if not run_id:
        raise ValueError("run_id must be a non-empty string")
    return "farlink_" + re.sub(r"[^A-Za-z0-9_-]", "_", run_id)


class _Servicer(ServicerBase):
    """The protobuf RPCs hivemind's matchmaking and all-reduce call on a groupmate."""

    def __init__(self, owner: HivemindCollective) -> None:
        self.owner = owner

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not self.owner._admitted(context.remote_id, "join request"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in self.owner._matchmaking.rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not self.owner._admitted(context.remote_id, "all-reduce part"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        request = await anext(stream)
        runner = await self.owner._wait_runner(request.group_id)
        if runner is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in runner.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message


@dataclass
class _Group:
    """This round's group as every member sees it."""

    group_id: bytes
    peers: list[PeerID]
    client: list[bool]
    bandwidth: list[float]
    committed: list[int]
    me: int
    round_id: int
    #: the fingerprint of its committed state each member announced (None: unknown)
    fingerprints: list[str | None] = field(default_factory=list)
    seq: int = 0
    ok: bool = True
    dead: set[int] = field(default_factory=set)
    skipped: bool = False  # no group took this peer in time: a group of itself (see alone())
    #: per member that is a replica group of several ranks: ``[peer id bytes, [multiaddrs]]`` of
    #: each of its ranks' own peers, in rank order (empty for a one-process member)
    endpoints: list[list] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.peers)

    def servers(self) -> list[int]:
        return [r for r in range(self.size) if not self.client[r]]

    def next_key(self, kind: bytes) -> bytes:
        self.seq += 1
        return self.group_id + b"/" + kind + str(self.seq).encode()

    def of_replica_group_rank(self, rank: int) -> _Group:
        """The group as rank ``rank`` of every member replica group sees it: the same members,
        order, rounds and announcements, but each member's rank-``rank`` peer, under a group id of
        its own (so the ranks' exchanges never mix). Every member must be a replica group of the
        same number of ranks, or rank r of one would have no counterpart in another."""
        sizes = [len(e) for e in self.endpoints]
        if len(set(sizes)) != 1 or not 0 <= rank < sizes[0]:
            raise CommError(
                f"the averaging group mixes replica groups of {sorted(set(sizes))} ranks; rank "
                f"{rank} of a replica group exchanges its shard with the same rank of every other "
                "replica group. Fix: start every worker of the run with the same "
                "--ranks-per-worker.")
        return _Group(  # the group id's suffix is wire data, named before "replica group"
            group_id=self.group_id + b"/site-rank" + str(rank).encode(),
            peers=[PeerID(e[rank][0]) for e in self.endpoints],
            client=list(self.client),
            bandwidth=list(self.bandwidth),
            committed=list(self.committed),
            me=self.me,
            round_id=self.round_id,
            # members announce their rank 0's fingerprint: rank r of a replica group checks its
            # shard's state for finiteness only
            fingerprints=list(self.fingerprints) if rank == 0 else [None] * self.size,
            ok=self.ok,
        )

    def replica_group_rank_addresses(self, rank: int) -> list[list[str]]:
        """The multiaddresses of each member's rank-``rank`` peer, in member order."""
        return [list(e[rank][1]) for e in self.endpoints]


#: a push that fails (a stream reset on a loaded machine, a groupmate that has not yet taken
#: this peer's membership proof) is tried again after PUSH_PAUSE x its attempt number before the
#: groupmate counts as dead for the round: one passing failure must not cost a whole round
PUSH_TRIES, PUSH_PAUSE = 3, 0.5
#: a round's data goes over this many libp2p streams per payload, each carrying a slice: a new
#: yamux stream starts with a 256 KiB receive window that grows a round trip at a time, so one
#: stream of a few MB over a 100-300 ms path spends its first round trips far below the link's
#: rate; parallel streams start with that many windows. Slices are at least STREAM_PART_MIN.
STREAM_PARTS, STREAM_PART_MIN = 4, 256 * 1024


def stream_parts(size: int, kind: str) -> int:
    """How many streams carry a payload of ``size`` bytes: round data of a few MB goes over
    several, votes and anything under 2 x STREAM_PART_MIN over one."""
    return max(1, min(STREAM_PARTS, size // STREAM_PART_MIN)) if kind == "data" else 1


def slice_in(header: dict) -> tuple[int, int]:
    """``(part, parts)`` of a put or fetch; a peer asking for more streams than any sender
    uses, or a slice outside them, is refused (it would only pile up memory here)."""
    part, parts = int(header.get("part", 0)), int(header.get("parts", 1))
    if not (1 <= parts <= STREAM_PARTS and 0 <= part < parts):
        raise ValueError(f"slice {part} of {parts}: at most {STREAM_PARTS} slices")
    return part, parts


def slice_of(data: bytes, part: int, parts: int) -> bytes:
    """Slice ``part`` of ``data`` cut into ``parts`` contiguous slices (some may be empty)."""
    return data[len(data) * part // parts: len(data) * (part + 1) // parts]


#: payloads one sender may leave for one collective before this peer knows its group (one per
#: slot it claims; an honest member sends one): a bound on what a stranger's pushes can hold
EARLY_CLAIMS = 8


class _Mailbox:
    """Payloads received for a collective, keyed by (collective key, sender rank)."""

    def __init__(self) -> None:
        self.slots: dict[bytes, dict[int, bytes]] = {}
        #: payloads that arrived before this peer entered their group, by key, sender and the
        #: rank it claimed (its real rank is known once the group is): key -> (sender, claimed
        #: rank) -> payload. One per claimed slot, not one per sender: a sender's payloads for
        #: others' slots (refused when filed) must not take the place of its own
        self.early: dict[bytes, dict[tuple[PeerID, int | None], bytes]] = {}
        self.changed = asyncio.Event()

    def put(self, key: bytes, rank: int, data: bytes) -> None:
        self.slots.setdefault(key, {})[rank] = data
        self.changed.set()

    async def wait(
        self, key: bytes, ranks: set[int], deadline: float, dead: set[int] | None = None
    ) -> dict[int, bytes]:
        """Wait until every rank in ``ranks`` delivered (or is known dead), or the deadline."""
        return {rank: data async for rank, data in self.arrivals(key, ranks, deadline, dead)}

    async def arrivals(
        self, key: bytes, ranks: set[int], deadline: float, dead: set[int] | None = None
    ) -> AsyncIterator[tuple[int, bytes]]:
        """``(rank, payload)`` for each rank in ``ranks`` as soon as it is here, until every
        rank delivered (or is known dead) or the deadline: a server streams each payload on to
        a client-mode member while the others still arrive, instead of after the last one."""
        given: set[int] = set()
        while True:
            got = self.slots.get(key, {})
            for rank in sorted(ranks - given):
                if rank in got:
                    given.add(rank)
                    yield rank, got[rank]
            missing = ranks - given - (dead or set())
            remaining = deadline - time.monotonic()
            if not missing or remaining <= 0:
                return
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(remaining, 0.5))
            except TimeoutError:
                pass

    def clear(self) -> None:
        self.slots.clear()
        self.early.clear()


class HivemindCollective(Collective):
    """A worker of a community run; see the module docstring for the protocol and byte formula."""

    exact_all_reduce = False  # the butterfly hands each peer its average as a delta

    def __init__(
        self,
        run_id: str,
        initial_peers: Sequence[str] = (),
        *,
        host_maddrs: Sequence[str] = (tcp_maddr("127.0.0.1", 0),),
        announce_maddrs: Sequence[str] | None = None,
        client_mode: bool = False,
        target_group_size: int | None = None,
        min_group_size: int = 2,
        matchmaking_time: float = 3.0,
        request_timeout: float = 2.0,
        round_timeout: float = 60.0,
        allreduce_timeout: float = 30.0,
        gather_timeout: float = 30.0,
        commit_timeout: float = 15.0,
        state_timeout: float = 60.0,
        state_chunk_bytes: int = STATE_CHUNK_BYTES,
        bandwidth: float = 1.0,
        skip_after: float | None = None,
        final_group_size: int | None = None,
        admission: Authenticator | None = None,
        identity_path: str | None = None,
        public: bool = False,
        startup_timeout: float = 30.0,
        exclude_after: int = 3,
        exclude_seconds: float = 600.0,
        emulated_link: LinkModel | None = None,
    ) -> None:
        super().__init__(emulated_link)
        if min_group_size < 1:
            raise ValueError("min_group_size must be >= 1")
        if target_group_size is not None and target_group_size < min_group_size:
            raise ValueError("target_group_size must be >= min_group_size")
        if bandwidth <= 0:
            raise ValueError("bandwidth must be positive (client_mode peers reduce nothing anyway)")
        self.run_id, self.prefix = run_id, group_prefix(run_id)
        self.client_mode, self.bandwidth = client_mode, float(bandwidth)
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self.matchmaking_time, self.request_timeout = matchmaking_time, request_timeout
        self.round_timeout, self.allreduce_timeout = round_timeout, allreduce_timeout
        self._round_wait, self._joining = round_timeout, False  # the current round's
        self.gather_timeout, self.commit_timeout = gather_timeout, commit_timeout
        self.state_timeout = state_timeout
        if skip_after is not None and skip_after <= 0:
            raise ValueError("skip_after must be positive (or None: wait round_timeout)")
        self.skip_after, self.final_group_size = skip_after, final_group_size
        #: how many peers the swarm has now, when the run's size is only its room (a volunteer
        #: swarm: ``--workers`` shards, fewer live volunteers). A group is full, and starts at
        #: once, at that many members instead of waiting out the matchmaking window (or, in the
        #: last round, the deadline) for peers that do not exist. Called on the event loop:
        #: it must not block (a volunteer's shard claim keeps the count up to date).
        self.swarm_size: Callable[[], int] | None = None
        #: the last search ran out of its window without a group (see ``skip_after``)
        self.skipped_rounds = 0
        if state_chunk_bytes < 1:
            raise ValueError("state_chunk_bytes must be >= 1")
        self.state_chunk_bytes = state_chunk_bytes
        self.last_state_sources: dict[str, int] = {}  # peer -> state bytes it served us
        self.admission_auth = admission
        self.admission: Admission | None = None
        self.round_id = 0  # rounds this worker has committed (or adopted by healing)
        #: peers that made ``exclude_after`` consecutive rounds fail are left out of this
        #: peer's groups for ``exclude_seconds`` (:mod:`farlink.robust.strikes`)
        self.strikes = Strikes(exclude_after, exclude_seconds)
        self._blamed: set[str] = set()  # peers that failed this round for us (a refused heal)
        # what plausibility of a heal is judged by (farlink.robust.heal.implausible)
        self._last_commit_at: float | None = None
        self._shortest_round: float | None = None
        self._fingerprint: tuple[int, str | None] | None = None  # (round, fingerprint) announced
        self.control_bytes_sent = 0
        self.state_bytes_sent = 0
        self.last_failure: CommError | None = None  # why the last round did not commit
        self.rejected: dict[int, str] = {}  # rank -> reason, for the last all-gather
        #: a replica group's rank 0 announces its ranks' peers (``[peer id bytes, [multiaddrs]]``
        #: each, in rank order) in its matchmaking metadata; empty for a one-process worker
        self.replica_group_endpoints: list[list] = []
        self.last_shards: list[int] = []  # elements each rank reduced in the last all-reduce
        self._get_state: Callable[[], dict[str, torch.Tensor]] | None = None
        self._set_state: Callable[[dict[str, torch.Tensor]], None] | None = None
        self._group: _Group | None = None
        self._info: RoundInfo | None = None
        self._closed = False
        # the next round's matchmaking, when it runs ahead of begin_round (see expect_round)
        self._search: Any = None  # concurrent.futures.Future of _find_group
        self._deadline = 0.0  # DHT time by which the search must have found a group
        self._round_asked: float | None = None  # DHT time begin_round asked for the group
        self._search_task: asyncio.Task | None = None  # the search, on the event loop
        self._search_final = False  # whether that search is for the run's last round

        opts = dht_options(host_maddrs, announce_maddrs, client_mode, public, identity_path)
        if admission is not None:  # hivemind's own hook: every DHT RPC signed and checked
            opts["authorizer"] = RunAuthorizer(admission)
        # the DHT process (forked, with its p2pd) ends with this one, even one killed with
        # SIGKILL, when the main thread forks it (the kernel ties a child to its forking thread)
        tied = threading.current_thread() is threading.main_thread()
        self.dht = start_dht(list(initial_peers), startup_timeout=startup_timeout, tied=tied,
                             **opts)
        self._loop = asyncio.new_event_loop()
        self._loop_stopped = False  # close() stops it; nothing is run on it after
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="hivemind-comm"
        )
        self._thread.start()
        try:
            self._call(self._setup(), timeout=startup_timeout)
        except BaseException:
            self.close()
            raise

    # --- event loop plumbing -------------------------------------------------------------------
    def _call(self, coro, timeout: float) -> Any:
        if self._loop_stopped:  # closed: the coroutine would never run, nor be awaited
            coro.close()
            raise CommError("this hivemind collective is closed (its event loop has stopped)")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    async def _setup(self) -> None:
        self._p2p = await self.dht.replicate_p2p()
        self.peer_id: PeerID = self._p2p.peer_id
        self._mailbox = _Mailbox()
        self._runners: dict[bytes, asyncio.Future] = {}
        self._snapshots: dict[bytes, asyncio.Future] = {}
        self._servicer = _Servicer(self)
        self._round_wanted = asyncio.Event()  # begin_round wants the group now
        if self.admission_auth is not None:
            timeout = max(5.0, 5 * self.request_timeout)
            self.admission = Admission(self.admission_auth, self._p2p, self.prefix, timeout)
        self._matchmaking = AdmittingMatchmaking(
            self._p2p,
            hashlib.sha256(self.prefix.encode()).digest(),
            self.dht,
            servicer_type=_Servicer,
            prefix=self.prefix,
            target_group_size=self.target_group_size,
            min_group_size=self.min_group_size,
            min_matchmaking_time=self.matchmaking_time,
            request_timeout=self.request_timeout,
            client_mode=self.client_mode,
            admission=self.admission,
            excluded=lambda peer: self.strikes.excluded(str(peer)),
        )
        if not self.client_mode:  # client-mode peers accept no incoming streams
            if self.admission is not None:
                await self.admission.add_handler()
            await self._servicer.add_p2p_handlers(self._p2p, namespace=self.prefix)
            await self._p2p.add_binary_stream_handler(f"{self.prefix}.put", self._handle_put)
            await self._p2p.add_binary_stream_handler(f"{self.prefix}.fetch", self._handle_fetch)
            await self._p2p.add_binary_stream_handler(f"{self.prefix}.state", self._handle_state)

    def register_state(self, get_state, set_state) -> None:
        self._get_state, self._set_state = get_state, set_state

    @property
    def maddrs(self) -> list[str]:
        """This peer's full multiaddresses (what another peer passes as ``initial_peers``)."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    # --- rounds --------------------------------------------------------------------------------
    def expect_round(self, in_seconds: float, final: bool = False) -> None:
        """Look for the next round's group ahead of time: matchmaking starts ``matchmaking_time``
        before the round is due (at once when it is due sooner), in the background, declaring the
        round due at ``now + in_seconds``. A group is full as soon as every member is looking, so
        when the last member reaches its boundary the group is usually formed already and
        ``begin_round`` only collects it (hivemind's Optimizer schedules its averaging the same
        way). Ignored inside a round, or while an earlier search still runs."""
        if self._closed or self._group is not None or self._search is not None:
            return
        self._announced_fingerprint()
        due = get_dht_time() + max(0.0, float(in_seconds))
        self._deadline = due + self.round_timeout
        self._round_asked = None
        # the run's last round (``final``, said by the training side) is looked for as
        # such: under its own key, with every live peer
        self._search_final = final and self.final_group_size is not None
        self._search = asyncio.run_coroutine_threadsafe(self._find_group(due), self._loop)

    @property
    def partial_groups(self) -> bool:  # type: ignore[override]
        return self.final_group_size is not None  # Moshpit groups (--group-size)

    def begin_round(self, final: bool = False, *, joining: bool = False,
                    timeout: float | None = None, tag: str | None = None) -> RoundInfo:
        start = time.perf_counter()
        group = self.find_group(final, joining=joining, timeout=timeout)
        info = self.enter_group(self.alone()) if group is None else self.enter_group(group)
        self.stats.add_phase("matchmaking", time.perf_counter() - start)
        return info

    def alone(self) -> _Group:
        """The round of a peer that no group took within ``skip_after``: a group of itself
        that has already failed, so it exchanges nothing, heals from no one and commits
        nothing (its round number stays, and its next group heals it if the others moved
        on). Its ``RoundInfo`` says ``skipped``; the training side goes on with its local
        update, as hivemind's Optimizer does when averaging fails."""
        self.skipped_rounds += 1
        self.last_failure = RoundTimeout(
            f"round {self.round_id}: no group formed for this peer within {self.skip_after:.0f} s "
            f"of its boundary (groups of {self.target_group_size} left it out); it skips "
            "averaging this round and goes on with its local update")
        log.warning("%s", self.last_failure)
        return _Group(group_id=b"alone/" + str(self.round_id).encode(), peers=[self.peer_id],
                      client=[self.client_mode], bandwidth=[self.bandwidth],
                      committed=[self.round_id], me=0, round_id=self.round_id, ok=False,
                      skipped=True)

    def find_group(self, final: bool = False, *, joining: bool = False,
                   timeout: float | None = None) -> _Group:
        """This round's group from matchmaking (the one an early search found, or a new
        search): who is in it and what each announced. Nothing is exchanged with it yet.
        ``joining``/``timeout``: as :meth:`Collective.begin_round` says."""
        if self._closed:
            raise CommError("begin_round on a closed collective")
        self._joining = joining
        self._round_wait = self.round_timeout if timeout is None else timeout
        now = get_dht_time()
        if self._search is None:
            self._deadline = now + self._round_wait
        else:  # an early search gets the full wait from now, as a search started now would
            self._deadline = max(self._deadline, now + self._round_wait)
        self._round_asked = now  # an early search still waiting for its start begins now
        self._loop.call_soon_threadsafe(self._round_wanted.set)
        search, self._search = self._search, None
        if search is not None and search.done() and search.exception() is not None:
            log.info("early matchmaking failed (%r); looking again", search.exception())
            search = None
        final = final and self.final_group_size is not None
        if search is not None and final != self._search_final:
            # an early search of the other kind: the last round forms with everyone, under a
            # key of its own, and the usual rounds in groups of their size
            self._call(self._cancel_search(search), timeout=self.request_timeout + 10)
            search = None
        if search is None:
            self._search_final = final
            self._announced_fingerprint()
            search = asyncio.run_coroutine_threadsafe(self._find_group(now), self._loop)
        wait = self._deadline - get_dht_time() + 30
        may_skip = self.skip_after is not None and not final
        try:  # polls the stop flag: a volunteer waiting for peers leaves on Ctrl-C / SIGTERM
            group_info = interrupt.wait_future(search, self.skip_after if may_skip else wait,
                                               self._awaited_group, log)
        except KeyboardInterrupt:
            log.warning("interrupted while waiting for %s; leaving", self._awaited_group())
            self._call(self._cancel_search(search), timeout=self.request_timeout + 10)
            raise
        except TimeoutError:
            if not may_skip:
                search.cancel()
                raise
            self._call(self._cancel_search(search), timeout=self.request_timeout + 10)
            if not search.done() or search.cancelled() or search.exception() is not None:
                return None  # no group within the window: this round is skipped
            group_info = search.result()  # formed while it was being cancelled: take part
        return self._make_group(group_info)

    def _awaited_group(self) -> str:
        """What ``find_group`` waits for, for its log lines."""
        swarm = "" if self.swarm_size is None else f", {self.swarm_size()} live in the swarm"
        return (f"a group of >= {self._matchmaking.min_group_size} peers for run "
                f"{self.run_id!r} (round {self.round_id}{swarm})")

    def enter_group(self, group: _Group) -> RoundInfo:
        """Make ``group`` this round's: prove membership to its members (with --auth), bring
        this worker up to the group's round if it is behind (healing), and say who takes part.
        A replica group's ranks other than 0 enter the group their rank 0 found, as its rank-r view
        (:mod:`farlink.comm.hivemind_replica_group`)."""
        self._group = group
        self._admit_group(group)
        healed = self._heal(group) if group.ok else False
        self._info = RoundInfo(
            round_id=group.round_id,
            rank=group.me,
            world_size=group.size,
            healed=healed,
            peers=[str(p) for p in group.peers],
            skipped=group.skipped,
        )
        return self._info

    async def _find_group(self, due: float) -> Any:
        """Matchmaking for the round due at ``due`` (DHT time), retried until ``_deadline``. It
        starts ``matchmaking_time`` before ``due`` or when ``begin_round`` asks, whichever is
        first, and gives stragglers the same window as a search started at the boundary: a group
        that is not full is formed ``matchmaking_time`` after the round is due."""
        self._search_task = asyncio.current_task()
        wait = due - self.matchmaking_time - get_dht_time()
        if wait > 0 and self._round_asked is None:
            self._round_wanted.clear()
            try:
                await asyncio.wait_for(self._round_wanted.wait(), timeout=wait)
            except TimeoutError:
                pass
        await self._reset_round()
        while True:
            if self._round_asked is not None:  # the boundary came: no later than now
                due = min(due, self._round_asked)
            remaining = self._deadline - get_dht_time()
            final = self._search_final
            if remaining <= self.matchmaking_time and not final:
                raise RoundTimeout(
                    f"no group of at least {self.min_group_size} peers formed for run "
                    f"{self.run_id!r} within {self._round_wait:.0f} s (round {self.round_id}). "
                    "Fix: start more peers with the same run id and initial peers, check that they "
                    "can reach each other, or lower min_group_size / raise round_timeout."
                )
            if final and remaining <= self.matchmaking_time:
                raise RoundTimeout(
                    f"the last round of run {self.run_id!r} found no group of at least "
                    f"{self.min_group_size} peers within {self._round_wait:.0f} s (round "
                    f"{self.round_id}). Fix: check that the other peers still run and can reach "
                    "this one, or raise the quorum timeout.")
            self._matchmaking_for(final)
            scheduled = max(due, get_dht_time()) + self.matchmaking_time
            if final:  # the group fills when every peer came; a dead one is waited for until
                # the deadline, and the group then starts with those that came
                scheduled = max(scheduled, self._deadline - self.matchmaking_time)
            step = StepControl(
                scheduled_time=scheduled,
                deadline=self._deadline,
                allow_retries=True,
                weight=1.0,
                data_for_gather=msgpack.packb(
                    [self.round_id, int(self.client_mode), self.bandwidth,
                     self.replica_group_endpoints,
                     self._fingerprint[1] if self._fingerprint and not self._joining
                     and self._fingerprint[0] == self.round_id else None]),
            )
            step.attach(MPFuture(), MPFuture())  # hivemind's averager does this; no trigger here
            step.allow_allreduce()
            try:
                group_info = await self._matchmaking.look_for_group(step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - matchmaking errors: retry until deadline
                log.info("matchmaking attempt failed: %r", exc)
                group_info = None
                await asyncio.sleep(min(1.0, self.request_timeout))
            finally:
                if not step.done():
                    step.set_result(None)
            if group_info is not None:
                return group_info

    def _matchmaking_for(self, final: bool) -> None:
        """Point matchmaking at the run's last round or at the usual ones. The last round has
        a group key of its own (``…0b1``; the usual rounds use ``…0b``), so a peer still in an
        earlier round never fills the last round's group in place of a peer that ends with it,
        and a group as large as ``final_group_size`` (the swarm): every live peer ends on one
        model whatever the usual group size."""
        size = self.final_group_size if final else self.target_group_size
        least = self.min_group_size
        if self.swarm_size is not None:  # a volunteer swarm: its groups follow its live size
            least, size = group_bounds(least, size, self.swarm_size())
        self._matchmaking.min_group_size = least
        keys = self._matchmaking.group_key_manager
        keys.group_bits = "1" if final else ""
        # the key manager draws each member a bucket among target_group_size once a group forms
        self._matchmaking.target_group_size = keys.target_group_size = size

    async def _cancel_search(self, search) -> None:
        """Cancel an early search and wait until hivemind's matchmaking has let go of it (its
        declarations and followers), so nothing is left pending when the loop stops."""
        search.cancel()
        task = self._search_task
        if task is not None and not task.done():
            await cancel_and_wait(task)

    async def _reset_round(self) -> None:
        self._mailbox.clear()
        self._runners.clear()
        self._snapshots.clear()

    async def forget_other_rounds(self, group_id: bytes) -> None:
        """Drop what earlier rounds left (payloads, runners, state snapshots), keeping what
        groupmates already sent for ``group_id``: a replica group's rank other than 0 enters a group
        that others may have started sending to before this rank heard of it."""
        for store in (self._mailbox.slots, self._runners, self._snapshots):
            for key in [k for k in store if not k.startswith(group_id)]:
                del store[key]

    def _announced_fingerprint(self) -> None:
        """Compute, once per committed round and in the caller's thread (it hashes the whole
        state), the fingerprint this peer announces with its round in matchmaking: healing
        members check what they download against it (:mod:`farlink.robust.heal`)."""
        if self._get_state is None or (self._fingerprint
                                       and self._fingerprint[0] == self.round_id):
            return
        self._fingerprint = (self.round_id, state_fingerprint(self._get_state()))

    def _make_group(self, info) -> _Group:
        """The group from what its members announced. A member whose metadata is malformed
        is named, excluded from this peer's next groups, and fails this round for everyone:
        every member reads the same announcements, so every member fails it alike."""
        peers = list(info.peer_ids)
        announced, malformed = [], {}
        for peer, raw in zip(peers, info.gathered):
            try:
                try:
                    meta = msgpack.unpackb(raw)
                except Exception as exc:  # noqa: BLE001 - any garbage a peer may send
                    raise ValueError(f"not msgpack ({exc.__class__.__name__})") from exc
                announced.append(parse_announcement(meta))
            except ValueError as exc:
                malformed[str(peer)] = str(exc)
                announced.append(None)
        held = [-1 if a is None else a.round_id for a in announced]
        fingerprints = [None if a is None else a.fingerprint for a in announced]
        group = _Group(
            group_id=bytes(info.group_id),
            peers=peers,
            client=[True if a is None else a.client for a in announced],
            bandwidth=[1.0 if a is None else a.bandwidth for a in announced],
            committed=held,
            me=peers.index(self.peer_id),
            round_id=plan_heal(held, fingerprints, []).round_id,
            endpoints=[[] if a is None else a.endpoints for a in announced],
            fingerprints=fingerprints,
        )
        excluded = [str(p) for p in peers if p != self.peer_id and self.strikes.excluded(str(p))]
        if malformed:
            for peer in malformed:
                if peer != str(self.peer_id):
                    self.strikes.exclude(peer)
            self._fail(CommError(
                f"round {group.round_id}: malformed matchmaking metadata from "
                + "; ".join(f"peer {p}: {why}" for p, why in malformed.items())
                + f". The round fails for the whole group; this peer leaves "
                f"{'them' if len(malformed) > 1 else 'it'} out of its groups for "
                f"{self.strikes.seconds:.0f} s."), group)
        elif excluded:  # another member's leader let in a peer this one excludes
            self._fail(CommError(
                f"round {group.round_id}: the group holds {', '.join(excluded)}, which this peer "
                "excludes for now (it kept making rounds fail); this peer sits the round out "
                "and looks for a group without it next round."), group)
        return group

    def _heal(self, group: _Group) -> bool:
        """Bring members that are not at the group's round (behind, or ahead of it) to it;
        True if this worker healed. Every member reads the same plan from the same
        announcements (:func:`farlink.robust.heal.plan_heal`); a member that heals checks the
        state against the fingerprint its sources announced, for finiteness, and that the jump
        is plausible, and otherwise refuses it and fails the round, naming the source."""
        plan = plan_heal(group.committed, group.fingerprints, group.servers())
        if not plan.behind:
            return False
        sources = plan.sources
        key = group.group_id + b"/state"
        if group.me in sources and self._get_state is not None:
            blob, digest = pack_state(self._get_state())
            self._call(self._publish_snapshot(key, blob, digest, group.round_id), timeout=10)
        if group.me not in plan.behind:
            return False
        mine = group.committed[group.me]
        if not sources or self._set_state is None:
            return self._fail(
                CommError(
                    f"this worker is at round {mine} but the group is at "
                    f"{group.round_id} and no up-to-date member can serve state (all client-mode, "
                    "or no state registered). Fix: register_state on every worker and keep at "
                    "least one peer that accepts connections."
                )
            )
        if self._last_commit_at is not None:
            why = implausible(group.round_id, mine, time.monotonic() - self._last_commit_at,
                              self._shortest_round)
            if why is not None:
                named = [str(group.peers[r]) for r in sources]
                self._blamed.update(named)
                return self._fail(CommError(
                    f"refused to heal from {', '.join(named)}, which announced round "
                    f"{group.round_id}: {why}. This peer keeps its state and fails the round; a "
                    "peer that keeps announcing such rounds is excluded from its groups."))
        # the sources that share the most-announced state; newcomers start at different ones,
        # and each spreads its chunks over all of them
        expected = plan.expected[sources[0]]
        sources = [r for r in sources if plan.expected[r] == expected]
        first = plan.behind.index(group.me) % len(sources)
        order = sources[first:] + sources[:first]
        failures = []
        for attempt in range(min(len(order), 3)):  # a refused source: the next one leads
            peers = [group.peers[r] for r in order[attempt:] + order[:attempt]]
            try:
                blob, digest = self._call(self._download_state(key, peers),
                                          timeout=self.state_timeout + 5)
                state = unpack_state(blob, digest)
            except Exception as exc:  # noqa: BLE001 - download, hash or peer errors
                failures.append(f"{peers[0]}: {exc!r}")
                continue
            refused = self._refusal(state, expected)
            if refused is None:
                break
            self._blamed.add(str(peers[0]))
            failures.append(f"{peers[0]} (announced round {group.round_id}): {refused}")
            log.warning("round %d: refused the state served by %s (announced round %d): %s; "
                        "trying another source", group.round_id, peers[0], group.round_id, refused)
        else:
            return self._fail(
                RoundTimeout(
                    f"could not load a state this peer accepts for round {group.round_id}: "
                    + "; ".join(failures) + ". This peer keeps its own state; the round is "
                    "retried (raise state_timeout if the state is large)."
                )
            )
        self._set_state(state)
        log.info(
            "healed to round %d from %d peer(s) (%s bytes each; %s)",
            group.round_id,
            len(self.last_state_sources),
            ", ".join(str(b) for b in self.last_state_sources.values()),
            digest[:12],
        )
        self.round_id = group.round_id
        self._fingerprint = None  # announced afresh from the adopted state
        self._last_commit_at = time.monotonic()
        return True

    @staticmethod
    def _refusal(state: dict[str, torch.Tensor], expected: str | None) -> str | None:
        """Why a downloaded state must not be adopted, or None."""
        if expected is not None and state_fingerprint(state) != expected:
            return (f"its fingerprint {state_fingerprint(state)} is not the {expected} its "
                    "sources announced")
        bad = first_non_finite(state)
        if bad is not None:
            return f"tensor {bad!r} holds NaN or Inf"
        return None

    def connect_to(self, peers: list[PeerID], addresses: list[list[str]],
                   group_id: bytes) -> None:
        """Before entering a group someone else formed (a replica group's rank 0): dial its members
        at the addresses they announced (best effort: the DHT finds them otherwise) and drop what
        earlier rounds left, keeping what members already sent for ``group_id``."""
        from hivemind.utils.multiaddr import Multiaddr

        async def dial() -> None:
            await self.forget_other_rounds(group_id)
            for peer, maddrs in zip(peers, addresses):
                if peer == self.peer_id:
                    continue
                try:
                    await self._p2p._client.connect(peer, [Multiaddr(m) for m in maddrs])
                except Exception as exc:  # noqa: BLE001 - the exchange reports a dead member
                    log.info("could not dial %s at %s: %r", peer, maddrs, exc)

        self._call(dial(), timeout=self.request_timeout * max(1, len(peers)) + 5)

    def current_ok(self) -> bool:
        """Whether this worker has got through the current round so far."""
        return self._current().ok

    def fail_round(self, error: CommError, blame: Sequence[int] = ()) -> None:
        """Fail the current round for a reason found outside this peer (another rank of its replica
        group failed, the exchange caught a member equivocating): it votes no, and the members
        ``blame`` names get a strike (see :mod:`farlink.robust.strikes`)."""
        group = self._group
        if group is not None:
            self._blamed.update(str(group.peers[r]) for r in blame
                                if 0 <= r < group.size and r != group.me)
        self._fail(error)

    def _fail(self, error: CommError, group: _Group | None = None) -> bool:
        group = group or self._group
        if group is not None:
            group.ok = False
        self.last_failure = error
        log.warning("%s", error)
        return False

    async def _download_state(self, key: bytes, peers: list[PeerID]) -> tuple[bytes, str]:
        """The snapshot under ``key``: manifest and first chunk from ``peers[0]``, chunk i from
        ``peers[i % len(peers)]`` (two requests in flight per peer); a chunk that fails its
        digest, or whose peer fails, is asked of the next peer. Returns (blob, whole SHA-256)."""
        header, bodies = await self._request(
            peers[0], "state", {"key": key, "offset": 0, "length": self.state_chunk_bytes,
                                "manifest": True}, [])
        if header.get("error"):
            raise CommError(str(header["error"]))
        digest, size = str(header["sha256"]), int(header["size"])
        chunk, digests = int(header["chunk_bytes"]), [str(d) for d in header["chunks"]]
        if chunk < 1 or len(digests) != max(1, -(-size // chunk)):
            raise CommError(f"malformed state manifest from {peers[0]}")
        parts: list[bytes | None] = [None] * len(digests)
        served: dict[str, int] = {}
        if chunk_ok(bodies[0], digests[0]):
            parts[0] = bodies[0]
            served[str(peers[0])] = len(bodies[0])
        slots = {peer: asyncio.Semaphore(2) for peer in peers}

        async def fetch(i: int) -> None:
            for attempt in range(len(peers)):
                peer = peers[(i + attempt) % len(peers)]
                try:
                    async with slots[peer]:
                        h, b = await self._request(
                            peer, "state", {"key": key, "offset": i * chunk, "length": chunk}, [])
                    if h.get("sha256") == digest and b and chunk_ok(b[0], digests[i]):
                        parts[i] = b[0]
                        served[str(peer)] = served.get(str(peer), 0) + len(b[0])
                        return
                    log.warning("state chunk %d from %s failed its check; asking another peer",
                                i, peer)
                except Exception as exc:  # noqa: BLE001 - one peer failing is not fatal
                    log.warning("state chunk %d from %s failed (%r); asking another peer",
                                i, peer, exc)
            raise CommError(f"state chunk {i} could not be fetched from any of {len(peers)} peers")

        await asyncio.gather(*(fetch(i) for i, part in enumerate(parts) if part is None))
        self.last_state_sources = served
        return b"".join(p for p in parts if p is not None), digest

    async def _publish_snapshot(self, key: bytes, blob: bytes, digest: str, round_id: int) -> None:
        future = self._snapshots.setdefault(key, self._loop.create_future())
        if not future.done():
            future.set_result((blob, digest, round_id))

    # --- membership ----------------------------------------------------------------------------
    def _admitted(self, peer: PeerID, what: str) -> bool:
        """Whether ``peer`` may call this handler (always, in a run without --auth)."""
        return self.admission is None or self.admission.admitted(peer, what)

    @staticmethod
    async def _refuse_stream(writer: asyncio.StreamWriter) -> None:
        try:
            await send_message(writer, {"error": "not a member of this run"}, [])
        except Exception as exc:  # noqa: BLE001 - the refused peer may be gone already
            log.debug("refusal not delivered: %r", exc)
        finally:
            writer.close()

    def _admit_group(self, group: _Group) -> None:
        """Prove every groupmate this peer will send to (and this peer to it) before the round's
        first byte; a groupmate that fails fails the round. Client-mode groupmates cannot be
        dialed: they prove themselves when they contact us, and are refused until they do."""
        if self.admission is None:
            return
        others = [group.peers[r] for r in group.servers() if r != group.me]

        async def check_all() -> list:
            return await asyncio.gather(*(self.admission.ensure(p) for p in others),
                                        return_exceptions=True)

        try:
            results = self._call(check_all(), timeout=self.admission.timeout + 5)
        except Exception as exc:  # noqa: BLE001 - the loop call itself timed out
            results = [exc] * len(others)
        failed = {str(p): r for p, r in zip(others, results) if isinstance(r, BaseException)}
        if failed:
            self._fail(CommError(
                f"groupmates did not prove membership in round {group.round_id}: "
                + "; ".join(f"{p}: {e!r}" for p, e in failed.items())
                + ". The round is discarded; a non-member cannot take part."
            ))

    # --- collectives ---------------------------------------------------------------------------
    def _current(self) -> _Group:
        if self._group is None:
            raise CommError("collective called outside a round: call begin_round() first")
        return self._group

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        group = self._current()
        self.stats.collectives += 1
        key = group.next_key(b"r")
        if group.size == 1 or not tensors or not group.ok:
            if not group.ok:
                log.info("skipping all-reduce of a failed round")
            return
        start = time.perf_counter()
        work = [
            t.detach()
            if t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
            else t.detach().to("cpu", torch.float32).contiguous()
            for t in tensors
        ]
        total = sum(w.numel() for w in work)
        bandwidths = [0.0 if c else b for c, b in zip(group.client, group.bandwidth)]
        fractions = shard_fractions(total, bandwidths)
        timeout = self.allreduce_timeout
        try:
            sent = self._call(
                self._all_reduce(group, key, work, fractions), timeout=3 * timeout + 5
            )
            self.emulate_transfer(sent, 2)  # to the reducers and back: two hops
            self.stats.bytes_sent += sent
            for tensor, summed in zip(tensors, work):
                summed.mul_(group.size)
                if summed is not tensor:
                    tensor.copy_(summed)
        except Exception as exc:  # noqa: BLE001 - a failed peer or timeout fails the round
            self._fail(
                RoundTimeout(
                    f"all-reduce in round {group.round_id} failed: {exc!r}. A peer left or is too "
                    "slow; the round is discarded. Fix if it persists: raise allreduce_timeout."
                )
            )
        self.stats.add_phase("all_reduce", time.perf_counter() - start)

    async def _all_reduce(self, group: _Group, key: bytes, work, fractions) -> int:
        reducers = sum(1 for f in fractions if f > 0)
        runner = CountingAllReduceRunner(
            p2p=self._p2p,
            servicer_type=_Servicer,
            prefix=self.prefix,
            group_id=key,
            tensors=work,
            weight=1.0,
            ordered_peer_ids=group.peers,
            peer_fractions=fractions,
            modes=[AveragingMode.CLIENT if f == 0 else AveragingMode.NODE for f in fractions],
            sender_timeout=self.allreduce_timeout,
            reducer_timeout=2 * self.allreduce_timeout,
            part_size_bytes=part_size_bytes(sum(w.numel() for w in work), reducers),
        )
        future = self._runners.setdefault(key, self._loop.create_future())
        future.set_result(runner)
        self.last_shards = runner.shard_sizes()
        try:
            async for tensor, delta in azip(as_aiter(*work), runner):
                tensor.add_(delta)  # delta = average - local: hivemind returns differences
            await asyncio.wait_for(runner.all_served.wait(), timeout=2 * self.allreduce_timeout)
        finally:
            self._runners.pop(key, None)
        if runner.banned_senders:
            raise CommError(
                f"senders dropped during all-reduce: {sorted(map(str, runner.banned_senders))}"
            )
        return runner.bytes_sent

    async def _wait_runner(self, key: bytes):
        future = self._runners.setdefault(key, self._loop.create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=self.allreduce_timeout)
        except TimeoutError:
            return None

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        group = self._current()
        self.stats.collectives += 1
        key = group.next_key(b"g")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"all_gather_bytes takes bytes, not {type(payload).__name__}")
        payload = bytes(payload)
        if group.size == 1:
            return [payload]
        start = time.perf_counter()
        got, sent = self._call(
            self._exchange(group, key, payload, self.gather_timeout), timeout=self.gather_timeout + 10
        )
        self.emulate_transfer(sent, 1)  # pushed to every member directly: one hop
        self.stats.bytes_sent += sent
        self.rejected = {}
        out: list[bytes] = []
        for rank in range(group.size):
            if rank == group.me:
                out.append(payload)
            elif rank not in got:
                out.append(b"")
                self.rejected[rank] = "missing"
            else:
                out.append(got[rank])
        missing = [r for r, why in self.rejected.items() if why == "missing"]
        if missing:
            self._fail(
                RoundTimeout(
                    f"all-gather in round {group.round_id}: no payload from ranks {missing} within "
                    f"{self.gather_timeout:.0f} s; the round is discarded. Fix if it persists: "
                    "raise gather_timeout."
                )
            )
        self.stats.add_phase("all_gather", time.perf_counter() - start)
        return out

    @property
    def native_all_to_all(self) -> bool:  # type: ignore[override]
        """True unless the round's group has a member behind NAT (it takes no pushes)."""
        group = self._group
        return group is None or not any(group.client)

    def round_members(self) -> int:
        return self._current().size

    def round_rank(self) -> int:
        return self._current().me

    def all_to_all_bytes(self, outgoing: list[bytes]) -> list[bytes]:
        """Each member's message pushed to it alone. A group with a member behind NAT (it
        takes no pushes; it fetches from a server) sends every member's list through the
        all-gather instead: correct, but not cheaper than the gathered path."""
        group = self._current()
        n = group.size
        if len(outgoing) != n:
            raise ValueError(f"all-to-all of {len(outgoing)} messages in a round of {n}")
        outgoing = [bytes(m) for m in outgoing]
        if n == 1:
            return outgoing
        if any(group.client):  # one message for all (an all-gather's) travels once
            same = all(m == outgoing[0] for m in outgoing)
            gathered = self.all_gather_bytes(msgpack.packb([outgoing[0]] if same else outgoing))
            out = []
            for rank, raw in enumerate(gathered):
                try:
                    lists = msgpack.unpackb(raw) if raw and rank != group.me else None
                except Exception:  # noqa: BLE001 - a malformed list delivers nothing
                    lists = None
                mine = None
                if isinstance(lists, list) and len(lists) in (1, n):
                    mine = lists[0] if len(lists) == 1 else lists[group.me]
                out.append(outgoing[rank] if rank == group.me else
                           bytes(mine) if isinstance(mine, bytes) else b"")
            return out
        self.stats.collectives += 1
        key = group.next_key(b"a")
        start = time.perf_counter()
        got, sent = self._call(
            self._exchange(group, key, outgoing, self.gather_timeout),
            timeout=self.gather_timeout + 10)
        self.emulate_transfer(sent, 1)
        self.stats.bytes_sent += sent
        missing = [r for r in range(n) if r != group.me and r not in got]
        if missing:
            self._fail(RoundTimeout(
                f"all-to-all in round {group.round_id}: nothing from ranks {missing} within "
                f"{self.gather_timeout:.0f} s; the round is discarded. Fix if it persists: "
                "raise gather_timeout."))
        self.stats.add_phase("all_to_all", time.perf_counter() - start)
        return [outgoing[r] if r == group.me else got.get(r, b"") for r in range(n)]

    async def _exchange(
        self, group: _Group, key: bytes, data: bytes | list[bytes], timeout: float,
        kind: str = "data"
    ) -> tuple[dict[int, bytes], int]:
        """Everyone's ``data`` for ``key``: push to servers; clients fetch from one server.
        ``data`` as a list: ``data[r]`` goes to member ``r`` alone (an all-to-all; every
        member is then a server)."""
        deadline = time.monotonic() + timeout
        self._adopt_early(group)
        own = data[group.me] if isinstance(data, list) else data
        self._mailbox.put(key, group.me, own)
        others = {r for r in range(group.size) if r != group.me}
        targets = [r for r in group.servers() if r != group.me]
        count = stream_parts(len(own), kind)

        def parts_for(rank: int) -> list[bytes]:
            body = data[rank] if isinstance(data, list) else data
            pieces = stream_parts(len(body), kind)
            return [slice_of(body, i, pieces) for i in range(pieces)]

        async def push(rank: int) -> int:
            if self.admission is not None and group.peers[rank] not in self.admission.members:
                group.dead.add(rank)  # never send to a groupmate that has not proven membership
                self._mailbox.changed.set()
                return 0
            parts = parts_for(rank)
            delivered = await asyncio.gather(*(push_part(rank, i, body, len(parts))
                                               for i, body in enumerate(parts)))
            if all(delivered):
                return sum(len(p) for p in parts)
            group.dead.add(rank)
            self._mailbox.changed.set()
            return 0

        async def push_part(rank: int, part: int, body: bytes, parts: int) -> bool:
            header = {"key": key, "rank": group.me, "part": part, "parts": parts}
            for attempt in range(1, PUSH_TRIES + 1):
                try:
                    answer, _ = await asyncio.wait_for(
                        self._request(group.peers[rank], "put", header, [body]),
                        timeout=max(0.1, deadline - time.monotonic()),
                    )
                    if "error" in answer:
                        raise CommError(f"refused: {answer['error']}")
                    return True
                except Exception as exc:  # noqa: BLE001 - unreachable groupmate
                    pause = PUSH_PAUSE * attempt
                    if attempt == PUSH_TRIES or deadline - time.monotonic() <= pause:
                        log.info("push to rank %d failed: %r", rank, exc)
                        return False
                    log.info("push to rank %d failed (%r); trying again", rank, exc)
                    await asyncio.sleep(pause)
            return False

        pushes = asyncio.gather(*(push(r) for r in targets))
        if not group.client[group.me]:
            got = await self._mailbox.wait(key, others, deadline, group.dead)
            # wait until the client-mode members assigned to us fetched, so bytes are final
            mine = {c for c in others if group.client[c] and self._server_for(group, c) == group.me}
            if mine:
                await self._mailbox.wait(key + b"/served", mine, deadline, group.dead)
        else:
            server = self._server_for(group, group.me)
            got = {}
            if self.admission is not None and group.peers[server] not in self.admission.members:
                return got, sum(await pushes)
            # as many streams as our own payload takes: the others' are about its size
            request = {"key": key, "rank": group.me, "ranks": sorted(others),
                       "timeout": timeout, "kind": kind, "parts": count}
            pieces: dict[int, dict[int, bytes]] = {}
            fetches = [self._fetch(group.peers[server], {**request, "part": i}, pieces)
                       for i in range(count)]
            try:
                failures = [r for r in await asyncio.wait_for(
                    asyncio.gather(*fetches, return_exceptions=True),
                    timeout=max(0.1, deadline - time.monotonic() + 5),
                ) if isinstance(r, BaseException)]
                if failures:
                    log.info("fetch from rank %d failed: %r", server, failures[0])
            except Exception as exc:  # noqa: BLE001
                log.info("fetch from rank %d failed: %r", server, exc)
            # a payload counts once every slice of it is here
            got = {rank: b"".join(p[i] for i in range(count))
                   for rank, p in pieces.items() if len(p) == count}
        sent = sum(await pushes)
        return got, sent

    @staticmethod
    def _server_for(group: _Group, client_rank: int) -> int:
        """The member that answers a client-mode member's fetches (spread over servers)."""
        servers = group.servers()
        return servers[client_rank % len(servers)]

    async def _fetch(self, peer: PeerID, request: dict,
                     got: dict[int, dict[int, bytes]]) -> None:
        """One stream of a client-mode member's fetch: the server streams slice
        ``request["part"]`` of each payload as it arrives there, then ``{"done": True}``;
        ``got[rank][part]`` fills as they come."""
        _, reader, writer = await self._p2p.call_binary_stream_handler(
            peer, f"{self.prefix}.fetch"
        )
        try:
            await send_message(writer, request, [])
            while True:
                header, bodies = await recv_message(reader)
                if header.get("done"):
                    return
                got.setdefault(int(header["rank"]), {})[int(request["part"])] = bodies[0]
        finally:
            writer.close()

    async def _request(
        self, peer: PeerID, handler: str, header: dict, bodies: list[bytes]
    ) -> tuple[dict, list[bytes]]:
        _, reader, writer = await self._p2p.call_binary_stream_handler(
            peer, f"{self.prefix}.{handler}"
        )
        try:
            await send_message(writer, header, bodies)
            return await recv_message(reader)
        finally:
            writer.close()

    # --- handlers (run on the event loop for incoming streams) --------------------------------
    async def _handle_put(
        self, _info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if not self._admitted(_info.peer_id, "put"):
            await self._refuse_stream(writer)
            return
        try:
            header, bodies = await recv_message(reader)
            key, sender = bytes(header["key"]), _info.peer_id
            claimed = int(header["rank"]) if "rank" in header else None
            part, parts = slice_in(header)
            error = None
            if parts == 1:
                error = self._deliver(key, sender, claimed, bodies[0])
            else:  # a slice: the payload is whole when every slice is here
                pieces = self._mailbox.slots.setdefault(key + b"/part/" + sender.to_bytes(), {})
                if pieces.setdefault(part, bodies[0]) != bodies[0]:
                    error = f"a second, different slice {part} from {sender}"
                elif len(pieces) == parts:
                    error = self._deliver(key, sender, claimed,
                                          b"".join(pieces[i] for i in range(parts)))
            if error is not None:
                log.warning("refused a payload: %s; it is ignored and the slot keeps what its "
                            "owner sends", error)
            await send_message(writer, {"error": error} if error else {"ok": True}, [])
        except Exception as exc:  # noqa: BLE001 - a broken stream from one peer
            log.info("bad put: %r", exc)
        finally:
            writer.close()

    def _deliver(self, key: bytes, sender: PeerID, claimed: int | None,
                 data: bytes) -> str | None:
        """File ``data`` under the slot of its authenticated ``sender`` (never the rank it
        claims); None, or why it was refused. Before this peer knows the key's group, it
        waits in :attr:`_Mailbox.early` and is filed when the group is known."""
        group = self._group
        if group is None or not key.startswith(group.group_id):
            held = self._mailbox.early.setdefault(key, {})
            if sum(s == sender for s, _ in held) >= EARLY_CLAIMS:
                return f"{sender} pushed more than {EARLY_CLAIMS} payloads for one collective"
            held.setdefault((sender, claimed), data)
            return None
        return self._file(group, key, sender, claimed, data)

    def _file(self, group: _Group, key: bytes, sender: PeerID, claimed: int | None,
              data: bytes) -> str | None:
        if sender not in group.peers:
            return f"{sender} is not a member of round {group.round_id}'s group"
        rank = group.peers.index(sender)
        if claimed is not None and claimed != rank:
            return (f"{sender} (member {rank}) pushed a payload for member {claimed}'s slot "
                    f"in round {group.round_id}")
        held = self._mailbox.slots.get(key, {}).get(rank)
        if held is not None and held != data:  # the same bytes again: a retried push
            return (f"{sender} (member {rank}) sent a second, different payload for its slot "
                    f"in round {group.round_id}")
        self._mailbox.put(key, rank, data)
        return None

    def _adopt_early(self, group: _Group) -> None:
        """File the payloads of ``group`` that arrived before this peer entered it."""
        for key in [k for k in self._mailbox.early if k.startswith(group.group_id)]:
            for (sender, claimed), data in self._mailbox.early.pop(key).items():
                error = self._file(group, key, sender, claimed, data)
                if error is not None:
                    log.warning("refused a payload: %s; it is ignored and the slot keeps what "
                                "its owner sends", error)

    async def _handle_fetch(
        self, _info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if not self._admitted(_info.peer_id, "fetch"):
            await self._refuse_stream(writer)
            return
        try:
            header, _ = await recv_message(reader)
            ranks = {int(r) for r in header["ranks"]}
            key = bytes(header["key"])
            part, parts = slice_in(header)
            deadline = time.monotonic() + min(float(header["timeout"]), 600.0)
            group = self._group
            if group is not None and key.startswith(group.group_id):
                self._adopt_early(group)
                if _info.peer_id not in group.peers:
                    log.warning("refused a fetch by %s: not a member of round %d's group",
                                _info.peer_id, group.round_id)
                    await send_message(writer, {"error": "not a member of this group"}, [])
                    return
            sent = 0
            async for rank, payload in self._mailbox.arrivals(
                key, ranks, deadline, group.dead if group else None
            ):
                sent += await send_message(writer, {"rank": rank},
                                           [slice_of(payload, part, parts)])
            await send_message(writer, {"done": True}, [])
            if header.get("kind") == "data":
                self.stats.bytes_sent += sent
            else:
                self.control_bytes_sent += sent
            # the member is served when every one of its streams is: it is the member its
            # authenticated peer id is in the group, whatever rank it says it is
            group = self._group
            if group is None or not key.startswith(group.group_id) \
                    or _info.peer_id not in group.peers:
                return
            requester = group.peers.index(_info.peer_id)
            if int(header["rank"]) != requester:
                log.warning("%s (member %d) fetched as member %s in round %d; counted as "
                            "itself", _info.peer_id, requester, header["rank"], group.round_id)
            streams = self._mailbox.slots.setdefault(
                key + b"/fetched/" + str(requester).encode(), {})
            streams[part] = b""
            if len(streams) == parts:
                self._mailbox.put(key + b"/served", requester, b"")
        except Exception as exc:  # noqa: BLE001
            log.info("bad fetch: %r", exc)
        finally:
            writer.close()

    async def _handle_state(
        self, _info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if not self._admitted(_info.peer_id, "state request"):
            await self._refuse_stream(writer)
            return
        try:
            header, _ = await recv_message(reader)
            key = bytes(header["key"])
            future = self._snapshots.setdefault(key, self._loop.create_future())
            try:
                blob, digest, round_id = await asyncio.wait_for(
                    asyncio.shield(future), self.state_timeout
                )
            except TimeoutError:
                await send_message(writer, {"error": "no state snapshot for this round"}, [])
                return
            reply = {"sha256": digest, "round_id": round_id}
            if "offset" in header:  # one chunk of the snapshot (and, if asked, the manifest)
                offset, length = int(header["offset"]), int(header["length"])
                if offset < 0 or length < 1 or offset > len(blob):
                    await send_message(writer, {"error": "bad state range"}, [])
                    return
                if header.get("manifest"):
                    reply.update(size=len(blob), chunk_bytes=length,
                                 chunks=chunk_digests(blob, length))
                blob = blob[offset : offset + length]
            self.state_bytes_sent += await send_message(writer, reply, [blob])
        except Exception as exc:  # noqa: BLE001
            log.info("bad state request: %r", exc)
        finally:
            writer.close()

    # --- commit / close ------------------------------------------------------------------------
    def commit(self) -> bool:
        start = time.perf_counter()
        ok = self.vote(self._current().ok)
        self.end_round(ok)
        self.stats.add_phase("commit", time.perf_counter() - start)
        return ok

    def vote(self, ok: bool) -> bool:
        """Vote ``ok`` on this round with the group; True when every member voted yes."""
        group = self._current()
        group.ok = group.ok and ok
        if group.size == 1:
            return group.ok
        vote = VOTE_YES if group.ok else VOTE_NO
        key = group.group_id + b"/vote"
        got, sent = self._call(
            self._exchange(group, key, vote, self.commit_timeout, kind="control"),
            timeout=self.commit_timeout + 10,
        )
        self.control_bytes_sent += sent
        others = [r for r in range(group.size) if r != group.me]
        no = [str(group.peers[r]) for r in others if got.get(r) not in (None, VOTE_YES)]
        absent = [str(group.peers[r]) for r in others if got.get(r) is None]
        passed = group.ok and not no and not absent
        # a member that got through the round holds the no-voters and the silent ones (and
        # any source whose state it refused) to account; one that failed itself cannot tell
        # whose fault the others' no was
        failed = set(self._blamed) | (set(no) | set(absent) if group.ok else set())
        fine = {str(group.peers[r]) for r in others if got.get(r) == VOTE_YES} - failed
        for peer in self.strikes.round_done(sorted(failed), fine):
            log.warning("excluding peer %s from this peer's groups for %.0f s: it made %d "
                        "consecutive rounds fail (voted no, did not vote, or served a refused "
                        "state); its join requests are refused until then", peer,
                        self.strikes.seconds, self.strikes.after)
        if group.ok and not passed:
            self.last_failure = RoundTimeout(
                f"round {group.round_id} not committed: "
                + "; ".join(part for part in (
                    f"voted no: {', '.join(no)}" if no else "",
                    f"did not vote (left or timed out): {', '.join(absent)}" if absent else "",
                ) if part)
                + f". A peer that makes {self.strikes.after} consecutive rounds fail is left out "
                f"of this peer's groups for {self.strikes.seconds:.0f} s."
            )
        return passed

    def end_round(self, committed: bool) -> None:
        """Close the round: a committed one counts (this worker is at the next round)."""
        group = self._current()
        if committed:
            self.round_id = group.round_id + 1
            self.last_failure = None
            now = time.monotonic()
            if self._last_commit_at is not None and now > self._last_commit_at:
                gap = now - self._last_commit_at
                self._shortest_round = min(self._shortest_round or gap, gap)
            self._last_commit_at = now
        self._group = None
        self._blamed.clear()

    @property
    def quorum_timeout(self) -> float:
        """The wait for a group (hivemind's matchmaking round timeout)."""
        return self.round_timeout

    def load_committed_step(self, step: int) -> None:
        self.round_id = step
        self._last_commit_at = time.monotonic() if step > 0 else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._search is not None:  # an early search for a round that will not come
            search, self._search = self._search, None
            try:
                self._call(self._cancel_search(search), timeout=10)
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("early matchmaking cancel: %r", exc)
        try:
            if hasattr(self, "_p2p"):
                self._call(self._p2p.shutdown(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.debug("p2p replica shutdown: %r", exc)
        try:
            self._call(self._cancel_pending(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.debug("cancelling what was still running: %r", exc)
        self._loop_stopped = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.dht.shutdown()

    @staticmethod
    async def _cancel_pending() -> None:
        """Cancel what still runs on the loop (a groupmate's fetch waiting out its deadline,
        hivemind's own waits) and let it unwind: a loop stopped under pending tasks prints
        "Task was destroyed but it is pending!" for each at exit."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    def __enter__(self) -> HivemindCollective:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
