"""Time and bytes of one collective under the alpha-beta model (latency + size / bandwidth).

These are the collectives farlink's backends really run: the torchft backend uses a ring
all-reduce (reduce-scatter then all-gather: 2(n-1) sequential hops, each moving S/n), gathered
updates (every codec but plain fp32, DeMo, robust aggregation, signed updates) use a ring
all-gather of every peer's encoded message ((n-1) hops, each moving one payload, after a first
all-gather of the message lengths), and the hivemind backend uses a butterfly all-reduce (every
peer owns one shard; in one phase it sends the other n-1 shards of its tensor to their owners and
in a second phase sends its averaged shard back to everyone, all in parallel: two latency terms
instead of 2(n-1)) and direct sends for a gather. Byte counts agree with
``farlink.comm.base.ring_allreduce_bytes`` / ``ring_allgather_bytes``.

A hop of torchft's Gloo transport costs a round trip, not a one-way delay: Gloo sends an
unbound buffer only after the receiver has announced a matching receive, and in a ring each
receive is posted when the previous hop finishes, so every hop waits for the "ready" notice to
cross the link before its data can. :func:`hop_latency` encodes that per backend.

Bandwidth is in bits per second, sizes in bytes, times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from farlink.plan.tables import PlanInputError

MSS_BYTES = 1460  # TCP payload per segment on a 1500-byte MTU path
MATHIS_C = math.sqrt(1.5)  # constant of the Mathis et al. (1997) throughput bound

BACKENDS = ("torchft", "hivemind", "inprocess")


@dataclass(frozen=True)
class CollectiveCost:
    """What one worker puts on the wire and how long the collective takes."""

    bytes_sent: float
    seconds: float


def tcp_throughput_bps(bandwidth_bps: float, rtt_s: float, loss: float) -> float:
    """Link rate capped by the loss-limited throughput of one TCP flow (Mathis et al. 1997).

    A lossy long-RTT path cannot fill its pipe however wide it is; with no loss (or no delay) the
    link rate is what a flow gets.
    """
    if loss <= 0 or rtt_s <= 0:
        return bandwidth_bps
    return min(bandwidth_bps, 8 * MSS_BYTES * MATHIS_C / (rtt_s * math.sqrt(loss)))


def ring_allreduce(size_bytes: float, n: int, bandwidth_bps: float, latency_s: float) -> CollectiveCost:
    """2(n-1)/n * S / B + 2(n-1) * latency; nothing to do alone."""
    _check(size_bytes, n, bandwidth_bps, latency_s)
    if n <= 1:
        return CollectiveCost(0.0, 0.0)
    sent = 2 * (n - 1) / n * size_bytes
    return CollectiveCost(sent, 8 * sent / bandwidth_bps + 2 * (n - 1) * latency_s)


def ring_allgather(size_bytes: float, n: int, bandwidth_bps: float, latency_s: float) -> CollectiveCost:
    """(n-1) * S / B + (n-1) * latency, where S is one peer's contribution."""
    _check(size_bytes, n, bandwidth_bps, latency_s)
    if n <= 1:
        return CollectiveCost(0.0, 0.0)
    sent = (n - 1) * size_bytes
    return CollectiveCost(sent, 8 * sent / bandwidth_bps + (n - 1) * latency_s)


def butterfly_allreduce(size_bytes: float, n: int, bandwidth_bps: float,
                        latency_s: float) -> CollectiveCost:
    """Each peer sends (n-1)/n * S twice, in parallel with everyone else: two latency terms."""
    _check(size_bytes, n, bandwidth_bps, latency_s)
    if n <= 1:
        return CollectiveCost(0.0, 0.0)
    sent = 2 * (n - 1) / n * size_bytes
    return CollectiveCost(sent, 8 * sent / bandwidth_bps + 2 * latency_s)


def hop_latency(backend: str, latency_s: float) -> float:
    """Latency one sequential hop of ``backend``'s collectives pays on a link of one-way
    ``latency_s``: a round trip on Gloo (receiver-ready handshake), one way on hivemind and in
    in-process emulation (``inprocess``: peers as threads, each collective held for its hops'
    latencies plus its bytes over the link, with torchft's ring hop counts)."""
    if backend == "torchft":
        return 2 * latency_s
    if backend in ("hivemind", "inprocess"):
        return latency_s
    raise PlanInputError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def allreduce(backend: str, size_bytes: float, n: int, bandwidth_bps: float,
              latency_s: float) -> CollectiveCost:
    """The all-reduce a backend runs: ring for torchft, butterfly for hivemind."""
    hop = hop_latency(backend, latency_s)
    if backend in ("torchft", "inprocess"):
        return ring_allreduce(size_bytes, n, bandwidth_bps, hop)
    return butterfly_allreduce(size_bytes, n, bandwidth_bps, hop)


