"""Butterfly all-reduce on hivemind's AllReduceRunner, with the bytes this worker really sends.

In hivemind's butterfly all-reduce peer j reduces a shard of ``e_j`` elements (proportional to its
announced bandwidth; 0 for client-mode peers). Every sender ships each other reducer its shard
(``N - e_me`` elements in all) and, as a reducer, returns the averaged shard to each of the other
``S - 1`` senders. So one worker sends

    itemsize * ((N - e_me) + (S - 1) * e_me)

which is the ring's ``2 (n-1)/n * N * itemsize`` when shards are equal. The runner below counts the
tensor payload of every message it actually writes (protobuf/libp2p framing excluded), and the
backend's tests check that count against this formula.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence

from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.proto import averaging_pb2

MAX_PART_BYTES = 2**19  # hivemind's default streaming part size


class CountingAllReduceRunner(AllReduceRunner):
    """AllReduceRunner that tallies the tensor bytes it sends (inputs to reducers, results back)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bytes_sent = 0
        # As a reducer this worker answers every other sender; its own outputs can be complete
        # while those answers are still being written, so the caller waits for ``all_served``.
        me = self.ordered_peer_ids.index(self.peer_id)
        reduces = self.tensor_part_container.num_parts_by_peer[me] > 0
        self.expected_served = len(self.sender_peer_ids) - 1 if reduces else 0
        self.served = 0
        self.all_served = asyncio.Event()
        if self.expected_served <= 0:
            self.all_served.set()

    def shard_sizes(self) -> list[int]:
        """Elements each peer reduces in this run (as split by hivemind's partitioner)."""
        container = self.tensor_part_container
        return [sum(p.numel() for p, _ in parts) for parts in container._input_parts_by_peer]

    async def _generate_input_for_peer(
        self, peer_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for msg in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += len(msg.tensor_part.buffer)
            yield msg

    async def rpc_aggregate_part(self, stream, context):
        try:
            async for msg in super().rpc_aggregate_part(stream, context):
                yield msg
        finally:
            self.served += 1
            if self.served >= self.expected_served:
                self.all_served.set()

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        async for msg in super()._accumulate_parts_streaming(stream, sender_index):
            self.bytes_sent += len(msg.tensor_part.buffer)
            yield msg


def shard_fractions(total_elements: int, bandwidths: Sequence[float]) -> tuple[float, ...]:
    """Bandwidth-proportional shards (hivemind's LP load balancer); 0 bandwidth = client."""
    shares = load_balance_peers(total_elements, list(bandwidths), 0)
    return tuple(float(s) for s in shares)


def part_size_bytes(total_elements: int, n_reducers: int, itemsize: int = 4) -> int:
    """Parts small enough that shard boundaries fall close to the bandwidth-proportional split.

    hivemind assigns whole parts to reducers; with its default 512 KiB parts a small vector would
    land on a single reducer. Eight parts per reducer keeps shards within 1/8 of a part of target.
    """
    per_part = math.ceil(total_elements / max(1, 8 * n_reducers))
    return int(min(MAX_PART_BYTES, max(itemsize, per_part * itemsize)))


def butterfly_allreduce_bytes(
    total_elements: int, my_shard: int, n_senders: int, itemsize: int = 4
) -> int:
    """Bytes one worker sends in hivemind's butterfly all-reduce (see module docstring)."""
    if n_senders <= 1:
        return 0
    return itemsize * ((total_elements - my_shard) + (n_senders - 1) * my_shard)
