"""Framed byte messages between peers over libp2p streams, and state snapshots with their hash.

A snapshot is served in chunks with a manifest (whole-blob SHA-256 plus one SHA-256 per chunk),
so a newcomer can fetch different chunks from different up-to-date peers at once and still check
every byte: a chunk that fails its digest is fetched again from another peer.

A frame is hivemind's own length-prefixed raw data (``P2P.send_raw_data``); a message is a small
msgpack header frame followed by zero or more body frames. That keeps arbitrary payloads (encoded
updates, safetensors state) as bytes end to end, with no protobuf re-encoding.
"""

from __future__ import annotations

import asyncio

import msgpack
from hivemind.p2p import P2P

from farlink.state.snapshot import (STATE_CHUNK_BYTES, chunk_digests, chunk_ok,  # noqa: F401
                                    pack_state, unpack_state)


async def send_message(writer: asyncio.StreamWriter, header: dict, bodies: list[bytes]) -> int:
    """Write header + bodies; returns body bytes written (what byte accounting counts)."""
    await P2P.send_raw_data(msgpack.packb({**header, "n": len(bodies)}), writer)
    sent = 0
    for body in bodies:
        await P2P.send_raw_data(body, writer)
        sent += len(body)
    return sent


#: a message header is a small msgpack map (round, rank, digests, a slice's place)
MAX_HEADER_BYTES = 64 << 10
#: bodies of one message: a payload's slices or one state chunk (a handful)
MAX_BODIES = 64
#: the largest body a member may send when its handler names no tighter limit
MAX_BODY_BYTES = 1 << 30


class FrameRefused(ValueError):
    """A frame or message larger than the receiver allows: refused before it is read."""


async def recv_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    """One length-prefixed frame, refused unread when its prefix announces more than ``limit``
    bytes: ``P2P.receive_raw_data`` would buffer whatever length a peer announces, so a peer
    (a stranger, before any membership check) could grow this process by gigabytes."""
    prefix = await reader.readexactly(P2P.HEADER_LEN)
    size = int.from_bytes(prefix, P2P.BYTEORDER)
    if size > limit:
        raise FrameRefused(f"a frame of {size} bytes (this stream takes at most {limit})")
    return await reader.readexactly(size)


async def recv_message(reader: asyncio.StreamReader, max_body: int = MAX_BODY_BYTES,
                       max_bodies: int = MAX_BODIES, max_header: int = MAX_HEADER_BYTES
                       ) -> tuple[dict, list[bytes]]:
    """A header map and its bodies, each frame bounded before it is read (see
    :func:`recv_frame`), and at most ``max_bodies`` bodies; :class:`FrameRefused` otherwise."""
    header = msgpack.unpackb(await recv_frame(reader, max_header))
    if not isinstance(header, dict):
        raise FrameRefused("a message header that is not a map")
    n = header.get("n", 0)
    if not isinstance(n, int) or not 0 <= n <= max_bodies:
        raise FrameRefused(f"a message of {n!r} bodies (this stream takes at most {max_bodies})")
    bodies = [await recv_frame(reader, max_body) for _ in range(n)]
    return header, bodies


