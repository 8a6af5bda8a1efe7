"""Group state mixing (Moshpit averaging): the layer that lets an elementwise algorithm run in
groups smaller than the swarm (hivemind ``--group-size``).

Groups of one round commit the same round number with different committed states, and averaging
updates alone would keep those states apart for good (each member steps its own state). So, as
Moshpit averaging does, the members also average their committed state before the round's update
lands. For an algorithm whose update is linear in (committed state, averaged update), e.g. DiLoCo's
outer Nesterov step in (θ_g, momentum, Δ), this equals averaging the states the members step
into. The group then holds one state; groups mix over rounds, and the last round, one group of
the whole swarm, ends the run on one model.

Which state an algorithm mixes is its own choice (DiLoCo: θ_g and the outer optimizer's state;
Streaming DiLoCo: the fragment's part of them); this module only averages named tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from farlink.comm.base import Collective, RoundInfo
from farlink.sync.digest import state_digest

log = logging.getLogger(__name__)

TensorState = dict[str, torch.Tensor]


class GroupMixing:
    """Averages a committed state over the members of a round's group. Members gather each other's
    state as bytes and average them in rank order, so every member computes the same bits
    (hivemind's butterfly all-reduce does not). Only when their fingerprints differ: one round trip
    of 8 bytes otherwise. ``agree`` makes the ranks of a replica group take one branch."""

    def __init__(self, collective: Collective, agree: Callable[[bool], bool]) -> None:
        self.collective = collective
        self.agree = agree
        self.mixed_rounds = 0  # rounds whose group averaged differing committed states

    def applies(self, info: RoundInfo) -> bool:
        """Whether this round's group may hold differing states: groups smaller than the
        swarm, of two members or more."""
        return self.collective.partial_groups and info.world_size >= 2 and not info.skipped

    def mix(self, state: TensorState, info: RoundInfo) -> TensorState | None:
        """The group's mean of ``state`` (its floating tensors; the rest as they are), or None
        when there is nothing to mix (one state in the group, or no partial groups)."""
        if not self.applies(info):
            return None
        # in name order: an optimizer that loaded its state (a healed peer) lists it in
        # another order than one that stepped, and the members' bytes must line up
        names = sorted(k for k, v in state.items() if v.is_floating_point())
        digest = state_digest({k: state[k] for k in names})[:8]
        digests = self.collective.all_gather_bytes(digest)
        if not self.agree(len(set(digests)) > 1):  # a replica group's ranks take the same branch
            return None
        flat = torch.cat([state[k].detach().float().reshape(-1).cpu() for k in names])
        payloads = self.collective.all_gather_bytes(flat.numpy().tobytes())
        if any(len(p) != flat.numel() * 4 for p in payloads):
            log.warning("round %d: a groupmate's committed state did not arrive whole; the "
                        "round's states are not averaged", info.round_id)
            return None  # a member sent nothing: the collective fails the round
        states = [torch.frombuffer(bytearray(p), dtype=torch.float32) for p in payloads]
        finite = [i for i, st in enumerate(states) if torch.isfinite(st).all()]
        if len(finite) < len(states):  # a member's NaN/Inf state must not reach the others
            left_out = [info.peers[i] if i < len(info.peers) else f"member {i}"
                        for i in range(len(states)) if i not in finite]
            log.warning("round %d: the committed state of %s is not finite; it is left out "
                        "of the group's average%s", info.round_id, ", ".join(left_out),
                        "" if finite else " (no member's is finite: nothing is averaged)")
            if not finite:
                return None
        mean = torch.stack([states[i] for i in finite]).mean(dim=0)
        mixed, offset = dict(state), 0
        for k in names:
            n = state[k].numel()
            mixed[k] = mean[offset:offset + n].reshape(state[k].shape).to(
                dtype=state[k].dtype, device=state[k].device)
            offset += n
        self.mixed_rounds += 1
        log.warning("round %d: %d distinct committed states in a group of %d; averaging them",
                    info.round_id, len(set(digests)), info.world_size)
        return mixed
