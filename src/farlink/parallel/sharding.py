"""A replica group: K ranks that train one replica together, FSDP2 or DDP inside, farlink across.

INTELLECT-1's shape: inside a node (a "replica group") the model is sharded over its K ranks with
``fully_shard`` (FSDP2; NCCL on CUDA, Gloo on CPU); across replica groups the outer algorithm runs
through torchft, as a replica group of K ranks, or through hivemind, as one member of each
averaging group (:mod:`farlink.comm.hivemind_replica_group`). Rank ``r`` of one replica group
exchanges only its own shard with rank ``r`` of every other replica group (torchft's cross-group
process groups pair ranks that way; on hivemind rank 0 matchmakes for the replica group and rank r
takes the rank-r view of its group), so the bytes a replica group sends per round are those of one
whole replica, whatever K is.

With ``--sharding ddp`` every rank instead holds the whole replica and the replica group averages
gradients (one packed all-reduce per inner step, as DDP does). Across replica groups each rank then
exchanges its own ``1/K`` slice of every parameter's pseudo-gradient (:meth:`ReplicaGroup.part_of`)
with the same rank of the other replica groups, so cross-replica-group bytes per replica group stay
those of one replica, as with FSDP; after a round the ranks broadcast their updated slices
(:meth:`ReplicaGroup.share_parts`). The alternative, rank 0 alone exchanging and broadcasting,
would leave the other ranks' links idle and put the whole replica through one rank's connection.

A replica group that joins a run under way, or restarts behind the others, heals through torchft as
one process does. torchft pairs rank r of the healing replica group with rank r of the recovery
source (each rank's Manager serves and fetches its own state), and what a rank serves is its
algorithm's state of its own shard as plain tensors: the algorithms keep ``to_local()`` views of
FSDP2's DTensors (:func:`local_shard`) and copies of them, never DTensors, which torchft's
transport would have to rebuild on a device mesh of the receiver's. So each rank receives exactly
its shard and copies it into its local view in place; replica groups must have the same K and
``--sharding`` for rank r's shards to be the same slice. A checkpoint resumed with another K is cut
again instead (:mod:`farlink.parallel.reshard`).

A replica group is started the way torchtitan and torchft examples start one, by ``torchrun``::

    TORCHFT_LIGHTHOUSE=http://host:29510 REPLICA_GROUP_ID=0 \\
        torchrun --nproc-per-node 2 your_train.py

:meth:`ReplicaGroup.from_env` reads RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT (torchrun's)
plus REPLICA_GROUP_ID; :meth:`ReplicaGroup.start` joins the replica group's process group (FSDP2's)
and hosts the replica group's torchft store at rank 0 (a fresh one per start, so a replica group
restarted by ``torchrun --max-restarts`` never reads its previous life's manager address).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter ``fully_shard`` has sharded)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a view sharing storage with a sharded parameter
    (writes to it are what the next forward sees), or ``tensor`` itself when not sharded."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def model_is_sharded(model: nn.Module) -> bool:
    return any(is_sharded(p) for p in model.parameters())


def shard_model(model: nn.Module, blocks: list[nn.Module] | None = None, mesh=None) -> nn.Module:
    """FSDP2 over the replica group's ranks, torchtitan's way: each block its own unit, then the
    root (embeddings, head). ``blocks`` default: the children of the first ``nn.ModuleList`` found
    (a GPT's or a Hugging Face model's layers)."""
    from torch.distributed.fsdp import fully_shard

    if blocks is None:
        blocks = next((list(m) for m in model.modules() if isinstance(m, nn.ModuleList)), [])
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's tensors, gathered from every rank of the replica group (a collective: every
    rank must call it); plain tensors, for export or evaluation."""
    return {name: (t.full_tensor() if is_sharded(t) else t).detach().cpu()
            for name, t in model.state_dict().items()}


