"""The run's outer algorithm among the peers of each pipeline stage (DiLoCo within a stage).

SWARM-style pipelines run P replicas of the pipeline side by side: the P peers of one stage
each train the same blocks on different micro-batches, with their own AdamW, and drift apart.
Every ``inner_steps`` steps the peers of each stage meet, exactly as DiLoCo's workers do: the
stage's shared parameters θ get the pseudo-gradient Δ = θ - mean(θ_peer) from the run's outer
optimizer (the algorithm's own :meth:`~farlink.sync.diloco.DiLoCo.outer_optimizer_of`: Nesterov
SGD lr 0.7 / momentum 0.9 for DiLoCo, plain averaging for local SGD), and every peer of the
stage continues from the new θ. Adam moments stay with each peer, as DiLoCo's inner optimizers
do.

What carries the averaging: the pipeline trainer. It already talks to every stage peer, so it
gathers the stage's weights, takes the outer step and sends θ back (the ``averaging`` bytes of
its traffic count: 2 x the stage's weights per peer and round). The peers of a stage never talk
to each other, so this needs no Collective backend (torchft's quorum or hivemind's DHT) inside
the stage; the price is that the trainer's link carries every stage's weights each round,
which is what DiLoCo makes rare (once per ``inner_steps`` steps).

A member whose weights hold NaN/inf, or other names or shapes than θ, is left out of the mean
(:func:`~farlink.parallel.answers.usable_states`; named in ``left_out`` and the log) and takes
the new θ like the others: one broken peer cannot carry NaN into every peer of its stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from farlink.parallel.answers import usable_states

from farlink.sync.base import OuterOptimizerFactory, load_optimizer_state, optimizer_state

#: how the trainer reaches stage peers: (stage) -> live peers; (peer) -> its weights, or None
#: when it failed; (peer, weights) -> loads them
Peers = Callable[[int], list[str]]
Fetch = Callable[[str], dict[str, torch.Tensor] | None]
Store = Callable[[str, dict[str, torch.Tensor]], None]

log = logging.getLogger(__name__)


class StageOuterSync:
    """θ and the outer optimizer of every stage; :meth:`sync` is one outer round."""

    def __init__(self, n_stages: int, outer_optimizer: OuterOptimizerFactory, peers: Peers,
                 fetch: Fetch, store: Store) -> None:
        self.peers, self.fetch, self.store = peers, fetch, store
        self.rounds = 0
        self.left_out: list[tuple[int, str, str]] = []  # the last round's (stage, peer, why)
        # every peer of a stage starts from the run's seed, so any live one holds θ_0
        self.globals: list[dict[str, torch.Tensor]] = [
            {n: t.detach().clone() for n, t in fetch(peers(s)[0]).items()}
            for s in range(n_stages)]
        self.optimizers = [outer_optimizer(list(g.values())) for g in self.globals]

    def sync(self) -> None:
        """One outer round in every stage: Δ = θ - mean over the stage's live peers, the outer
        step on θ, θ to every live peer of the stage. A stage whose peers all died before the
        round keeps its θ (the trainer has already stopped: it cannot run without them), as
        does one whose every member is left out (non-finite or misshapen weights): those take
        θ back."""
        self.left_out = []
        for stage, (theta, optimizer) in enumerate(zip(self.globals, self.optimizers)):
            fetched = {peer: state for peer in self.peers(stage)
                       if (state := self.fetch(peer)) is not None}
            kept, left_out = usable_states(fetched, theta)
            for peer, why in left_out.items():
                self.left_out.append((stage, peer, why))
                log.warning("stage %d outer step leaves out stage peer %s: %s; it continues "
                            "from the stage's new weights", stage, peer, why)
            states = list(kept.values())
            if not states:
                for peer in left_out:
                    self.store(peer, theta)
                continue
            for name, param in theta.items():
                mean = torch.stack([state[name] for state in states]).mean(0)
                param.grad = param.detach() - mean
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for peer in self.peers(stage):
                self.store(peer, theta)
        self.rounds += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """θ and the outer optimizers' states of every stage, as named tensors."""
        state: dict[str, torch.Tensor] = {"rounds": torch.tensor(self.rounds)}
        for stage, (theta, optimizer) in enumerate(zip(self.globals, self.optimizers)):
            state.update({f"stage{stage}.global.{n}": t.detach().clone()
                          for n, t in theta.items()})
            state.update(optimizer_state(optimizer, f"stage{stage}.outer"))
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.rounds = int(state["rounds"])
        for stage, (theta, optimizer) in enumerate(zip(self.globals, self.optimizers)):
            with torch.no_grad():
                for name, param in theta.items():
                    param.copy_(state[f"stage{stage}.global.{name}"])
            load_optimizer_state(optimizer, state, f"stage{stage}.outer")
