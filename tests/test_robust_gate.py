"""The admission gate over real loopback sockets: members get through, and nothing from a
non-member (wrong secret, unknown key, garbage, a truncated or replayed proof, a connection that
never answers) ever reaches the service behind it."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from farlink.comm.sockets import parse_address
from farlink.robust.auth import SharedSecretAuth, make_authenticator
from farlink.robust.gate import (
    CHALLENGE_TAG,
    FIX,
    PROOF_TAG,
    REFUSED,
    VERDICT_TAG,
    Gate,
    GateRefused,
    GateUnreachable,
    LogLimiter,
    Tunnel,
    answers_as_gate,
    frame,
    open_tunnel,
)
from farlink.robust.keys import generate_keypair


class EchoService:
    """The stand-in for the Lighthouse: echoes bytes and records every connection it got."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received: list[bytes] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        got = b""
        with conn:
            try:
                while data := conn.recv(65536):
                    got += data
                    conn.sendall(data)
            except ConnectionResetError:  # the gate cut the client off: nothing was echoed
                return
        with self.lock:
            self.received.append(got)

    @property
    def connections(self) -> int:
        with self.lock:
            return len(self.received)

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def service():
    svc = EchoService()
    yield svc
    svc.close()


@pytest.fixture
def gate(service):
    g = Gate(SharedSecretAuth("run-secret", "gate"), ("127.0.0.1", service.port),
             handshake_timeout=1.0, name="Lighthouse").start()
    yield g
    g.close()


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def read_challenge(sock: socket.socket) -> bytes:
    head = _exactly(sock, 6)
    assert head[:4] == CHALLENGE_TAG
    return _exactly(sock, struct.unpack("<H", head[4:])[0])


def read_verdict(sock: socket.socket) -> tuple[int, str]:
    head = _exactly(sock, 7)
    assert head[:4] == VERDICT_TAG
    code, n = struct.unpack("<BH", head[4:])
    return code, _exactly(sock, n).decode()


def raw(gate: Gate) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gate.port), timeout=10)


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_member_through_tunnel_reaches_service(gate, service, tmp_path):
    gate.log_path = tmp_path / "gate.log"
    with Tunnel(SharedSecretAuth("run-secret", "w0"), ("127.0.0.1", gate.port)) as tunnel:
        assert tunnel.peer_id == "w0"
        for payload in (b"hello", b"x" * 300_000):  # larger than one relay chunk
            with socket.create_connection(("127.0.0.1", tunnel.port), timeout=10) as s:
                s.sendall(payload)
                assert _exactly(s, len(payload)) == payload
    wait_for(lambda: service.connections >= 3)
    # the probe connection carried no bytes; both payloads arrived intact
    assert sorted(service.received, key=len) == [b"", b"hello", b"x" * 300_000]
    assert gate.admitted == ["w0", "w0", "w0"] and not gate.refusals
    assert "admitted" in gate.log_path.read_text()


def test_wrong_secret_refused_with_cause_and_fix(gate, service):
    start = time.monotonic()
    with pytest.raises(GateRefused) as err:
        open_tunnel(gate.url, SharedSecretAuth("guessed", "mallory"), name="Lighthouse")
    assert time.monotonic() - start < 5
    assert "wrong run secret" in str(err.value) and FIX in str(err.value)
    assert "mallory" in gate.refusals[0][1]
    time.sleep(0.2)
    assert service.connections == 0


def test_ed25519_key_not_allowed(service, tmp_path):
    members = tmp_path / "members"
    generate_keypair(members / "alice.key")
    generate_keypair(tmp_path / "mallory.key")
    verifier = make_authenticator("ed25519", allowed_keys=members)
    with Gate(verifier, ("127.0.0.1", service.port)) as g:
        alice = make_authenticator("ed25519", key_file=members / "alice.key",
                                   allowed_keys=members)
        with Tunnel(alice, ("127.0.0.1", g.port)) as t:
            assert t.peer_id == alice.peer_id
        # mallory holds a valid key of her own, listed only in her own allowed-keys file
        mallory = make_authenticator("ed25519", key_file=tmp_path / "mallory.key",
                                     allowed_keys=tmp_path / "mallory.key.pub")
        with pytest.raises(GateRefused, match="not a member of this run") as err:
            Tunnel(mallory, ("127.0.0.1", g.port)).start()
        assert "--allowed-keys" in str(err.value)
        assert g.admitted == [alice.peer_id]