def compressed_allreduce(backend: str, size_bytes: float, n: int, bandwidth_bps: float,
                         latency_s: float, partial_gathers: int = 0) -> CollectiveCost:
    """farlink's compressed all-reduce of a dense encoded payload of ``size_bytes``: encoded
    shards to their owners and the re-encoded aggregates back (two all-to-alls, each member
    sending ``n-1`` shards of ``S/n`` with a header: ``2 (n-1)/n x S`` as a ring all-reduce),
    and two all-gathers of control bytes (every owner's screening report, every member's digests
    of the returned shards). Latency, as each backend runs these: torchft: an all-to-all is two
    Gloo alltoalls (lengths, data), every pair at once, one round trip each; an all-gather of
    bytes is two ring all-gathers (lengths, data) of ``n-1`` hops each. hivemind: each is one
    push to every member at once (request and response: 2 hops). In-process emulation: one hop
    per all-to-all, ``n-1`` per all-gather. A robust rule that needs whole-update geometry adds
    ``partial_gathers`` all-gathers of a few bytes per member (centered clipping: 4 by default).
    Bytes are the shards' (``2 (n-1)/n x S``); the
    headers and control messages add ``(n-1) (380 + 25 n)`` bytes or so (about 1% of a 369k-
    parameter int8 payload at 8 members, less for larger models), which this leaves out."""
    _check(size_bytes, n, bandwidth_bps, latency_s)
    if n <= 1:
        return CollectiveCost(0.0, 0.0)
    hop = hop_latency(backend, latency_s)
    gathers = 2 + partial_gathers
    hops = {"torchft": 2 * 2 + gathers * 2 * (n - 1),
            "hivemind": (2 + gathers) * 2}.get(backend, 2 + gathers * (n - 1))
    sent = 2 * (n - 1) / n * size_bytes
    return CollectiveCost(sent, 8 * sent / bandwidth_bps + hops * hop)


LENGTH_BYTES = 8  # the int64 message length gathered before a variable-size payload
SLOT_DIGEST_BYTES = 8  # farlink.robust.equivocation.SLOT_DIGEST: a received slot's digest


def allgather_bytes(backend: str, size_bytes: float, n: int, bandwidth_bps: float,
                    latency_s: float) -> CollectiveCost:
    """Gather one variable-size message from every peer, as ``all_gather_bytes`` does.

    torchft: a ring all-gather of the lengths, then one of the (padded) payloads. hivemind: each
    peer sends its message to every other peer directly, all at once (one request/response).
    """
    hop = hop_latency(backend, latency_s)
    if backend == "inprocess":
        return ring_allgather(size_bytes, n, bandwidth_bps, hop)
    if backend == "torchft":
        lengths = ring_allgather(LENGTH_BYTES, n, bandwidth_bps, hop)
        payload = ring_allgather(size_bytes, n, bandwidth_bps, hop)
        return CollectiveCost(lengths.bytes_sent + payload.bytes_sent,
                              lengths.seconds + payload.seconds)
    _check(size_bytes, n, bandwidth_bps, latency_s)
    direct = ring_allgather(size_bytes, n, bandwidth_bps, 0.0)  # same bytes, sent at once
    return CollectiveCost(direct.bytes_sent, direct.seconds + (2 * hop if n > 1 else 0.0))


def gathered_exchange(backend: str, size_bytes: float, n: int, bandwidth_bps: float,
                      latency_s: float) -> CollectiveCost:
    """farlink's gathered exchange (:mod:`farlink.sync.exchange`) of one ``size_bytes`` message
    per member: the messages all-gathered, then every member's digests of the slots it received
    (``SLOT_DIGEST_BYTES`` each) all-gathered too and compared, so a member that sent different
    bytes to different members fails the round everywhere (equivocation). The second gather is
    small but pays the same hops as the first: on torchft another ``2 (n-1)`` round trips."""
    message = allgather_bytes(backend, size_bytes, n, bandwidth_bps, latency_s)
    if n <= 1:
        return message
    digests = allgather_bytes(backend, n * SLOT_DIGEST_BYTES, n, bandwidth_bps, latency_s)
    return CollectiveCost(message.bytes_sent + digests.bytes_sent,
                          message.seconds + digests.seconds)


def heal_check(backend: str, n: int, latency_s: float) -> CollectiveCost:
    """The control exchange torchft's backend runs after every quorum, before the round's data
    (:mod:`farlink.comm.torchft_backend`: each member announces its step and state fingerprint,
    so a heal is adopted only when the participants back it): one ``all_gather_bytes`` of an
    announcement, two ring all-gathers (lengths, then the bytes) of ``n-1`` Gloo hops each. Its
    ``2 (n-1)`` round trips are what it costs (0.48 s for 4 members 40 ms apart); its bytes, about
    a hundred per member and left out of the round's byte count by the backend, are left out here
    too (under 1 ms at 10 Mbit/s). Other backends run no such check."""
    if backend != "torchft" or n <= 1:
        return CollectiveCost(0.0, 0.0)
    return CollectiveCost(0.0, 2 * (n - 1) * hop_latency(backend, latency_s))


def _check(size_bytes: float, n: int, bandwidth_bps: float, latency_s: float) -> None:
    if size_bytes < 0 or n < 1 or bandwidth_bps <= 0 or latency_s < 0:
        raise PlanInputError(
            f"collective needs size >= 0, n >= 1, bandwidth > 0, latency >= 0; got "
            f"size={size_bytes}, n={n}, bandwidth={bandwidth_bps}, latency={latency_s}"
        )
