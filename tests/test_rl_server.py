"""The rollout server facing untrusted clients over real sockets: who may name a worker, how long
a connection may say nothing, how many connections one host or everyone may hold.

The subject is the protocol, so the honest worker is a thread speaking it through the same
:class:`~farlink.rl.remote.Connection` a ``farlink rl-worker`` process uses, and attackers are
raw sockets writing frames by hand.
"""

from __future__ import annotations

import socket
import stat
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farlink.data.tokenizer import train_tokenizer
from farlink.model.config import GPTConfig
from farlink.model.gpt import GPT
from farlink.rl.base import TextCodec
from farlink.rl.remote import PROOF_CONTEXT, RolloutServer, recv_frame, send_frame
from farlink.rl.tasks import Addition, CallableTask, demonstrations
from farlink.rl.trainer import RLConfig
from farlink.robust.auth import AuthError, OpenKeyAuth
from farlink.robust.keys import key_id, load_or_generate
from farlink.train.rl import Base, make_session, serve
from farlink.train.rl_worker import connect_worker



def _even_task() -> CallableTask:
    return CallableTask("even", lambda rng: (f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", "4"),
                        lambda prompt, answer, completion: sum(map(ord, completion)) % 2 == 0)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(train_tokenizer(demonstrations(Addition(2), 200, 0.5), 257))


def _session(codec: TextCodec, groups_per_step: int = 1):  # noqa: ANN202
    """A trainer of a tiny GPT on the even-sum task with no workers of its own; every group
    is recomputed."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, n_layer=1, n_head=2, d_model=32, d_ff=64, seq_len=32))
    cfg = RLConfig(group_size=4, groups_per_step=groups_per_step, deadline_s=3.0,
                   fingerprint_every=2, max_staleness=4, verify_fraction=1.0)
    return make_session(Base(model.eval(), codec, _even_task(), []), cfg, workers=0, lr=1e-2)


def _dial(server: RolloutServer, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(server.address, timeout=10, source_address=(source, 0))


def _cut(sock: socket.socket, within_s: float = 10.0) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within ``within_s``."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _answered(sock: socket.socket) -> bool:
    try:
        send_frame(sock, {"op": "version"})
        return "version" in recv_frame(sock)[0]
    except OSError:
        return False


def _prove(sock: socket.socket, key: Ed25519PrivateKey) -> str:
    send_frame(sock, {"op": "challenge"})
    challenge = bytes.fromhex(recv_frame(sock)[0]["challenge"])
    send_frame(sock, {"op": "prove", "label": "attacker",
                      "proof": OpenKeyAuth(key).prove(challenge, PROOF_CONTEXT).hex()})
    return recv_frame(sock)[0]["worker"]


def test_nobody_but_a_workers_key_can_hand_in_or_take_jobs_in_its_name(codec, tmp_path) -> None:
    """An attacker names the honest worker in garbage hand-ins (the next job number, which is
    guessable, and one never issued): unproven, or proven as itself. The server refuses every
    such frame and cuts the attacker; the honest worker is neither recorded nor banned. Under
    its own key the attacker's garbage bans the attacker only."""
    session = _session(codec, groups_per_step=2)
    server = serve(session, "int4")
    try:
        honest = connect_worker("honest", *server.address, load_or_generate(tmp_path / "h.key"))
        assert honest.name == key_id(load_or_generate(tmp_path / "h.key").public_key())
        assert honest.do_job()  # the honest worker took job 0 and handed it in
        garbage = {"worker": honest.name, "seed": 1, "version": 0, "prompt_ids": [1],
                   "completion_ids": [2], "logprobs": [-1.0], "fingerprints": []}
        attacker_key = Ed25519PrivateKey.generate()
        for proven in (False, True):
            for job in (session.board.next_job, 10**6):
                sock = _dial(server)
                if proven:
                    assert _prove(sock, attacker_key) == key_id(attacker_key.public_key())
                send_frame(sock, {"op": "submit", "worker": honest.name, "job": job,
                                  "rollouts": [{**garbage, "job": job}]})
                assert _cut(sock), "a hand-in naming another worker was answered"
                sock.close()
            sock = _dial(server)  # nor may it take the honest worker's jobs
            if proven:
                _prove(sock, attacker_key)
            send_frame(sock, {"op": "job", "worker": honest.name})
            assert _cut(sock)
            sock.close()
        assert session.board.submissions == 1 and len(session.board.jobs) == 1
        assert len(server.refused) == 6 and all(f"naming worker {honest.name!r}" in reason
                                                for _, reason in server.refused)
        sock = _dial(server)  # one open challenge per connection: no hoard of them
        send_frame(sock, {"op": "challenge"})
        recv_frame(sock)
        send_frame(sock, {"op": "challenge"})
        assert _cut(sock) and server.refused[-1][1] == "a second challenge before a proof"
        sock.close()
        # under its own key, garbage claiming the honest worker's rollouts costs the attacker
        sock = _dial(server)
        attacker = _prove(sock, attacker_key)
        send_frame(sock, {"op": "job", "worker": attacker})
        job = recv_frame(sock)[0]["job"]
        send_frame(sock, {"op": "submit", "worker": attacker, "job": job,
                          "rollouts": [{**garbage, "job": job}]})
        assert recv_frame(sock)[0] == {"ok": True}
        sock.close()
        assert session.trainer.train_step() is not None
        assert [worker for worker, _ in session.trainer.rejections] == [attacker]
        assert session.board.banned == {attacker}
        assert session.trainer.ledger.get(honest.name).updates_accepted == 1
        assert honest.do_job()  # still served
        assert server.worker_labels == {honest.name: "honest", attacker: "attacker"}
        assert server.worker_hosts == {honest.name: {"127.0.0.1"}, attacker: {"127.0.0.1"}}
    finally:
        server.close()


def test_a_key_proof_is_single_use_and_names_the_key_it_signs_with() -> None:
    key = Ed25519PrivateKey.generate()
    verifier = OpenKeyAuth()
    challenge = verifier.make_challenge()
    proof = OpenKeyAuth(key).prove(challenge, PROOF_CONTEXT)
    assert verifier.check_proof(challenge, proof, PROOF_CONTEXT) == key_id(key.public_key())
    with pytest.raises(AuthError, match="replay"):
        verifier.check_proof(challenge, proof, PROOF_CONTEXT)
    challenge = verifier.make_challenge()
    forged = proof[:32] + OpenKeyAuth(Ed25519PrivateKey.generate()).prove(
        challenge, PROOF_CONTEXT)[32:]  # another key's signature under this key
    with pytest.raises(AuthError, match="bad signature"):
        verifier.check_proof(challenge, forged, PROOF_CONTEXT)
    challenge = verifier.make_challenge()
    with pytest.raises(AuthError, match="bad signature"):  # a proof made for another door
        verifier.check_proof(challenge, OpenKeyAuth(key).prove(challenge, b"other"),
                             PROOF_CONTEXT)


def test_a_workers_key_is_made_once_and_kept(tmp_path) -> None:
    path = tmp_path / "state" / "w.key"
    first = key_id(load_or_generate(path).public_key())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert key_id(load_or_generate(path).public_key()) == first  # a restart keeps the name


def test_an_idle_or_dribbling_connection_is_cut_and_an_honest_worker_carries_on(
        codec, tmp_path) -> None:
    session = _session(codec)
    server = serve(session, "int4")
    server.idle_s = 0.5
    try:
        honest = connect_worker("honest", *server.address, load_or_generate(tmp_path / "h.key"))
        connection = honest.board.connection
        assert connection.proofs == 1
        silent, half = _dial(server), _dial(server)
        send_frame(half, {"op": "version"})  # a whole frame is answered ...
        recv_frame(half)
        half.sendall(b"\x00\x00\x00\x10")  # ... half of the next one is not waited for
        dribbler = _dial(server)  # one byte of a frame every 0.2 s: each read is quick
        started = time.monotonic()
        for byte in b"\x00\x00\x00\x40\x00\x00\x00\x00\x00\x00\x00\x00" + b"{" * 20:
            try:
                dribbler.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
        assert _cut(dribbler) and time.monotonic() - started < 5
        assert _cut(silent) and _cut(half)
        time.sleep(1.0)  # the honest worker's connection went idle too and was cut
        assert honest.do_job()  # it reconnected, proved its key again, and handed in
        assert connection.reconnects >= 1 and connection.proofs == 2
        log = session.trainer.train_step()
        assert log is not None and session.trainer.rejections == []
        assert session.trainer.ledger.get(honest.name).updates_accepted == 1
    finally:
        server.close()


def test_connections_over_the_per_host_or_total_cap_are_refused_at_once(codec) -> None:
    session = _session(codec)
    server = RolloutServer(session.board, session.publisher, {}, max_connections=3,
                           max_per_host=2)
    try:
        first, second = _dial(server), _dial(server)
        assert _answered(first) and _answered(second)
        over_host = _dial(server)  # a third from 127.0.0.1
        assert _cut(over_host, within_s=5)
        elsewhere = _dial(server, "127.0.0.2")  # another host still fits the total
        assert _answered(elsewhere)
        over_total = _dial(server, "127.0.0.3")
        assert _cut(over_total, within_s=5)
        assert [host for host, _ in server.refused] == ["127.0.0.1", "127.0.0.3"]
        assert "2 from this host (2 at most)" in server.refused[0][1]
        assert "3 connections open (3 at most)" in server.refused[1][1]
        first.close()  # a place frees up once the server sees it closed
        deadline = time.monotonic() + 10
        while True:
            again = _dial(server)
            if _answered(again) or time.monotonic() > deadline:
                break
            again.close()
            time.sleep(0.1)
        assert _answered(again)
        for sock in (second, over_host, elsewhere, over_total, again):
            sock.close()
    finally:
        server.close()