def test_garbage_before_handshake_never_reaches_service(gate, service):
    with raw(gate) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64)  # a gRPC client, no proof
        read_challenge(s)
        code, reason = read_verdict(s)
        assert code == REFUSED and "not a farlink handshake" in reason
        assert s.recv(10) == b""  # closed
    with raw(gate) as s:  # right tag, absurd length
        read_challenge(s)
        s.sendall(PROOF_TAG + struct.pack("<H", 60000) + b"x" * 100)
        code, reason = read_verdict(s)
        assert code == REFUSED and "limit" in reason
    wait_for(lambda: len(gate.refusals) >= 2)  # recorded by the gate's thread, maybe later
    time.sleep(0.2)
    assert service.connections == 0 and len(gate.refusals) == 2


def test_truncated_proof(gate, service):
    member = SharedSecretAuth("run-secret", "w0")
    with raw(gate) as s:  # the frame promises more bytes than arrive, then the sender closes
        proof = member.prove(read_challenge(s))
        s.sendall(PROOF_TAG + struct.pack("<H", len(proof)) + proof[:10])
        s.shutdown(socket.SHUT_WR)
        code, reason = read_verdict(s)
        assert code == REFUSED and "truncated" in reason
    with raw(gate) as s:  # a complete frame holding a cut-off proof
        proof = member.prove(read_challenge(s))
        s.sendall(frame(PROOF_TAG, proof[:-5]))
        code, reason = read_verdict(s)
        assert code == REFUSED and "no MAC" in reason
    time.sleep(0.2)
    assert service.connections == 0


def test_replayed_proof_refused(gate, service):
    member = SharedSecretAuth("run-secret", "w0")
    with raw(gate) as s:  # a genuine handshake, recorded by an eavesdropper
        recorded = member.prove(read_challenge(s))
        s.sendall(frame(PROOF_TAG, recorded))
        assert read_verdict(s) == (1, "w0")
    with raw(gate) as s:  # replayed on a new connection: the gate issued a fresh challenge
        read_challenge(s)
        s.sendall(frame(PROOF_TAG, recorded))
        code, reason = read_verdict(s)
        assert code == REFUSED and "does not verify" in reason
    with raw(gate) as s:  # a proof for a challenge the gate never issued
        read_challenge(s)
        forged = member.make_challenge()
        s.sendall(frame(PROOF_TAG, member.prove(forged)))
        code, reason = read_verdict(s)
        assert code == REFUSED
    wait_for(lambda: service.connections == 1 and len(gate.refusals) >= 2)
    assert gate.admitted == ["w0"] and len(gate.refusals) == 2


def test_slow_loris_closed_after_bounded_time(gate, service):
    start = time.monotonic()
    with raw(gate) as s:
        read_challenge(s)
        s.sendall(PROOF_TAG[:2])  # starts, then never finishes
        code, reason = read_verdict(s)
        assert s.recv(10) == b""
    elapsed = time.monotonic() - start
    assert code == REFUSED and "within 1 s" in reason
    assert 0.8 < elapsed < 4.0
    assert service.connections == 0


def raw_from(gate: Gate, source: str) -> socket.socket:
    """A connection from another loopback address (all of 127/8 is this machine)."""
    sock = socket.socket()
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", gate.port))
    return sock


