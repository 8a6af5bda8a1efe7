"""Authenticators, key files, join challenges and the ``farlink keys`` commands."""

from __future__ import annotations

import base64
import os
import stat
import time

import pytest
import typer
from typer.testing import CliRunner

from farlink.robust import command
from farlink.robust.auth import (
    Authenticator,
    AuthError,
    Ed25519Auth,
    SharedSecretAuth,
    make_authenticator,
)
from farlink.robust.keys import (
    KeyFileError,
    generate_keypair,
    key_id,
    load_allowed_keys,
    load_private_key,
    parse_public_key,
)


@pytest.fixture
def keydir(tmp_path):
    """Three members (a, b, c) in ``members/`` plus an outsider key elsewhere."""
    members = tmp_path / "members"
    for name in "abc":
        generate_keypair(members / f"{name}.key")
    generate_keypair(tmp_path / "outsider.key")
    return tmp_path


def _ed(keydir, name):
    return make_authenticator("ed25519", key_file=keydir / "members" / f"{name}.key",
                              allowed_keys=keydir / "members")


def test_generate_keypair_files(tmp_path):
    pub = generate_keypair(tmp_path / "k" / "peer.key")
    priv = tmp_path / "k" / "peer.key"
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600
    assert (tmp_path / "k" / "peer.key.pub").read_text().strip() == pub
    assert key_id(load_private_key(priv).public_key()) == key_id(parse_public_key(pub))
    with pytest.raises(KeyFileError, match="already exists"):
        generate_keypair(priv)
    assert generate_keypair(priv, overwrite=True) != pub


def test_ed25519_sign_verify_and_refusals(keydir):
    a, b = _ed(keydir, "a"), _ed(keydir, "b")
    msg = b"update bytes"
    signed = a.sign(msg)
    assert len(signed) == len(msg) + a.overhead
    assert b.verify(signed) == msg and b.open(signed) == (a.peer_id, msg)
    tampered = bytearray(signed)
    tampered[3] ^= 1
    with pytest.raises(AuthError, match="bad signature"):
        b.verify(bytes(tampered))
    outsider = Ed25519Auth({**load_allowed_keys(keydir / "members"),
                            **load_allowed_keys(keydir / "outsider.key.pub")},
                           keydir / "outsider.key")
    with pytest.raises(AuthError, match="unknown key"):
        b.verify(outsider.sign(msg))
    # a signature cannot be moved to another body, nor relabelled with another member's id
    with pytest.raises(AuthError):
        b.verify(b"other bytes!" + signed[len(msg):])
    relabel = msg + bytes.fromhex(b.peer_id) + signed[-64:]
    with pytest.raises(AuthError, match="bad signature"):
        b.verify(relabel)


def test_verifier_without_private_key(keydir):
    hub = make_authenticator("ed25519", allowed_keys=keydir / "members")
    a = _ed(keydir, "a")
    assert hub.verify(a.sign(b"x")) == b"x"
    with pytest.raises(AuthError, match="no private key"):
        hub.sign(b"x")


def test_shared_secret_sign_verify():
    a, b, wrong = SharedSecretAuth("s3cret"), SharedSecretAuth("s3cret"), SharedSecretAuth("no")
    assert b.verify(a.sign(b"hello")) == b"hello"
    with pytest.raises(AuthError, match="MAC does not verify"):
        b.verify(wrong.sign(b"hello"))
    with pytest.raises(AuthError, match="shorter"):
        b.verify(b"short")
    assert b.open(a.sign(b"m")) == (None, b"m")
    with pytest.raises(ValueError):
        SharedSecretAuth("")


def _all_kinds(keydir):
    """(admitting side, honest joiner, impostor) for each kind."""
    return {
        "secret": (SharedSecretAuth("k", "hub"), SharedSecretAuth("k", "alice"),
                   SharedSecretAuth("other", "mallory")),
        "ed25519": (make_authenticator("ed25519", allowed_keys=keydir / "members"),
                    _ed(keydir, "a"),
                    Ed25519Auth(keydir / "outsider.key.pub", keydir / "outsider.key")),
    }


def test_membership_proofs(keydir):
    for kind, (hub, joiner, impostor) in _all_kinds(keydir).items():
        challenge = hub.make_challenge()
        proof = joiner.prove(challenge)
        assert hub.check_proof(challenge, proof) == joiner.peer_id, kind
        with pytest.raises(AuthError, match="already answered"):  # replay of a recorded proof
            hub.check_proof(challenge, proof)
        c2 = hub.make_challenge()
        with pytest.raises(AuthError):  # a proof answers only its own challenge
            hub.check_proof(c2, proof)
        c3 = hub.make_challenge()
        with pytest.raises(AuthError, match="unknown key|wrong run secret"):
            hub.check_proof(c3, impostor.prove(c3))
        other_hub = type(hub)(**({"secret": "k"} if kind == "secret" else
                                 {"allowed": keydir / "members"}))
        c4 = other_hub.make_challenge()  # issued elsewhere: useless here
        with pytest.raises(AuthError, match="not issued here"):
            hub.check_proof(c4, joiner.prove(c4))


