"""Frames are bounded before they are read: a stranger without the run secret who announces a
huge request, or streams one, to a swarm's bootstrap peer is refused after a few KB, and the
peer's memory does not grow; a member frame beyond its limit is refused unread too."""

from __future__ import annotations

import asyncio
import logging
import resource
import time

import pytest

from farlink.comm.hivemind_wire import FrameRefused, recv_message, send_message

ANNOUNCED = 600 << 20  # what the stranger's length prefix says it sends
STREAMED = 256 << 20  # what it tries to push before giving up


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


async def _flood(addr: str, handler: str, seconds: float) -> tuple[int, str]:
    """A stranger's stream: a 600 MB length prefix, then as many bytes as the peer takes."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from farlink.comm.hivemind_net import LOCAL_ONLY, tcp_maddr

    p2p = await P2P.create(initial_peers=[addr], host_maddrs=[tcp_maddr("127.0.0.1", 0)],
                           **LOCAL_ONLY)
    sent, me = 0, str(p2p.peer_id)
    try:
        peer = PeerID.from_base58(Multiaddr(addr).value_for_protocol("p2p"))
        _, reader, writer = await p2p.call_binary_stream_handler(peer, handler)
        writer.write(ANNOUNCED.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        chunk = b"\0" * (1 << 20)
        deadline = time.monotonic() + seconds
        try:
            while sent < STREAMED and time.monotonic() < deadline:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), deadline - time.monotonic())
                sent += len(chunk)
        except (OSError, ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # the peer closed the stream, or stopped reading: what we wanted
        writer.close()
    finally:
        await p2p.shutdown()
    return sent, me


def test_a_strangers_huge_definition_request_is_refused_unread(caplog) -> None:
    from farlink.comm.hivemind_admission import RunAuthorizer
    from farlink.comm.hivemind_net import start_bootstrap_peer
    from farlink.swarm.definition import DEFINITION_HANDLER, DefinitionServer
    from farlink.robust.auth import SharedSecretAuth

    member = SharedSecretAuth("run-secret-for-frames", "bootstrap")
    dht, maddrs = start_bootstrap_peer(authorizer=RunAuthorizer(member))
    server = DefinitionServer(dht, b'{"run": "frames"}', auth=member, auth_kind="secret")
    try:
        before = _rss_bytes()
        with caplog.at_level(logging.WARNING, "farlink.swarm.definition"):
            sent, stranger = asyncio.run(_flood(maddrs[0], DEFINITION_HANDLER, 20.0))
            time.sleep(1.0)
        grown = _rss_bytes() - before
    finally:
        server.close()
        dht.shutdown()
    assert grown < 64 << 20, f"the bootstrap peer grew by {grown >> 20} MB ({sent >> 20} MB sent)"
    assert server.refused == 1 and server.served == 0
    refusals = [r.getMessage() for r in caplog.records if "refused a definition" in r.getMessage()]
    assert refusals and f"a frame of {ANNOUNCED} bytes" in refusals[0], refusals
    assert stranger in refusals[0]  # the log line names the peer


def test_member_messages_are_bounded_in_header_body_size_and_count() -> None:
    async def roundtrip(header: dict, bodies: list[bytes], **limits):
        reader = asyncio.StreamReader()

        class Sink:
            def write(self, data) -> None:
                reader.feed_data(bytes(data))

            async def drain(self) -> None:
                pass

        await send_message(Sink(), header, bodies)
        reader.feed_eof()
        return await recv_message(reader, **limits)

    header, bodies = asyncio.run(roundtrip({"rank": 1}, [b"x" * 100], max_body=100))
    assert header["rank"] == 1 and bodies == [b"x" * 100]
    with pytest.raises(FrameRefused, match="a frame of 101 bytes"):
        asyncio.run(roundtrip({}, [b"x" * 101], max_body=100))
    with pytest.raises(FrameRefused, match="3 bodies"):
        asyncio.run(roundtrip({}, [b""] * 3, max_bodies=2))
    with pytest.raises(FrameRefused, match="this stream takes at most 64"):
        asyncio.run(roundtrip({"pad": "y" * 100}, [], max_header=64))
