"""Hierarchical DiLoCo: islands sync often over their fast links; only island leaders cross the
slow link, with DiLoCo.

Why: workers in one datacenter (an *island*) are joined by links a thousand times faster than the
links between datacenters. Flat DiLoCo treats every link as the slow one: every worker's
pseudo-gradient crosses the WAN and islands never profit from their fast links. Here:

* **island level** (every worker, the ``collective``/``exchange`` given to the algorithm):
  token-weighted parameter averaging of the island's members every ``island_steps`` inner steps,
  or, with time-budgeted rounds, every ``island_seconds``. Each worker runs as many inner AdamW
  steps as fit and ends its round at the step boundary *nearest* the round's deadline, so workers
  of different speeds in one island wait for one another about half a step at most. Deadlines
  are counted from the last global round, so lateness never accumulates. Updates travel as deltas
  from the island's last common point (the *anchor*), so codecs and error feedback behave as in
  DiLoCo. Inner AdamW states stay per worker.
* **global level** (island leaders only, ``global_exchange``): every ``inner_steps`` inner steps
  (time-budgeted: every K = round(round_seconds / island_seconds) island rounds) the leader sends
  the island's pseudo-gradient Δ_I = θ_g - θ_I, weighted by the tokens the whole island processed
  since θ_g, and applies outer Nesterov SGD (lr 0.7, momentum 0.9) to the token-weighted mean over
  islands.
* **hand-off**: the leader passes the new global parameters, the outer momentum and the outer step
  counter to its members through a hand-off :class:`~farlink.sync.exchange.Exchange` over the
  island's collective (lossless, :attr:`HierarchicalDiLoCo.handoff_codec`; the composition root
  builds it and hands it in), as a token-weighted mean in which the leader weighs 1 and members 0
  (exact in fp32: x * 1 + 0 = x, / 1); every member, the leader included, adopts the result.
  So it is authenticated like any other update when the run has ``--auth`` (signed, verified,
  impostors dropped), and a plain all-reduce without.
  By default the hand-off closes the same island round, so all replicas are bit-identical after
  each committed outer round. With ``overlap_global`` the leader runs the global round in a
  background thread while the island keeps training, and hands the result off at the next island
  round, where every replica adds its island's progress since the snapshot onto the new global
  parameters (a one-island-round-delayed outer step, as in Streaming DiLoCo's overlap): the slow
  link's latency is hidden; the global state (θ_g, momentum, step) is bit-identical on every
  replica after each outer round, the working copies differ by their island's latest progress,
  and the last round is synchronous so the run ends on identical replicas.

Composition: the algorithm *is* DiLoCo (a subclass) with an island round where DiLoCo has its
round: θ_g, the outer optimizer, the pseudo-gradient, the outer step, the global state's tensors,
the time budget and the step loop are DiLoCo's own (:mod:`farlink.sync.diloco`), and every tensor
that leaves a worker (island average, global pseudo-gradient, hand-off) goes through an
:class:`~farlink.sync.exchange.Exchange`, so codecs, aggregators, screening, authentication and
byte counting apply to each tier as they do to flat DiLoCo.

Transport: a worker holds two torchft Managers in one process, the island one (its island's own
Lighthouse) and, for leaders, the global one (the main Lighthouse). Two Managers in a process do
not interfere: each has its own replica id, TCPStore, manager server and process group on ports
chosen by the OS (``tests/test_hierarchical_integration.py`` runs it). On a replica group of K
ranks (``--ranks-per-worker``) each rank holds both Managers, the replica group being one torchft
replica group on each Lighthouse (each tier with a store of its own,
:mod:`farlink.train.tiers`); this algorithm then runs on the rank's shard (or DDP slice): rank r
averages, sends across islands and hands off only its part, with rank r of the other replica
groups, and every tier stays elementwise, so a replica group ends where one-rank workers end
(``tests/test_replica_group_hierarchical.py``). This module sees only the
:class:`~farlink.comm.base.Collective`/:class:`~farlink.sync.exchange.Exchange` interfaces.

Failures keep replicas consistent rather than maximise progress: everything a round received is
staged and applied only when the island commits; a global round that does not commit leaves θ_g
alone (the hand-off says so and members keep the island's average); an island round that fails
after its leader's global step is retried without repeating the global step, and until a hand-off
gets through, every island round starts with one (the leader's anchor and global state).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
from pydantic import Field

from farlink.comm.base import RoundInfo
from farlink.sync.base import (
    Capabilities,
    StepOutcome,
    TensorState,
    healed_in_any_try,
    load_optimizer_state,
    optimizer_state,
)
from farlink.sync.digest import state_digest, verified, with_digest
from farlink.sync.diloco import DiLoCo, DiLoCoOptions
from farlink.sync.exchange import Exchange, ExchangeResult
from farlink.sync.schedule import Schedule, make_schedule

_HEADER = 4  # present, committed, outer_step, global world size
GlobalOutcome = tuple[bool, int, int]  # committed, islands in the round, outer step after it


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].reshape(t.shape).to(t.dtype).clone())
        offset += t.numel()
    return out


@dataclass
class _Staged:
    """What one attempt of an island round received; applied only once the island commits."""

    info: RoundInfo
    result: ExchangeResult
    island: list[torch.Tensor]  # the island's new parameters (after any rebase / adoption)
    tokens: float  # the island's tokens since the global state its next pseudo-gradient uses
    pending: dict | None = None  # a repeated hand-off carrying the leader's anchor
    overlapped: dict | None = None  # the hand-off of the global round started last time
    handoff: dict | None = None  # the hand-off of this round's synchronous global round
    handoffs: list[dict] = field(default_factory=list)


class HierarchicalOptions(DiLoCoOptions):
    islands: str = Field(
        "", description="hierarchical_diloco: force the islands, e.g. '0,1|2,3' (default: "
        "formed from the links the launcher measures between the workers)")
    island_steps: int = Field(
        10, ge=1, description="hierarchical_diloco: inner steps between island averaging rounds")
    island_seconds: float | None = Field(
        None, gt=0, description="hierarchical_diloco with --round-seconds: time budget of an "
        "island round (default: the global round's, i.e. one island round per global round)")
    overlap_global: bool = Field(
        False, description="hierarchical_diloco: run each global round in the background while "
        "islands keep training; its result is applied one island round later (replicas add "
        "their island's progress since onto it); the last round stays synchronous")


class HierarchicalDiLoCo(DiLoCo):
    name = "hierarchical_diloco"
    Options = HierarchicalOptions
    # in-process collectives too (threads as peers; their all-reduce is exact); the planner
    # has no model of it (its hand-off carries SGD's momentum)
    # on replica groups of several ranks every tier is elementwise, so each rank runs it on its
    # shard
    capabilities = Capabilities(time_budget=True, islands=True, sharded=True,
                                backends=("torchft", "inprocess"), planned=False)

    @classmethod
    def check_run(cls, cfg) -> None:  # noqa: ANN001 - a RunConfig
        if cfg.round_seconds is None:
            if cfg.inner_steps % cfg.island_steps:
                raise ValueError(f"inner_steps={cfg.inner_steps} (the global period) must be "
                                 f"a multiple of island_steps={cfg.island_steps}")
        elif cfg.island_seconds is not None and cfg.island_seconds > cfg.round_seconds:
            raise ValueError(f"island_seconds={cfg.island_seconds} exceeds the global round's "
                             f"round_seconds={cfg.round_seconds}")

    # the hand-off: exact fp32 and a plain mean whatever the run's codec and aggregator,
    # authenticated as the run is
    handoff_codec = "none"

    def __init__(self, model, options, *args, global_exchange: Exchange | None = None,
                 handoff_exchange: Exchange | None = None,
                 **kwargs) -> None:  # noqa: ANN001 - as DiLoCo's
        """``handoff_exchange``: the exchange over the island's collective that the leader
        hands the global state off through (:attr:`handoff_codec`, the island exchange's sender
        and authenticator: :func:`farlink.compose.build_handoff` builds it);
        ``global_exchange``: the leaders' exchange, given to the island's leader only."""
        if options.steps is None:
            raise ValueError("hierarchical_diloco needs steps (its last global round is "
                             "synchronous, so the run's end must be known)")
        super().__init__(model, options, *args, **kwargs)
        if not self.collective.exact_all_reduce:
            raise ValueError("hierarchical_diloco needs an island collective whose all-reduce is "
                             "bitwise exact (the hand-off relies on it), e.g. torchft")
        cfg = self.cfg
        if handoff_exchange is None or handoff_exchange.collective is not self.collective:
            raise ValueError("hierarchical_diloco hands the global state to its island through "
                             "an exchange of its own over the island's collective: build it "
                             "with farlink.compose.build_handoff(HierarchicalDiLoCo, exchange) "
                             "and pass it as handoff_exchange=")
        self.global_exchange = global_exchange
        self.handoff_exchange = handoff_exchange
        self.leader = global_exchange is not None
        if global_exchange is not None:
            global_exchange.collective.register_state(self._export_global, self._import_global)
        self.overlap = cfg.overlap_global
        if cfg.outer_momentum > 0:  # explicit zeros: same numerics as torch's first step, and
            for g in self.global_params:  # every replica's state has the same keys from the start
                self.outer_opt.state[g]["momentum_buffer"] = torch.zeros_like(g)
        self.anchor = [p.detach().clone() for p in self.params]  # the island's common point
        self.island_tokens = 0.0  # the island's tokens since the global state θ_g it builds on
        self.island_round = 0  # island rounds attempted in the current global period
        self.handoff_pending = False  # a hand-off did not get through: repeat it first
        self.awaiting_handoff = False  # an overlapped global round is in flight
        self.snapshot: list[torch.Tensor] | None = None  # island parameters it started from
        self.snapshot_tokens = 0.0
        self._inflight: threading.Thread | None = None
        self._inflight_result: GlobalOutcome | None = None
        self._inflight_error: BaseException | None = None
        self._inflight_target: tuple[list[torch.Tensor], torch.optim.Optimizer] | None = None
        self._global_info: RoundInfo | None = None
        # the global state a global round works on: the leader's own, or during an overlapped
        # round a private copy (so checkpoints and the training thread never see it half-updated)
        self._active_global: tuple[list[torch.Tensor], torch.optim.Optimizer] | None = None
        self.intra_bytes = self.inter_bytes = 0
        #: the island rounds' cadence: every island_steps, or island_seconds counted from the
        #: last global round (so lateness never accumulates); the run's schedule
        #: (:attr:`schedule`) says when it ends
        self.island_schedule = make_schedule(cfg.island_steps, cfg.steps, (
            cfg.island_seconds or cfg.round_seconds) if self.schedule.timed else None, self.agree)
        self.per_global = self.schedule.periods_of(self.island_schedule)  # island rounds each

    # --- schedule (DiLoCo's step loop calls round_due, then sync) --------------------------------
    @property
    def clock(self) -> Schedule:
        return self.island_schedule

    def round_due(self) -> bool:
        """Whether an island round ends after the step just taken: the next of this global
        period's island rounds."""
        return self.island_schedule.due(self.inner_steps_done,
                                        at=(self.island_round + 1) * self.cfg.island_steps)

    def round_ended(self) -> None:
        self.island_schedule.restart_clock()

    def _global_due(self) -> bool:
        """Whether this island round is the global period's last (every member counts the
        island rounds alike)."""
        return self.island_round + 1 >= self.per_global

    def _last_global(self) -> bool:
        """Whether a global round due now is the run's last (always synchronous). Decided from
        counters every island member shares, so they all agree."""
        return self.schedule.last_period(self.inner_steps_done,
                                         self.outer_step + int(self.awaiting_handoff))

    def rounds_done(self) -> float:
        return self.outer_step + self.island_round / self.per_global

    def at_boundary(self, outcome: StepOutcome) -> bool:
        return outcome.synced

    def joining_round(self) -> StepOutcome | None:
        """A newcomer heals in its first island round (from its island's members)."""
        return None

    # --- the island round ----------------------------------------------------------------------
    def sync(self) -> StepOutcome:
        """One island round: [repeated hand-off] -> island average -> [hand-off of the overlapped
        global round] -> [synchronous global round -> hand-off] -> commit -> apply -> [start an
        overlapped global round]."""
        if self.before_round is not None:
            self.before_round()
        start = time.perf_counter()
        sync_outcome: GlobalOutcome | None = None  # the leader's synchronous round, run once
        staged, committed, healed = None, False, False
        for attempt in range(self.cfg.round_retries + 1):
            info = self.collective.begin_round(timeout=self._newcomer_wait)
            info, healed = healed_in_any_try(info, healed)
            self.last_round = info
            is_global = self._global_due()
            synchronous = is_global and (not self.overlap or self._last_global())
            before = self.collective.stats.bytes_sent
            staged = self._exchange(info)
            if synchronous:
                if self.leader and sync_outcome is None:
                    self.intra_bytes += self.collective.stats.bytes_sent - before
                    sync_outcome = self._global_round(staged.island, staged.tokens)
                    before = self.collective.stats.bytes_sent
                staged.handoff = self._handoff(with_anchor=False, outcome=sync_outcome)
                staged.handoffs.append(staged.handoff)
                if staged.handoff["present"] and staged.handoff["committed"]:
                    staged.island = [g.clone() for g in staged.handoff["global"]]
                    staged.tokens = 0.0
            ok = self.collective.commit()
            self.exchange.settle(staged.result, info.round_id, ok)
            self.intra_bytes += self.collective.stats.bytes_sent - before
            if ok:
                self._apply(staged)
                committed = True
                self._newcomer_wait = None  # in: the usual wait from now on
                break
            self.collective.stats.failed_rounds += 1
            if synchronous:  # the leader may have moved θ_g: members must hear about it
                self.handoff_pending = True
        if committed and is_global and not synchronous and not self.awaiting_handoff:
            self._start_overlapped()
        self.island_round = 0 if is_global else self.island_round + 1
        if is_global:
            self.island_schedule.start_period()
        if committed:
            self.tokens_since_sync = 0
        assert staged is not None
        seconds = time.perf_counter() - start
        delivered = [h for h in staged.handoffs if h["present"]]
        if not staged.handoffs:
            return StepOutcome(outer_step=self.outer_step, comm_seconds=seconds,
                               world_size=info.world_size, island_round=True)
        last = delivered[-1] if delivered else None
        world = int(last["world"]) if last else 1
        self.last_round = RoundInfo(
            round_id=self.outer_step, rank=self._rank(info), world_size=world, healed=info.healed)
        return StepOutcome(synced=True, committed=bool(committed and last and last["committed"]),
                           outer_step=self.outer_step, world_size=world, comm_seconds=seconds,
                           rejected=len(staged.result.rejected))

    def _exchange(self, info: RoundInfo) -> _Staged:
        """The island's collectives up to (not including) a synchronous global round."""
        anchor = self.anchor
        pending = self._handoff(with_anchor=True) if self.handoff_pending else None
        if pending is not None and pending["present"]:
            anchor = pending["anchor"]
        deltas = self.pseudo_gradient(self.params, start=self.anchor)
        weight = 0.0 if info.healed else float(self.tokens_since_sync)
        result = self.exchange.average(deltas, weight, info.round_id)
        self.last_exchange = result
        if result.total_weight > 0:
            island = [a - result.tensors[n].to(a.dtype) for n, a in zip(self.names, anchor)]
        else:
            island = [a.clone() for a in anchor]
        staged = _Staged(info, result, island, self.island_tokens + result.total_weight, pending)
        if self.awaiting_handoff:
            staged.overlapped = self._handoff(with_anchor=False,
                                              outcome=self._join() if self.leader else None)
            staged.handoffs.append(staged.overlapped)
            if staged.overlapped["present"] and staged.overlapped["committed"]:
                assert self.snapshot is not None
                staged.island = [g + (q - s) for g, q, s in
                                 zip(staged.overlapped["global"], staged.island, self.snapshot)]
                staged.tokens -= self.snapshot_tokens  # those went into the global round
        return staged

    def _apply(self, staged: _Staged) -> None:
        if staged.pending is not None and staged.pending["present"]:
            self._adopt_global(staged.pending)
            self.handoff_pending = False
        if staged.overlapped is not None and staged.overlapped["present"]:
            self._adopt_global(staged.overlapped)
            self.awaiting_handoff, self.snapshot = False, None
            self._inflight_result = None
        if staged.handoff is not None:
            if staged.handoff["present"]:
                self._adopt_global(staged.handoff)
            else:  # the leader was not in this round: hear from it next time
                self.handoff_pending = True
        with torch.no_grad():
            for p, q in zip(self.params, staged.island):
                p.copy_(q)
        self.anchor = [q.clone() for q in staged.island]
        self.island_tokens = staged.tokens

    def _rank(self, island_info: RoundInfo) -> int:
        """0 for exactly one worker of the run (the leader ranked first globally): it evaluates."""
        if self.leader and self._global_info is not None:
            return self._global_info.rank
        return 1 + island_info.rank

    # --- the slow link (leaders) -------------------------------------------------------------
    def _global_round(self, island_params: list[torch.Tensor], weight: float,
                      target: tuple[list[torch.Tensor], torch.optim.Optimizer] | None = None,
                      step: int | None = None) -> GlobalOutcome:
        """DiLoCo among island leaders on ``target`` (default: the leader's own global state).
        Touches nothing else but the global collective, so it may run in a background thread;
        the outer step counter travels in the result."""
        exchange = self.global_exchange
        assert exchange is not None
        collective = exchange.collective
        params, opt = target or (self.global_params, self.outer_opt)
        step = self.outer_step if step is None else step
        before = collective.stats.bytes_sent
        outcome: GlobalOutcome = (False, 1, step)
        self._active_global = (params, opt)
        healed = False
        try:
            for attempt in range(self.cfg.round_retries + 1):
                info = collective.begin_round()  # a leader behind the others heals here
                info, healed = healed_in_any_try(info, healed)
                self._global_info = info
                tensors = self.pseudo_gradient(island_params, start=params)
                result = exchange.average(tensors, 0.0 if info.healed else weight, info.round_id)
                ok = collective.commit()
                exchange.settle(result, info.round_id, ok)
                if ok:
                    self.outer_update(result, params, opt)
                    outcome = (True, info.world_size, info.round_id + 1)
                    break
                outcome = (False, info.world_size, step)
                collective.stats.failed_rounds += 1
        finally:
            self._active_global = None
            self.inter_bytes += collective.stats.bytes_sent - before
        return outcome

    def _start_overlapped(self) -> None:
        """Snapshot the island and, on the leader, start its global round in the background."""
        self.snapshot = [a.clone() for a in self.anchor]
        self.snapshot_tokens = self.island_tokens
        self.awaiting_handoff = True
        if not self.leader:
            return
        self._inflight_result, self._inflight_error = None, None
        snapshot, tokens, step = self.snapshot, self.snapshot_tokens, self.outer_step
        params = [g.detach().clone() for g in self.global_params]
        opt = self.make_outer_optimizer(params)
        self._copy_outer_state(self.outer_opt, opt)
        self._inflight_target = (params, opt)

        def run() -> None:
            try:
                self._inflight_result = self._global_round(snapshot, tokens, (params, opt), step)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
                self._inflight_error = exc

        self._inflight = threading.Thread(target=run, name="global-round", daemon=True)
        self._inflight.start()

    def _join(self) -> GlobalOutcome:
        """The overlapped global round's outcome (waits for it if the slow link is still busy);
        its global state becomes the leader's own, ready to be handed off."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None
            if self._inflight_error is not None:
                error, self._inflight_error = self._inflight_error, None
                raise error
            params, opt = self._inflight_target
            with torch.no_grad():
                for g, new in zip(self.global_params, params):
                    g.copy_(new)
            self._copy_outer_state(opt, self.outer_opt)
        return self._inflight_result or (False, 1, self.outer_step)

    @staticmethod
    def _copy_outer_state(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
        """The outer optimizer's state (momentum) from one global copy's optimizer to another's."""
        load_optimizer_state(target, optimizer_state(source, "outer"), "outer")

    # --- the hand-off over the island's fast link ---------------------------------------------
    def _momentum(self) -> list[torch.Tensor]:
        return [self.outer_opt.state[g].get("momentum_buffer", torch.zeros_like(g))
                for g in self.global_params]

    def _handoff(self, with_anchor: bool, outcome: GlobalOutcome | None = None) -> dict:
        """The leader's global state (and anchor) to every member (members weigh 0)."""
        blocks = [self.global_params, self._momentum()] + ([self.anchor] if with_anchor else [])
        if self.leader:
            committed, world, step = outcome if outcome is not None else (False, 1,
                                                                          self.outer_step)
            header = torch.tensor([1.0, float(committed), float(step), float(world)],
                                  device=self.global_params[0].device)
            flat = torch.cat([header] + [_flat(b) for b in blocks])
        else:
            size = _HEADER + sum(t.numel() for b in blocks for t in b)
            flat = torch.zeros(size, dtype=torch.float32, device=self.global_params[0].device)
        round_id = self.last_round.round_id if self.last_round is not None else 0
        result = self.handoff_exchange.average({"handoff": flat}, float(self.leader), round_id)
        flat = result.tensors.get("handoff", torch.zeros_like(flat))  # no leader: not present
        present = flat[0].item() == 1.0
        out = {"present": present, "committed": present and flat[1].item() == 1.0,
               "outer_step": int(flat[2].item()), "world": flat[3].item()}
        offset = _HEADER
        for key, like in zip(("global", "momentum", "anchor"), blocks):
            n = sum(t.numel() for t in like)
            out[key] = _unflat(flat[offset : offset + n], like)
            offset += n
        return out

    def _adopt_global(self, received: dict) -> None:
        with torch.no_grad():
            for g, new in zip(self.global_params, received["global"]):
                g.copy_(new)
            if self.cfg.outer_momentum > 0:
                for g, buf in zip(self.global_params, received["momentum"]):
                    self.outer_opt.state[g]["momentum_buffer"] = buf
        self.outer_step = received["outer_step"]

    def finish(self) -> StepOutcome | None:
        """A run stopped early (Ctrl-C) may leave an overlapped round in flight: let it end."""
        if self._inflight is not None:
            # bounded: the round ends by itself within a quorum wait and a collective's timeout
            self._inflight.join(timeout=2 * self.collective.quorum_timeout)
        return None

    # --- traffic --------------------------------------------------------------------------------
    def traffic(self) -> dict[str, int]:
        """Bytes this worker sent inside its island and across islands (leaders only)."""
        return {"intra_bytes": int(self.intra_bytes), "inter_bytes": int(self.inter_bytes)}

    # --- state ---------------------------------------------------------------------------------
    def _global_state(self, target: tuple[list[torch.Tensor], torch.optim.Optimizer] | None = None,
                      ) -> TensorState:
        state = self.global_state(*(target or ()))
        state["counter.outer_step"] = torch.tensor(self.outer_step)
        return state

    def fingerprint(self) -> str:
        """Hash of the global state (θ_g, outer momentum, outer step): equal on every replica of
        every island after a committed outer round, overlapped or not."""
        return state_digest(self._global_state()).hex()[:16]

    def shared_state(self) -> TensorState:
        state = self._global_state()
        state.update({f"island.{n}": a.detach().clone() for n, a in zip(self.names, self.anchor)})
        state["schedule.inner_steps"] = torch.tensor(self.inner_steps_done)
        state["schedule.island_round"] = torch.tensor(self.island_round)
        state["schedule.island_tokens"] = torch.tensor(self.island_tokens, dtype=torch.float64)
        state["schedule.handoff_pending"] = torch.tensor(int(self.handoff_pending))
        state["schedule.awaiting_handoff"] = torch.tensor(int(self.awaiting_handoff))
        state["schedule.snapshot_tokens"] = torch.tensor(self.snapshot_tokens, dtype=torch.float64)
        if self.snapshot is not None:
            state.update({f"snapshot.{n}": s.clone() for n, s in zip(self.names, self.snapshot)})
        return state

    def load_shared_state(self, state: TensorState) -> None:
        """Adopt an island peer's committed state (island-level healing, resume). An overlapped
        global round in flight when the state was taken is not carried over: its hand-off
        arrives as 'not committed', and the island keeps its own progress."""
        self.load_global_state(state)
        self.outer_step = int(state["counter.outer_step"])
        with torch.no_grad():
            for n, a, p in zip(self.names, self.anchor, self.params):
                a.copy_(state[f"island.{n}"])
                p.copy_(a)
        self.inner_steps_done = int(state["schedule.inner_steps"])
        self.island_round = int(state["schedule.island_round"])
        self.island_tokens = float(state["schedule.island_tokens"])
        self.handoff_pending = bool(int(state["schedule.handoff_pending"]))
        self.awaiting_handoff = bool(int(state.get("schedule.awaiting_handoff", torch.tensor(0))))
        self.snapshot_tokens = float(state.get("schedule.snapshot_tokens", torch.tensor(0.0)))
        self.snapshot = ([state[f"snapshot.{n}"].clone() for n in self.names]
                         if self.awaiting_handoff else None)
        self.tokens_since_sync = 0

    def _export_global(self) -> TensorState:
        """What a lagging leader receives from another island's leader: global state only (its
        own island's anchor stays, so its members remain in step with it)."""
        return with_digest(self._global_state(self._active_global))

    def _import_global(self, state: TensorState) -> None:
        # into the state the running global round works on; members adopt it with the round's
        # hand-off, which always carries the leader's global state
        self.load_global_state(verified(state), *(self._active_global or ()))

    def state_dict(self) -> TensorState:
        state = super().state_dict()  # DiLoCo's: shared state, worker-private state, tokens
        if self.global_exchange is not None:
            state.update({f"global_{k}": v for k, v in
                          self.global_exchange.compressor.state_dict().items()})
        state["counter.intra_bytes"] = torch.tensor(self.intra_bytes)
        state["counter.inter_bytes"] = torch.tensor(self.inter_bytes)
        return state

    def load_state_dict(self, state: TensorState) -> None:
        super().load_state_dict(state)
        if self.global_exchange is not None:
            self.global_exchange.compressor.load_state_dict(
                {k.removeprefix("global_"): v for k, v in state.items()
                 if k.startswith("global_residual.")})
        self.intra_bytes = int(state["counter.intra_bytes"])
        self.inter_bytes = int(state["counter.inter_bytes"])
