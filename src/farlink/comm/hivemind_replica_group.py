"""A replica group of several ranks on hivemind: one member of every averaging group, each rank on
its own link.

A replica group (``--ranks-per-worker K``: K ranks that train one replica, FSDP2 or DDP inside)
must be one member of an averaging group, never K: if each rank matched on its own, rank 0 could
average its shard with one set of replica groups and rank 1 with another, and the replica group's
replica would no longer be one model. Yet each rank should send only its own shard across replica
groups, over its own connection, as INTELLECT-1 did, so the replica group's cross-replica-group
bytes are those of one replica whatever K is and no single rank carries the whole replica. So:

* every rank runs its own hivemind peer (its own p2p daemon in the run's DHT); at start the
  ranks tell rank 0 their peer ids and addresses over the replica group's Gloo group;
* rank 0 alone matchmakes, and announces its ranks' peers in its matchmaking metadata; the group it
  forms (members in order, what each announced) goes to the other ranks over the replica group's
  group, and rank r takes the rank-r view of it (:meth:`_Group.of_replica_group_rank`): the same
  members in the same order, their rank-r peers, a group id of its own;
* each rank then runs the round's collectives (butterfly all-reduce, all-gather) on its own shard
  with rank r of exactly those replica groups, and heals on its own when the replica group is
  behind: rank r fetches its shard's state from rank r of an up-to-date replica group (as torchft
  pairs the ranks of a healing replica group), checked against its SHA-256;
* a round counts only if every rank of the replica group got through it: the ranks' outcomes are
  combined inside the replica group (healing right after it, the collectives at commit), rank 0
  votes the replica group's outcome with the other replica groups, and the vote's result goes back
  to every rank.

When no group takes the replica group within rank 0's window (Moshpit groups smaller than the swarm
leave a member out), rank 0 hands on "no group" and every rank skips the round together
(``RoundInfo.skipped``); the run's last round, matchmade by rank 0 with every live replica group,
is never skipped (:mod:`farlink.comm.hivemind_backend`).

A replica group whose rank healed while another failed to is not left half-healed: every rank keeps
the replica group's old round count, so the next round finds the whole replica group behind and
heals it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from farlink.comm.base import Collective, CommStats, LinkModel, RoundInfo
from farlink.comm.errors import CommError, RoundTimeout

#: how long a rank waits for its rank 0 inside the replica group (rank 0 may wait out a newcomer's
#: whole quorum timeout, or a long round of the other replica groups, before it has a group to hand
#: on)
REPLICA_GROUP_WAIT = timedelta(hours=2)


class HivemindReplicaGroupCollective(Collective):
    """One rank of a replica group on the hivemind backend; see the module docstring.

    ``replica_group``: the started :class:`~farlink.parallel.sharding.ReplicaGroup`. ``make_peer``:
    builds this rank's own :class:`~farlink.comm.hivemind_backend.HivemindCollective` (its DHT
    joins the run's initial peers). Every rank of the replica group constructs one at the same
    point of its program (a Gloo group of the replica group's ranks is created here)."""

    exact_all_reduce = False  # hivemind's butterfly hands each peer its average as a delta

    def __init__(self, replica_group, make_peer: Callable[[], Any]) -> None:
        import torch.distributed as dist

        self.replica_group = replica_group
        # the replica group's agreements on a group of their own: a round may run in a background
        # thread (Streaming DiLoCo) while the training thread uses the replica group's other groups
        self._agree_group = dist.new_group(backend="gloo", timeout=REPLICA_GROUP_WAIT)
        self.peer = make_peer()
        mine = [self.peer.peer_id.to_bytes(), self.peer.maddrs]
        endpoints: list[Any] = [None] * replica_group.size
        dist.all_gather_object(endpoints, mine, group=self._agree_group)
        if replica_group.rank == 0:
            # announced in rank 0's matchmaking metadata
            self.peer.replica_group_endpoints = endpoints

    # --- what the rest of farlink reads of a collective: this rank's peer's -----------------
    @property
    def stats(self) -> CommStats:  # type: ignore[override]
        return self.peer.stats

    @property
    def emulated_link(self) -> LinkModel | None:  # type: ignore[override]
        return self.peer.emulated_link

    @property
    def maddrs(self) -> list[str]:
        return self.peer.maddrs

    @property
    def quorum_timeout(self) -> float:  # type: ignore[override]
        return self.peer.quorum_timeout

    @property
    def partial_groups(self) -> bool:  # type: ignore[override]
        return self.peer.partial_groups

    @property
    def last_failure(self) -> CommError | None:
        return self.peer.last_failure

    def __getattr__(self, name: str) -> Any:
        # byte counters and diagnostics (control_bytes_sent, last_shards, ...) are the peer's
        if name == "peer":
            raise AttributeError(name)
        return getattr(self.peer, name)

    def register_state(self, get_state, set_state) -> None:
        self.peer.register_state(get_state, set_state)  # this rank's shard of the state

    def load_committed_step(self, step: int) -> None:
        self.peer.load_committed_step(step)

    # --- rounds --------------------------------------------------------------------------------
    def expect_round(self, in_seconds: float, final: bool = False) -> None:
        # only rank 0 matchmakes (the last round with every live replica group)
        if self.replica_group.rank == 0:
            self.peer.expect_round(in_seconds, final)

    def begin_round(self, final: bool = False, *, joining: bool = False,
                    timeout: float | None = None, tag: str | None = None) -> RoundInfo:
        start = time.perf_counter()
        found: list[Any] = [None]
        failure = None
        self.peer._joining = joining  # every rank announces (or not) its fingerprint
        if self.replica_group.rank == 0:
            try:
                found[0] = self.peer.find_group(final, joining=joining, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - every rank of the replica group raises it
                failure, found[0] = exc, (isinstance(exc, RoundTimeout), str(exc))
        self._broadcast(found)
        if failure is not None:
            raise failure
        if found[0] is None:  # no group took the replica group in time: every rank skips the round
            info = self.peer.enter_group(self.peer.alone())
            self.peer.stats.add_phase("matchmaking", time.perf_counter() - start)
            return info
        if isinstance(found[0], tuple):  # rank 0 found no group: what it raised, as text
            timed_out, message = found[0]
            raise (RoundTimeout if timed_out else CommError)(
                f"rank 0 of this replica group: {message}")
        group = found[0].of_replica_group_rank(self.replica_group.rank)
        if self.replica_group.rank > 0:
            rank = self.replica_group.rank
            self.peer.connect_to(group.peers, found[0].replica_group_rank_addresses(rank),
                                 group.group_id)
        before = self.peer.round_id
        info = self.peer.enter_group(group)  # membership proofs, and healing rank by rank
        if not self._all_ranks(self.peer.current_ok()):
            # the replica group is behind as a whole until all ranks heal
            self.peer.round_id = before
            if self.peer.current_ok():
                self.peer.fail_round(CommError(
                    f"round {group.round_id}: another rank of this replica group could not prove "
                    "membership or heal; the replica group sits this round out and heals in the "
                    "next"))
        self.peer.stats.add_phase("matchmaking", time.perf_counter() - start)
        return info

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        self.peer.all_reduce_sum(tensors)

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        return self.peer.all_gather_bytes(payload)

    def fail_round(self, error: CommError, blame=()) -> None:  # noqa: ANN001 - ranks
        """This rank's part of the round failed: its peer votes no through the replica group's
        commit."""
        self.peer.fail_round(error, blame)

    def commit(self) -> bool:
        start = time.perf_counter()
        replica_group_ok = self._all_ranks(self.peer.current_ok())
        outcome = [False]
        if self.replica_group.rank == 0:
            outcome[0] = self.peer.vote(replica_group_ok)
        self._broadcast(outcome)
        if not outcome[0] and self.peer.current_ok() and not replica_group_ok:
            self.peer.fail_round(CommError("another rank of this replica group failed its part of "
                                           "the round; the replica group voted no"))
        self.peer.end_round(bool(outcome[0]))
        self.peer.stats.add_phase("commit", time.perf_counter() - start)
        return bool(outcome[0])

    def close(self) -> None:
        self.peer.close()

    # --- inside the replica group -----------------------------------------------------------------
    def _broadcast(self, box: list[Any]) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list(box, src=0, group=self._agree_group)

    def _all_ranks(self, ok: bool) -> bool:
        """True on every rank when ``ok`` is true on all of them."""
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._agree_group)
        return bool(flag.item())