def test_proof_bound_to_context(keydir):
    """A proof made for one (prover, verifier) pair fails for any other: a third party that
    relays a member's proof to someone else gets nowhere."""
    for kind, (hub, joiner, _) in _all_kinds(keydir).items():
        c = hub.make_challenge()
        assert hub.check_proof(c, joiner.prove(c, b"alice>hub"), b"alice>hub") == joiner.peer_id
        c = hub.make_challenge()
        with pytest.raises(AuthError):
            hub.check_proof(c, joiner.prove(c, b"alice>mallory"), b"mallory>hub")
        c = hub.make_challenge()
        with pytest.raises(AuthError):  # context is not optional once the verifier expects one
            hub.check_proof(c, joiner.prove(c), b"alice>hub"), kind


def test_challenge_expiry_and_tampering(keydir):
    hub, joiner, _ = _all_kinds(keydir)["secret"]
    hub.challenge_window = 0.05
    old = hub.make_challenge()
    time.sleep(0.1)
    with pytest.raises(AuthError, match="expired"):
        hub.check_proof(old, joiner.prove(old))
    hub.challenge_window = 30
    c = bytearray(hub.make_challenge())
    c[-1] ^= 1  # push the timestamp
    with pytest.raises(AuthError, match="timestamp"):
        hub.check_proof(bytes(c), joiner.prove(bytes(c)))
    with pytest.raises(AuthError, match="not a farlink join challenge"):
        joiner.prove(b"junk")


def test_join_proof_is_not_a_message_signature(keydir):
    for hub, joiner, _ in _all_kinds(keydir).values():
        challenge = hub.make_challenge()
        proof = joiner.prove(challenge)
        # the proof is a tag over (domain, challenge, id): replayed as a message it must fail
        with pytest.raises(AuthError):
            hub.verify(challenge + proof)


def test_none_authenticator_still_single_use():
    hub, joiner = Authenticator("hub"), Authenticator("bob")
    c = hub.make_challenge()
    assert hub.check_proof(c, joiner.prove(c)) == "bob"
    with pytest.raises(AuthError):
        hub.check_proof(c, joiner.prove(c))


def test_make_authenticator_errors(keydir, tmp_path):
    with pytest.raises(ValueError, match="unknown auth kind"):
        make_authenticator("rsa")
    with pytest.raises(ValueError, match="secret"):
        make_authenticator("secret")
    with pytest.raises(ValueError, match="allowed_keys"):
        make_authenticator("ed25519", key_file=keydir / "members" / "a.key")
    with pytest.raises(KeyFileError, match="does not exist") as info:
        make_authenticator("ed25519", key_file=tmp_path / "nope.key",
                           allowed_keys=keydir / "members")
    assert "nope.key" in str(info.value)
    with pytest.raises(KeyFileError, match="is a directory"):
        make_authenticator("ed25519", key_file=keydir, allowed_keys=keydir / "members")
    (tmp_path / "garbage.key").write_text("not a key")
    with pytest.raises(KeyFileError, match="does not hold"):
        make_authenticator("ed25519", key_file=tmp_path / "garbage.key",
                           allowed_keys=keydir / "members")
    with pytest.raises(ValueError, match="not in"):
        make_authenticator("ed25519", key_file=keydir / "outsider.key",
                           allowed_keys=keydir / "members")
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.key"
        locked.write_text("x")
        locked.chmod(0)
        with pytest.raises(KeyFileError, match="cannot read"):
            make_authenticator("ed25519", key_file=locked, allowed_keys=keydir / "members")
    assert isinstance(make_authenticator("none"), Authenticator)
    assert make_authenticator("secret", secret="x", peer_id="p").peer_id == "p"


def test_allowed_keys_file_formats(keydir, tmp_path):
    pubs = [(keydir / "members" / f"{n}.key.pub").read_text().strip() for n in "ab"]
    b64 = base64.b64encode(bytes.fromhex(pubs[1])).decode()
    listing = tmp_path / "allowed.txt"
    listing.write_text(f"# run members\n{pubs[0]}  alice\n\n{b64} # bob, base64\n")
    keys = load_allowed_keys(listing)
    assert set(keys) == {key_id(parse_public_key(p)) for p in pubs}
    listing.write_text(f"{pubs[0]}\nzzzz\n")
    with pytest.raises(KeyFileError, match="allowed.txt:2"):
        load_allowed_keys(listing)
    listing.write_text("# nobody\n")
    with pytest.raises(KeyFileError, match="lists no keys"):
        load_allowed_keys(listing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyFileError, match="no \\*.pub"):
        load_allowed_keys(tmp_path / "empty")


def test_keys_cli(tmp_path):
    app, bench = typer.Typer(), typer.Typer()
    command.register(app, bench)
    runner = CliRunner(env={"COLUMNS": "1000"})  # error boxes wrap at the terminal's width
    res = runner.invoke(app, ["keys", "generate", "--out", str(tmp_path), "--name", "alice"])
    assert res.exit_code == 0, res.output
    kid = key_id(load_private_key(tmp_path / "alice.key").public_key())
    assert kid in res.output
    res = runner.invoke(app, ["keys", "generate", "--out", str(tmp_path), "--name", "alice"])
    assert res.exit_code != 0 and "already exists" in res.output
    runner.invoke(app, ["keys", "generate", "--out", str(tmp_path), "--name", "bob"])
    res = runner.invoke(app, ["keys", "show", str(tmp_path)])
    assert res.exit_code == 0 and kid in res.output and res.output.count("\n") > 4
    res = runner.invoke(app, ["keys", "show", str(tmp_path / "alice.key")])
    assert res.exit_code == 0 and kid in res.output
    res = runner.invoke(app, ["keys", "show", str(tmp_path / "missing")])
    assert res.exit_code != 0 and "does not exist" in res.output
