"""Real processes over a real localhost TCP socket: members exchange signed updates, an
impostor is refused at the door, and the run goes on.

The hub (this test process) admits peers with a challenge-response, verifies every update it
receives, and relays each round's updates to every member (an all-gather); the peers (separate
Python processes) verify what they receive with their own authenticator. In round 2 the hub flips
one bit of one relayed message, standing in for a corrupting link: the receiver must refuse it
and carry on.
"""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

import pytest
import torch
from forked import start_child

from farlink.codecs.envelope import pack, unpack
from farlink.robust.auth import AuthError, Ed25519Auth, SharedSecretAuth, make_authenticator
from farlink.robust.keys import generate_keypair

ROUNDS = 4
TIMEOUT = 60.0


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("<I", len(data)) + data)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return buf


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("<I", _exactly(sock, 4))
    if n > 1 << 24:
        raise ConnectionError(f"frame of {n} bytes announced")
    return _exactly(sock, n)


def peer_main(report_to, port: int, config: dict) -> None:
    """One peer process: join, then each round send a signed update and check everyone's; its
    report goes to ``report_to`` (a pipe's sending end)."""
    torch.set_num_threads(1)
    auth = make_authenticator(config["kind"], config.get("secret"),
                              Path(config["key"]) if config.get("key") else None,
                              Path(config["allowed"]) if config.get("allowed") else None,
                              config["name"])
    if config.get("impostor_key"):  # a key of its own that the run never listed
        auth = Ed25519Auth(Path(config["impostor_key"] + ".pub"), Path(config["impostor_key"]))
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    send_frame(sock, auth.prove(recv_frame(sock)))
    answer = recv_frame(sock).decode()
    report: dict = {"admitted": answer.startswith("OK"), "answer": answer, "rounds": [],
                    "refused": []}
    while report["admitted"]:
        frame = recv_frame(sock)
        if frame == b"DONE":
            break
        round_id = int(frame.decode().split()[1])
        value = torch.full((8,), float(config["value"] + round_id))
        message = pack(auth.peer_id, round_id, 100.0, {"w": value.numpy().tobytes()},
                       {"w": (8,)}, {"w": torch.float32})
        send_frame(sock, auth.sign(message))
        (count,) = struct.unpack("<I", recv_frame(sock))
        senders, values = [], []
        for _ in range(count):
            signed = recv_frame(sock)
            try:
                signer, body = auth.open(signed)
                env = unpack(body)
                if signer is not None and signer != env.sender:
                    raise AuthError(f"signed by {signer} but claims to be {env.sender}")
                if env.round_id != round_id:
                    raise AuthError(f"update for round {env.round_id} in round {round_id}")
            except ValueError as exc:  # AuthError and CodecError
                report["refused"].append([round_id, str(exc)])
                continue
            senders.append(env.sender)
            values.append(float(torch.frombuffer(bytearray(env.payloads["w"]),
                                                 dtype=torch.float32)[0]))
        report["rounds"].append({"round": round_id, "senders": sorted(senders),
                                 "values": sorted(values)})
    sock.close()
    report_to.send(("report", report))


class Hub:
    """Admits members, then runs rounds over them; refused joiners do not stop the rounds."""

    def __init__(self, auth, n_members: int) -> None:
        self.auth, self.n_members = auth, n_members
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.members: list[tuple[str, socket.socket]] = []
        self.refused: list[str] = []
        self.rejected_updates: list[str] = []
        self.cond = threading.Condition()
        self.round0_done = threading.Event()
        self.intruders_done = threading.Event()
        self.expected_refusals = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT)
        challenge = self.auth.make_challenge()
        try:
            send_frame(conn, challenge)
            peer_id = self.auth.check_proof(challenge, recv_frame(conn))
        except (AuthError, ConnectionError, OSError) as exc:
            try:
                send_frame(conn, f"REFUSED {exc}".encode())
            except OSError:
                pass
            conn.close()
            with self.cond:
                self.refused.append(str(exc))
                if len(self.refused) >= self.expected_refusals > 0:
                    self.intruders_done.set()
            return
        send_frame(conn, f"OK {peer_id}".encode())
        with self.cond:
            self.members.append((peer_id, conn))
            self.cond.notify_all()

    def run(self, rounds: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.members) >= self.n_members, TIMEOUT)
            members = list(self.members)
        for round_id in range(rounds):
            if round_id == 1:  # intruders try to join while the run is under way
                assert self.intruders_done.wait(TIMEOUT), "intruders never showed up"
            received = []
            for _, conn in members:
                send_frame(conn, f"ROUND {round_id}".encode())
            for peer_id, conn in members:
                signed = recv_frame(conn)
                try:
                    self.auth.verify(signed)
                    received.append(signed)
                except AuthError as exc:
                    self.rejected_updates.append(f"{peer_id}: {exc}")
            for i, (_, conn) in enumerate(members):
                send_frame(conn, struct.pack("<I", len(received)))
                for j, signed in enumerate(received):
                    if round_id == 2 and i == 0 and j == 1:  # a link corrupts one copy
                        signed = signed[:5] + bytes([signed[5] ^ 0x10]) + signed[6:]
                    send_frame(conn, signed)
            if round_id == 0:
                self.round0_done.set()
        for _, conn in members:
            send_frame(conn, b"DONE")

    def close(self) -> None:
        self.server.close()
        for _, conn in self.members:
            conn.close()