def closed_by_gate(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the gate closed this connection (after its challenge) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):  # the challenge, then nothing: the gate says no more
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_pending_handshakes_are_bounded(service):
    """Over the limits the oldest pending handshake makes room; a newcomer always gets its
    challenge (it is never refused for others' load)."""
    with Gate(SharedSecretAuth("s", "gate"), ("127.0.0.1", service.port), max_pending=3,
              max_pending_per_source=2, handshake_timeout=30.0) as g:
        a = [raw_from(g, "127.0.0.2") for _ in range(3)]  # per source: 2
        for s in a:
            read_challenge(s)
        assert closed_by_gate(a[0]) and not closed_by_gate(a[1], 0.5)
        b = [raw_from(g, "127.0.0.3") for _ in range(2)]  # 4 pending > 3: .2 holds the most
        for s in b:
            read_challenge(s)
        assert closed_by_gate(a[1]) and not closed_by_gate(a[2], 0.5)
        assert not any(closed_by_gate(s, 0.2) for s in b)
        # read before the clients hang up: a handshake they leave unfinished is another event
        wait_for(lambda: len(g.events) >= 2, timeout=5.0)
        assert [kind for kind, _, _ in g.events] == ["dropped", "dropped"]
        for s in a + b:
            s.close()
        assert service.connections == 0


def test_idle_flood_does_not_lock_a_member_out(service, tmp_path: Path):
    """66 idle connections (over the 64 in all) from the member's own address and 66 from
    another: a member with the right secret still gets in at once, and the idle ones are
    closed fast."""
    log_path = tmp_path / "gate.log"
    with Gate(SharedSecretAuth("s", "gate"), ("127.0.0.1", service.port), name="Lighthouse",
              log_path=log_path) as g:
        idle = [raw_from(g, source) for source in ("127.0.0.1", "127.0.0.9") for _ in range(66)]
        time.sleep(0.5)
        start = time.monotonic()
        with Tunnel(SharedSecretAuth("s", "w0"), ("127.0.0.1", g.port)) as tunnel:
            assert tunnel.peer_id == "w0"
            with socket.create_connection(("127.0.0.1", tunnel.port), timeout=10) as s:
                s.sendall(b"member bytes")
                assert _exactly(s, 12) == b"member bytes"
        assert time.monotonic() - start < 5  # at once, not after the idle ones time out
        assert g.admitted == ["w0", "w0"] and not g.refusals
        # every idle connection is gone within the handshake timeout (5 s), most at once
        wait_for(lambda: all(closed_by_gate(s, 0.01) for s in idle), timeout=8.0)
        for s in idle:
            s.close()
    wait_for(lambda: service.connections == 2)


@pytest.mark.slow  # the same bounded log as the failed-tunnel flood, which runs by default
def test_flood_of_refusals_keeps_the_log_small(service, tmp_path: Path):
    log_path = tmp_path / "gate.log"
    with Gate(SharedSecretAuth("s", "gate"), ("127.0.0.1", service.port), log_path=log_path,
              name="Lighthouse") as g:
        for _ in range(300):
            with raw(g) as s:
                read_challenge(s)
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not a proof: refused at once
                assert read_verdict(s)[0] == REFUSED
        wait_for(lambda: len(g.refusals) == 300)
        time.sleep(10.2)  # the limiter's 10 s window is over: the next line counts the skipped
        with raw(g) as s:
            read_challenge(s)
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            read_verdict(s)
        wait_for(lambda: len(g.refusals) == 301)
    lines = log_path.read_text().splitlines()
    assert len(lines) == 21, len(lines)  # one window's burst, then the line with the count
    assert "280 more refused lines left out" in lines[-1]


