"""The failures hivemind users hit most, produced for real, each as a CommError with a fix."""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest
import torch

from farlink.comm.errors import CommError, DaemonFailed, PeerUnreachable, RoundTimeout
from farlink.comm.hivemind_backend import HivemindCollective
from farlink.comm.hivemind_net import (
    LOCAL_ONLY,
    check_p2pd,
    dht_options,
    start_bootstrap_peer,
    validate_initial_peers,
)
from farlink.comm.hivemind_wire import chunk_digests, pack_state, unpack_state

torch.set_num_threads(1)
FAST = dict(matchmaking_time=1.5, request_timeout=1.0, allreduce_timeout=10.0, gather_timeout=10.0)


def test_local_defaults_send_nothing_off_machine() -> None:
    opts = dht_options(["/ip4/127.0.0.1/tcp/0"])
    for key in ("nat_port_map", "auto_nat", "use_relay", "use_auto_relay", "use_ipfs"):
        assert opts[key] is False
    assert dht_options(["/ip4/0.0.0.0/tcp/0"], public=True)["use_ipfs"] is False
    assert set(LOCAL_ONLY) <= set(opts)


def test_port_in_use_is_daemon_failed() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(DaemonFailed, match="already in use.*Fix"):
            start_bootstrap_peer("127.0.0.1", port)


@pytest.mark.parametrize(
    "addr, why",
    [("hello", "not a valid multiaddress"), ("/ip4/127.0.0.1/tcp/4000", "no /p2p/PEERID")],
)
def test_malformed_initial_peer(addr: str, why: str) -> None:
    with pytest.raises(PeerUnreachable, match=why):
        validate_initial_peers([addr])


def test_nobody_listening_is_peer_unreachable() -> None:
    dht, maddrs = start_bootstrap_peer()
    dht.shutdown()  # the address (port + peer id) is real, but nothing listens there any more
    with pytest.raises(PeerUnreachable, match="none of the initial peers.*Fix"):
        HivemindCollective("x", maddrs, startup_timeout=20)


def test_p2pd_missing_or_not_executable(tmp_path) -> None:
    with pytest.raises(DaemonFailed, match="missing"):
        check_p2pd(str(tmp_path / "p2pd"))
    binary = tmp_path / "p2pd"
    binary.write_bytes(b"\x7fELF")
    os.chmod(binary, stat.S_IRUSR | stat.S_IWUSR)
    with pytest.raises(DaemonFailed, match="not executable.*chmod"):
        check_p2pd(str(binary))
    assert os.access(check_p2pd(), os.X_OK)  # the shipped one is usable


def test_round_nobody_joins_times_out() -> None:
    with HivemindCollective("lonely", round_timeout=6.0, **FAST) as coll:
        with pytest.raises(RoundTimeout, match="no group of at least 2 peers.*Fix"):
            coll.begin_round()
        assert isinstance(RoundTimeout("x"), CommError)


def test_state_hash_is_checked() -> None:
    blob, digest = pack_state({"w": torch.arange(4.0)})
    assert torch.equal(unpack_state(blob, digest)["w"], torch.arange(4.0))
    tampered = bytearray(blob)
    tampered[-1] ^= 1
    with pytest.raises(ValueError, match="hash mismatch"):
        unpack_state(bytes(tampered), digest)


def test_two_peers_in_one_process_round_trip() -> None:
    """A fast end-to-end check (threads, real daemons and sockets); the multi-process swarm
    scenarios are in test_hivemind_backend.py."""
    a = HivemindCollective("pair", **FAST)
    b = HivemindCollective("pair", a.maddrs, **FAST)
    results: dict[str, tuple] = {}

    def run(name: str, coll: HivemindCollective, value: float) -> None:
        info = coll.begin_round()
        x = [torch.full((300,), value), torch.arange(5, dtype=torch.float32)]
        coll.all_reduce_sum(x)
        sent = coll.stats.bytes_sent
        gathered = coll.all_gather_bytes(name.encode() * 4)
        results[name] = (info, x, coll.stats.bytes_sent - sent, gathered, coll.commit(), sent)

    try:
        threads = [
            threading.Thread(target=run, args=("a", a, 1.0)),
            threading.Thread(target=run, args=("b", b, 2.0)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert set(results) == {"a", "b"}
        for info, x, gather_bytes, gathered, ok, ar_bytes in results.values():
            assert ok and info.world_size == 2 and info.round_id == 0
            torch.testing.assert_close(x[0], torch.full((300,), 3.0))
            torch.testing.assert_close(x[1], 2 * torch.arange(5, dtype=torch.float32))
            names = [("a" if p == str(a.peer_id) else "b") for p in info.peers]
            assert gathered == [n.encode() * 4 for n in names]
            assert gather_bytes == 4  # one other member, 4-byte payload
            assert ar_bytes == 4 * 305  # 2 peers: N - e_me + e_me elements of float32
        assert a.round_id == b.round_id == 1
    finally:
        a.close()
        b.close()


def test_chunk_digests_by_hand() -> None:
    import hashlib

    blob = bytes(range(10))
    assert chunk_digests(blob, 4) == [hashlib.sha256(blob[i:i + 4]).hexdigest() for i in (0, 4, 8)]
    assert chunk_digests(b"", 4) == [hashlib.sha256(b"").hexdigest()]
    with pytest.raises(ValueError):
        chunk_digests(blob, 0)


def test_state_is_fetched_in_chunks_from_several_peers_and_bad_chunks_refetched() -> None:
    """Real daemons and sockets: two peers serve the same snapshot, a third downloads it in
    64-byte chunks from both; then one server holds corrupted bytes and every chunk it serves
    fails its digest, so the downloader takes those chunks from the honest peer."""
    state = {"w": torch.arange(100, dtype=torch.float32), "v": torch.ones(7)}
    blob, digest = pack_state(state)
    a = HivemindCollective("chunks", **FAST)
    b = HivemindCollective("chunks", a.maddrs, **FAST, state_chunk_bytes=64)
    c = HivemindCollective("chunks", a.maddrs, **FAST)
    try:
        for server in (a, c):
            server._call(server._publish_snapshot(b"k1", blob, digest, 3), timeout=10)
        got, got_digest = b._call(b._download_state(b"k1", [a.peer_id, c.peer_id]), timeout=60)
        assert got == blob and got_digest == digest
        assert torch.equal(unpack_state(got, digest)["w"], state["w"])
        assert set(b.last_state_sources) == {str(a.peer_id), str(c.peer_id)}
        assert sum(b.last_state_sources.values()) == len(blob)

        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 0xFF  # c serves corrupted bytes under the honest digest
        a._call(a._publish_snapshot(b"k2", blob, digest, 4), timeout=10)
        c._call(c._publish_snapshot(b"k2", bytes(bad), digest, 4), timeout=10)
        got, _ = b._call(b._download_state(b"k2", [a.peer_id, c.peer_id]), timeout=60)
        assert got == blob
        assert sum(b.last_state_sources.values()) == len(blob)
        assert b.last_state_sources.get(str(c.peer_id), 0) < len(blob) // 2
    finally:
        for coll in (a, b, c):
            coll.close()