def _spawn(port: int, config: dict) -> tuple:
    """A peer process (forked with torch already imported: the subject is the process boundary
    and the socket, not an interpreter's start)."""
    return start_child(peer_main, port, config)


def _report(peer: tuple) -> dict:
    proc, reports = peer
    assert reports.poll(TIMEOUT * 2), "the peer said nothing"
    kind, report = reports.recv()
    proc.join(TIMEOUT)
    assert kind == "report" and proc.exitcode == 0, report
    return report


@pytest.mark.parametrize("kind", ["secret", "ed25519"])
def test_members_exchange_and_impostor_is_refused(kind, tmp_path):
    if kind == "secret":
        honest = [{"kind": "secret", "secret": "run-secret", "name": n, "value": v}
                  for n, v in (("alice", 10), ("bob", 20))]
        impostor = {"kind": "secret", "secret": "guessed", "name": "mallory", "value": 666}
        hub_auth = SharedSecretAuth("run-secret", "hub")
    else:
        members = tmp_path / "members"
        for n in ("alice", "bob"):
            generate_keypair(members / f"{n}.key")
        generate_keypair(tmp_path / "mallory.key")
        honest = [{"kind": "ed25519", "key": str(members / f"{n}.key"), "allowed": str(members),
                   "name": n, "value": v} for n, v in (("alice", 10), ("bob", 20))]
        impostor = {"kind": "none", "name": "mallory", "value": 666,
                    "impostor_key": str(tmp_path / "mallory.key")}
        hub_auth = make_authenticator("ed25519", allowed_keys=members)

    hub = Hub(hub_auth, n_members=2)
    hub.expected_refusals = 2
    runner = threading.Thread(target=hub.run, args=(ROUNDS,), daemon=True)
    procs: list[tuple] = []
    try:
        procs += [_spawn(hub.port, c) for c in honest]
        runner.start()
        assert hub.round0_done.wait(TIMEOUT * 2), "the members never finished round 0"
        intruder = _spawn(hub.port, impostor)
        procs.append(intruder)
        raw = socket.create_connection(("127.0.0.1", hub.port), timeout=TIMEOUT)
        recv_frame(raw)  # the challenge; answer with an update instead of a proof
        send_frame(raw, pack("mallory", 1, 1e9, {}, {}, {}))
        assert recv_frame(raw).startswith(b"REFUSED")
        raw.close()
        bad = _report(intruder)
        reports = [_report(p) for p in procs[:2]]
        runner.join(TIMEOUT)
        assert not runner.is_alive()
    finally:
        hub.close()
        for proc, _ in procs:
            if proc.is_alive():  # a failed test: no peer outlives it
                proc.kill()
                proc.join()

    assert not bad["admitted"] and bad["answer"].startswith("REFUSED")
    assert ("wrong run secret" if kind == "secret" else "unknown key") in bad["answer"]
    assert len(hub.refused) == 2 and not hub.rejected_updates
    ids = sorted(r["answer"].split()[1] for r in reports)
    for i, rep in enumerate(reports):
        assert rep["admitted"] and [r["round"] for r in rep["rounds"]] == list(range(ROUNDS))
        for r in rep["rounds"]:
            if r["round"] == 2 and rep["refused"]:
                continue
            assert r["senders"] == ids and r["values"] == [10.0 + r["round"], 20.0 + r["round"]]
    # the hub's first member got one corrupted copy in round 2; it refused exactly that one
    refusals = [rep["refused"] for rep in reports]
    assert sorted(len(r) for r in refusals) == [0, 1]
    (round_id, reason), = [x for r in refusals for x in r]
    assert round_id == 2 and ("MAC" in reason or "signature" in reason)
    hit = next(rep for rep in reports if rep["refused"])
    assert len(next(r for r in hit["rounds"] if r["round"] == 2)["senders"]) == 1