@dataclass
class ReplicaGroup:
    """Where this process stands in its replica group: rank ``rank`` of ``size``, in the replica
    group ``replica_index`` of the run; ``store_host``/``store_port``: the replica group's torchft
    store."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    replica_index: int = 0
    store_host: str = "127.0.0.1"
    store_port: int = 0

    @classmethod
    def from_env(cls, replica_index: int | None = None) -> ReplicaGroup:
        """torchrun's variables, and REPLICA_GROUP_ID (torchft's) for the replica's number."""
        if replica_index is None:
            replica_index = int(os.environ.get("REPLICA_GROUP_ID", "0"))
        return cls(rank=int(os.environ.get("RANK", "0")),
                   size=int(os.environ.get("WORLD_SIZE", "1")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   replica_index=replica_index)

    def device(self, requested: str = "auto") -> torch.device:
        """This rank's device: ``cuda:LOCAL_RANK`` on a GPU node (auto), else the one asked for."""
        if requested == "auto":
            requested = "cuda" if torch.cuda.is_available() else "cpu"
        if requested == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device(requested)

    def start(self, host: str = "127.0.0.1", device: torch.device | None = None) -> ReplicaGroup:
        """Join the replica group's process group (NCCL on CUDA, Gloo on CPU) if none is up, and
        host the torchft store of this replica group at rank 0 (its address reaches every rank)."""
        import torch.distributed as dist

        if self.size == 1:
            return self
        if not dist.is_initialized():
            from farlink.comm.torchft_listeners import bind_gloo_to

            bind_gloo_to(host)  # Gloo's pairs listen on host's interface, not the hostname's
            cuda = device is not None and device.type == "cuda"
            if cuda:
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if cuda else "gloo", store=self._rendezvous(),
                                    rank=self.rank, world_size=self.size)
        self._stores: list = []
        self.store_host, self.store_port = self._host_store(host)
        return self

    def _host_store(self, host: str) -> tuple[str, int]:
        """A fresh TCPStore hosted by rank 0 on ``host``; its address, on every rank (a
        collective of the replica group's ranks)."""
        import torch.distributed as dist

        address = [None]
        if self.rank == 0:
            from torch.distributed import TCPStore

            from farlink.comm.torchft_listeners import store_listener

            store = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                             master_listen_fd=store_listener(host))
            self._stores.append(store)  # alive as long as the replica group
            address = [(host, store.port)]
        dist.broadcast_object_list(address, src=0, group=self.gloo_group())
        return address[0]

    def with_own_store(self, host: str = "127.0.0.1") -> ReplicaGroup:
        """The same ranks as a second torchft replica group, around a store of its own.

        A torchft Manager publishes its server's address under fixed keys of its replica
        group's store, so two Managers on one store (hierarchical DiLoCo's island and global
        tiers) would read each other's; each tier gets its own store instead. A collective:
        every rank of the replica group calls it at the same point."""
        if self.size == 1:
            return self
        store_host, store_port = self._host_store(host)
        return replace(self, store_host=store_host, store_port=store_port)

    def _rendezvous(self):
        """The store the replica group's ranks meet in, at MASTER_ADDR/PORT: torchrun's agent's, or
        rank 0's when no agent hosts one (ranks started by hand), under a prefix of this start's
        number, so ranks restarted by ``--max-restarts`` never
        read the addresses their previous life published there."""
        from datetime import timedelta

        from torch.distributed import PrefixStore, TCPStore

        from farlink.comm.torchft_listeners import store_listener

        address, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
        # without an agent's store rank 0 hosts it, on MASTER_ADDR (torch's: every interface)
        hosts = self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        listener = {"master_listen_fd": store_listener(address, port)} if hosts else {}
        store = TCPStore(address, port, self.size, is_master=hosts, wait_for_workers=False,
                         timeout=timedelta(minutes=10), **listener)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return PrefixStore(f"farlink-replica-group/attempt-{attempt}", store)

    def gloo_group(self):
        """A Gloo group over the replica group's ranks for small host-side agreements (NCCL's
        default group cannot carry Python objects on CPU)."""
        import torch.distributed as dist

        if getattr(self, "_gloo", None) is None:
            self._gloo = (dist.group.WORLD if dist.get_backend() == "gloo"
                          else dist.new_group(backend="gloo"))
        return self._gloo

    def checkpoint_group(self):
        """A Gloo group of the replica group's ranks for checkpoint writes alone: a write in a
        background thread runs its collectives there, never interleaved with the training thread's
        on the replica group's other groups. Created at the first call, which every rank makes at
        the same point (the first checkpoint)."""
        import torch.distributed as dist

        if getattr(self, "_checkpoint_group", None) is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return self._checkpoint_group

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the replica group's ranks (e.g. the newest checkpoint all
        hold)."""
        if self.size == 1:
            return value
        return int(self._reduce(value, "MIN", torch.int64))

    def _reduce(self, value: float, op: str, dtype: torch.dtype) -> torch.Tensor:
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=dtype)
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=self.gloo_group())
        return tensor

    def mean(self, value: float) -> float:
        """``value`` averaged over the replica group's ranks (a loss each computed on its rows)."""
        return float(self._reduce(value, "SUM", torch.float64)) / self.size

    def total(self, value: int) -> int:
        """``value`` summed over the replica group's ranks (bytes each sent for its shard)."""
        return int(self._reduce(value, "SUM", torch.int64))

    def agree_any(self, flag: bool) -> bool:
        """True on every rank if it is on any (a stop request that reached one rank)."""
        return bool(self._reduce(int(flag), "MAX", torch.int64))

    def gather(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order, on every rank."""
        import torch.distributed as dist

        out: list[str] = [""] * self.size
        dist.all_gather_object(out, text, group=self.gloo_group())
        return out

    # --- DDP inside the replica group: every rank holds the whole replica -------------------------
    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Average the gradients of a whole (unsharded) replica over the replica group's ranks, as
        DDP does: each rank's loss is the mean over its rows, so the average is the mean over the
        replica group's batch. One all-reduce of the gradients packed together."""
        import torch.distributed as dist

        grads = [p.grad for p in params if p.grad is not None]
        if self.size == 1 or not grads:
            return
        packed = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(packed)
        packed /= self.size
        for grad, part in zip(grads, packed.split([g.numel() for g in grads])):
            grad.copy_(part.view_as(grad))

    def part_of(self, param: torch.Tensor) -> torch.Tensor:
        """The slice of a whole parameter this rank synchronizes across replica groups when the
        replica group runs DDP: its ``1/K`` of the flattened tensor (a view sharing storage, so an
        outer step written to it lands in the parameter). Rank r of every replica group holds the
        same slice."""
        return torch.tensor_split(param.detach().view(-1), self.size)[self.rank]

    def share_parts(self, params: list[torch.Tensor]) -> None:
        """After an outer step each rank updated only its slice (:meth:`part_of`) of every
        parameter: each rank broadcasts its slices (packed, one collective per rank), so every
        rank again holds the whole, identical replica."""
        import torch.distributed as dist

        if self.size == 1:
            return
        for owner in range(self.size):
            views = [torch.tensor_split(p.detach().view(-1), self.size)[owner] for p in params]
            packed = (torch.cat(views) if owner == self.rank
                      else torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype,
                                       device=views[0].device))
            dist.broadcast(packed, src=owner)
            if owner != self.rank:
                for view, part in zip(views, packed.split([v.numel() for v in views])):
                    view.copy_(part)

    def close(self) -> None:
        import torch.distributed as dist

        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


class ReplicaGroupOptions(BaseModel):
    """A replica of several ranks (a :class:`ReplicaGroup`, started by torchrun): how many, and how
    they hold the model. ``RunConfig`` composes these fields (flat flags, ``[replica_group]`` in
    TOML)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    ranks_per_worker: int = Field(
        1, ge=1, description="processes that train one worker's replica together (a replica group, "
        "started by torchrun): the model is sharded over them with FSDP2 (Gloo on CPU, NCCL on "
        "CUDA), each takes batch_size / K rows, and each syncs only its own shard across workers")
    sharding: Literal["fsdp", "ddp"] = Field(
        "fsdp", description="inside a replica group of several ranks: fsdp (each rank holds 1/K of "
        "the model, FSDP2) or ddp (each rank holds the whole replica, gradients averaged over the "
        "replica group; each rank syncs a 1/K slice across replica groups)")
