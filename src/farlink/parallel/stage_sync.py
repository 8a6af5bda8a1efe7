"""The peers of each pipeline stage as the members of a Collective: stage averaging is the run's
own algorithm through its own Exchange.

SWARM-style pipelines run P replicas of the pipeline side by side: the P peers of one stage
each train the same blocks on different micro-batches, with their own AdamW, and drift apart.
Every ``inner_steps`` steps the peers of each stage meet in one round of the run's algorithm
(DiLoCo, local SGD, SparseLoCo: those with ``Capabilities.stage_averaging``), exactly as the
workers of a run without stages do: each peer is one member, an algorithm built around a copy
of the stage's module (:class:`StageMember`), whose :class:`~farlink.sync.exchange.Exchange`
sends its update with the run's codec (and error feedback), signs it (``--auth``), screens and
aggregates the members' updates (robust rules, emulated attackers), as in any run. Adam moments
stay with each peer, as DiLoCo's inner optimizers do.

What carries it: the pipeline trainer. It already talks to every stage peer, so a stage's
members live in the trainer's process as the members of a
:class:`~farlink.comm.inprocess.DrivenGroup`; for each round the trainer fetches every live
peer's weights into its member, forms the round of the members whose weights arrived usable,
runs the round in threads and loads each member's new weights back into its peer (the
``averaging`` bytes of the trainer's traffic: 2 x the stage's weights per peer and round). The
members' collectives count what they send each other (:attr:`StageAveraging.exchange_bytes`,
what the stage's peers would send if they met directly), which is where the codec shows.

A peer whose weights hold NaN/inf, or other names or shapes than θ, is left out of the round
(:func:`~farlink.parallel.answers.usable_states`; named in ``left_out`` and the log) and takes
the stage's new θ: one broken peer cannot carry NaN into every peer of its stage. A member
that missed rounds (its peer was left out) is healed from the others at its next round's
start, as a lagging worker of any backend is; its update then counts for nothing that round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from farlink.comm.inprocess import DrivenGroup
from farlink.parallel.answers import usable_states
from farlink.sync.base import SyncAlgorithm

#: how the trainer reaches stage peers: (stage) -> live peers; (peer) -> its weights, or None
#: when it failed; (peer, weights) -> loads them
Peers = Callable[[int], list[str]]
Fetch = Callable[[str], dict[str, torch.Tensor] | None]
Store = Callable[[str, dict[str, torch.Tensor]], None]

log = logging.getLogger(__name__)


@dataclass
class StageMember:
    """One stage peer in its stage's rounds: the algorithm built around a copy of the stage's
    module, on member ``i``'s collective of the stage's group (``i``: its place in
    :attr:`Stage.members`)."""

    peer: str  # the stage peer's address
    algorithm: SyncAlgorithm

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.algorithm.names, self.algorithm.params))

    def theta(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.algorithm.names, self.algorithm.global_params))


@dataclass
class Stage:
    """The members of one stage and the group their collectives belong to."""

    group: DrivenGroup
    members: list[StageMember]


class StageAveraging:
    """Every stage's members; :meth:`sync` is one round in every stage."""

    def __init__(self, stages: list[Stage], peers: Peers, fetch: Fetch, store: Store) -> None:
        self.stages, self.peers, self.fetch, self.store = stages, peers, fetch, store
        self.rounds = 0
        self.left_out: list[tuple[int, str, str]] = []  # the last round's (stage, peer, why)

    def leader(self, stage: int) -> StageMember:
        """The member of ``stage`` with the most committed rounds: it holds the stage's θ."""
        return max(self.stages[stage].members, key=lambda m: m.algorithm.outer_step)

    @property
    def globals(self) -> list[dict[str, torch.Tensor]]:
        """Every stage's shared θ, named as the stage module names its parameters."""
        return [self.leader(s).theta() for s in range(len(self.stages))]

    @property
    def exchange_bytes(self) -> int:
        """What the stages' members sent each other in their exchanges, all rounds."""
        return sum(m.algorithm.collective.stats.bytes_sent
                   for stage in self.stages for m in stage.members)

    def sync(self, tokens: int) -> None:
        """One round in every stage; ``tokens``: what each peer trained on since the last
        round (each member's update is weighted by it, as a worker's is). A stage whose peers
        all died before the round keeps its θ (the trainer has already stopped: it cannot run
        without them), as does one whose every member is left out (non-finite or misshapen
        weights): those take θ back."""
        self.left_out = []
        for s, stage in enumerate(self.stages):
            self._sync_stage(s, stage, tokens)
        self.rounds += 1

    def _sync_stage(self, s: int, stage: Stage, tokens: int) -> None:
        live = set(self.peers(s))
        theta = self.leader(s).theta()
        fetched = {m.peer: state for m in stage.members if m.peer in live
                   and (state := self.fetch(m.peer)) is not None}
        kept, left_out = usable_states(fetched, theta)
        for peer, why in left_out.items():
            self.left_out.append((s, peer, why))
            log.warning("stage %d outer step leaves out stage peer %s: %s; it continues from "
                        "the stage's new weights", s, peer, why)
        taking_part = [i for i, m in enumerate(stage.members) if m.peer in kept]
        if not taking_part:
            for peer in left_out:
                self.store(peer, theta)
            return
        for i in taking_part:
            member = stage.members[i]
            with torch.no_grad():
                for name, param in member.weights().items():
                    param.copy_(kept[member.peer][name])
            member.algorithm.count_tokens(tokens)
        stage.group.form(taking_part)
        stage.group.run(lambda i: stage.members[i].algorithm.sync())
        theta = self.leader(s).theta()
        for i, member in enumerate(stage.members):
            if member.peer in self.peers(s):  # a failed round leaves a member's own weights
                self.store(member.peer, member.weights() if i in taking_part else theta)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every member's algorithm state (θ, outer optimizer, codec residuals, counters), as
        named tensors."""
        state: dict[str, torch.Tensor] = {"rounds": torch.tensor(self.rounds)}
        for s, stage in enumerate(self.stages):
            for i, member in enumerate(stage.members):
                state.update({f"stage{s}.member{i}.{k}": v
                              for k, v in member.algorithm.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """What :meth:`state_dict` wrote, or a checkpoint of one θ and outer optimizer per
        stage (``stage{S}.global.*``, ``stage{S}.outer.*``: every member takes it)."""
        self.rounds = int(state["rounds"])
        for s, stage in enumerate(self.stages):
            for i, member in enumerate(stage.members):
                algorithm = member.algorithm
                own = f"stage{s}.member{i}."
                if any(k.startswith(own) for k in state):
                    algorithm.load_state_dict({k[len(own):]: v for k, v in state.items()
                                               if k.startswith(own)})
                else:
                    prefix = f"stage{s}."
                    algorithm.load_global_state({k[len(prefix):]: v for k, v in state.items()
                                                 if k.startswith(prefix)})
                    with torch.no_grad():
                        for g, p in zip(algorithm.global_params, algorithm.params):
                            p.copy_(g)
                    algorithm.outer_step = self.rounds
                algorithm.collective.load_committed_step(algorithm.outer_step)