class SteppedClock:
    """A monotonic clock that stands still until the test moves ``now`` on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_flood_of_failed_tunnel_connections_keeps_the_log_small(service, caplog):
    """A worker's tunnel handshakes every local connection with the gate. Once the gate refuses
    this peer (restarted under another secret), a local client retrying in a loop must not write
    a log line per attempt: at most 20 per 10 s, then one line counting those left out.
    The limiter's 10 s are on a clock this test moves on (each line is admitted before the
    tunnel closes its connection, so all 60 fall in the first window: 20 lines, 40 left out)."""
    clock = SteppedClock()
    first = Gate(SharedSecretAuth("s", "gate"), ("127.0.0.1", service.port),
                 name="Lighthouse").start()
    tunnel = Tunnel(SharedSecretAuth("s", "w0"), ("127.0.0.1", first.port),
                    name="Lighthouse", log_limit=LogLimiter(clock=clock)).start()
    first.close()
    rotated = Gate(SharedSecretAuth("rotated", "gate"), ("127.0.0.1", service.port),
                   port=first.port, name="Lighthouse").start()
    caplog.set_level(logging.ERROR, logger="farlink.robust.gate")
    # a connection relayed before the rotation is counted when its echo thread sees it end,
    # which a loaded machine may delay: count from when that count has settled
    reached, settled = service.connections, time.monotonic() + 0.5
    deadline = time.monotonic() + 10
    while time.monotonic() < min(settled, deadline):
        time.sleep(0.05)
        if service.connections != reached:
            reached, settled = service.connections, time.monotonic() + 0.5
    try:
        for _ in range(60):
            with socket.create_connection(("127.0.0.1", tunnel.port), timeout=10) as s:
                assert s.recv(1) == b""  # closed by the tunnel: nothing relayed
        clock.now += 10.2  # the limiter's 10 s window is over: the next line counts the skipped
        with socket.create_connection(("127.0.0.1", tunnel.port), timeout=10) as s:
            assert s.recv(1) == b""
    finally:
        tunnel.close()
        rotated.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert all("refused this peer" in line for line in lines), lines[:3]
    assert len(lines) == 21, len(lines)  # one window's burst, then the line with the count
    assert "(40 similar lines left out)" in lines[-1]
    assert isinstance(tunnel.failure, GateRefused)
    assert service.connections == reached


def test_turned_away_before_the_challenge_is_not_called_a_refusal():
    """A gate that answers with a verdict where the challenge belongs (an older gate, busy)
    did not judge this peer's membership: the member must not be told its secret is wrong,
    nor that the gate is "not a farlink handshake"."""
    busy = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = busy.accept()
        with conn:
            reason = b"too many handshakes in progress (64)"
            conn.sendall(VERDICT_TAG + struct.pack("<BH", REFUSED, len(reason)) + reason)
            time.sleep(0.5)

    threading.Thread(target=answer, daemon=True).start()
    try:
        with pytest.raises(GateUnreachable) as err:
            Tunnel(SharedSecretAuth("s", "w"), ("127.0.0.1", busy.getsockname()[1])).start()
    finally:
        busy.close()
    text = str(err.value)
    assert "before any handshake: too many handshakes in progress" in text, text
    assert "not a farlink handshake" not in text and "wrong run secret" not in text


def test_not_a_gate_and_service_down():
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, says nothing (a bare Lighthouse)
    try:
        start = time.monotonic()
        with pytest.raises(GateUnreachable, match="no farlink challenge"):
            Tunnel(SharedSecretAuth("s", "w"), ("127.0.0.1", silent.getsockname()[1]),
                   handshake_timeout=1.0).start()
        assert time.monotonic() - start < 4
    finally:
        silent.close()
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]  # closed again: nothing listens there
    with Gate(SharedSecretAuth("s", "gate"), ("127.0.0.1", port)) as g, \
            pytest.raises(GateUnreachable, match="unreachable"):
        open_tunnel(g.url, SharedSecretAuth("s", "w"))
    with pytest.raises(GateUnreachable, match="cannot connect"):
        open_tunnel(f"http://127.0.0.1:{port}", SharedSecretAuth("s", "w"), timeout=2.0)


def test_parse_address():
    assert parse_address("http://127.0.0.1:29510") == ("127.0.0.1", 29510)
    assert parse_address("10.0.0.2:80") == ("10.0.0.2", 80)
    assert parse_address("http://[::1]:5") == ("::1", 5)
    with pytest.raises(ValueError):
        parse_address("http://nohost")


def test_gate_log_file(service, tmp_path: Path):
    log_path = tmp_path / "gate.log"
    with Gate(SharedSecretAuth("s", "gate"), ("127.0.0.1", service.port), log_path=log_path,
              name="Lighthouse") as g, pytest.raises(GateRefused):
        open_tunnel(g.url, SharedSecretAuth("wrong", "w9"))
    text = log_path.read_text()
    assert "Lighthouse gate refused" in text and "w9" in text and "wrong run secret" in text


def test_answers_as_gate(gate, service):
    assert answers_as_gate(gate.url)
    assert not answers_as_gate(f"http://127.0.0.1:{service.port}")  # echoes our request back
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]
    assert not answers_as_gate(f"http://127.0.0.1:{port}", timeout=1.0)
