"""Message authentication and membership proofs: every update carries proof a member sent it.

Three kinds, chosen by ``make_authenticator``:

- ``none``: trusted, organizational runs; messages pass unchanged, a joiner's claimed id is taken
  at its word (the challenge is still single-use, so the join protocol is the same everywhere);
- ``secret``: HMAC-SHA256 with one run secret; proves membership, not which member;
- ``ed25519``: each peer signs with its own private key and is named by its key id, so a receiver
  knows *which* member sent a message and the run can admit or drop members one by one.

Beside them, :class:`OpenKeyAuth` proves only which Ed25519 key a joiner holds (any key is
welcome, and its id is the joiner's name): for open volunteers such as rollout workers, whose
names another peer must not be able to claim.

Join-time proof: the admitting side calls :meth:`Authenticator.make_challenge`, the joiner answers
with :meth:`Authenticator.prove`, and :meth:`Authenticator.check_proof` returns the joiner's peer id.
A challenge carries a random nonce and a timestamp; it is accepted only by the instance that
issued it, only once, and only within ``challenge_window`` seconds, so a recorded proof cannot be
replayed. Message MACs and join proofs use different domain prefixes, so neither can stand in for
the other. An optional ``context`` (both sides must pass the same bytes) is covered by the MAC or
signature: a transport that authenticates its endpoints binds a proof to them with it (the
hivemind admission passes both libp2p peer ids), so a proof relayed by a third party fails.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, model_validator

from farlink.robust import keys as keyfiles

_MSG_DOMAIN = b"farlink-msg\x00"
_JOIN_DOMAIN = b"farlink-join\x00"
_CHALLENGE_MAGIC = b"FLJ1"
_NONCE_BYTES = 16
_CHALLENGE_LEN = len(_CHALLENGE_MAGIC) + _NONCE_BYTES + 8
_MAX_PEER_ID = 256
_SIG_BYTES = 64


class AuthError(ValueError):
    """A message whose signature does not verify, or a peer that is not a member."""


class Authenticator:
    """No authentication: messages pass through unchanged (trusted, organizational runs)."""

    name = "none"
    overhead = 0

    def __init__(self, peer_id: str = "anonymous", challenge_window: float = 30.0) -> None:
        self._peer_id = peer_id
        self.challenge_window = challenge_window
        self._pending: dict[bytes, float] = {}
        self._lock = threading.Lock()

    @property
    def peer_id(self) -> str:
        """The id this peer presents when it joins (the key id for ``ed25519``)."""
        return self._peer_id

    # -- messages ---------------------------------------------------------------------------
    def sign(self, message: bytes) -> bytes:
        return message

    def verify(self, message: bytes) -> bytes:
        return message

    def open(self, message: bytes) -> tuple[str | None, bytes]:
        """Verify and return ``(signer id or None when the kind cannot tell, body)``."""
        return None, self.verify(message)

    # -- membership proof -------------------------------------------------------------------
    def make_challenge(self) -> bytes:
        """A fresh single-use challenge for one joiner; expires after ``challenge_window``."""
        nonce = os.urandom(_NONCE_BYTES)
        now = time.time()
        with self._lock:
            self._prune(now)
            self._pending[nonce] = now
        return _CHALLENGE_MAGIC + nonce + struct.pack("<Q", int(now * 1000))

    def prove(self, challenge: bytes, context: bytes = b"") -> bytes:
        """The joiner's answer to ``challenge``: its peer id (and, for real kinds, a MAC/sig)."""
        _parse_challenge(challenge)
        return _pack_id(self.peer_id)

    def check_proof(self, challenge: bytes, proof: bytes, context: bytes = b"") -> str:
        """The joiner's peer id if ``proof`` answers a live challenge of ours; else AuthError."""
        self._consume(challenge)
        peer_id, rest = _unpack_id(proof)
        if rest:
            raise AuthError("membership proof has trailing bytes")
        return peer_id

    def _consume(self, challenge: bytes) -> None:
        nonce, issued_ms = _parse_challenge(challenge)
        now = time.time()
        with self._lock:
            issued = self._pending.pop(nonce, None)
            self._prune(now)
        if issued is None:
            raise AuthError("challenge was not issued here or was already answered (replay)")
        if int(issued * 1000) != issued_ms:
            raise AuthError("challenge timestamp was altered")
        if now - issued > self.challenge_window:
            raise AuthError(f"challenge expired ({now - issued:.1f}s old, window "
                            f"{self.challenge_window:g}s)")

    def _prune(self, now: float) -> None:
        stale = [n for n, t in self._pending.items() if now - t > self.challenge_window]
        for n in stale:
            del self._pending[n]


def _parse_challenge(challenge: bytes) -> tuple[bytes, int]:
    if len(challenge) != _CHALLENGE_LEN or not challenge.startswith(_CHALLENGE_MAGIC):
        raise AuthError("not a farlink join challenge")
    nonce = challenge[len(_CHALLENGE_MAGIC) : len(_CHALLENGE_MAGIC) + _NONCE_BYTES]
    (issued_ms,) = struct.unpack_from("<Q", challenge, len(_CHALLENGE_MAGIC) + _NONCE_BYTES)
    return nonce, issued_ms


def _pack_id(peer_id: str) -> bytes:
    raw = peer_id.encode()
    if not raw or len(raw) > _MAX_PEER_ID:
        raise AuthError(f"peer id must be 1-{_MAX_PEER_ID} bytes, got {len(raw)}")
    return struct.pack("<H", len(raw)) + raw


def _unpack_id(data: bytes) -> tuple[str, bytes]:
    if len(data) < 2:
        raise AuthError("membership proof too short")
    (n,) = struct.unpack_from("<H", data)
    if n == 0 or n > _MAX_PEER_ID or len(data) < 2 + n:
        raise AuthError("membership proof has a malformed peer id")
    try:
        return data[2 : 2 + n].decode(), data[2 + n :]
    except UnicodeDecodeError as exc:
        raise AuthError("membership proof peer id is not UTF-8") from exc


class SharedSecretAuth(Authenticator):
    """HMAC-SHA256 with a run secret: cheap, for runs whose members all hold one key."""

    name = "secret"
    overhead = 32

    def __init__(
        self, secret: str | bytes, peer_id: str = "anonymous", challenge_window: float = 30.0
    ) -> None:
        super().__init__(peer_id, challenge_window)
        if not secret:
            raise ValueError("an empty secret authenticates nobody")
        self._key = secret.encode() if isinstance(secret, str) else bytes(secret)

    def _mac(self, domain: bytes, data: bytes) -> bytes:
        return hmac.new(self._key, domain + data, hashlib.sha256).digest()

    def sign(self, message: bytes) -> bytes:
        return message + self._mac(_MSG_DOMAIN, message)

    def verify(self, message: bytes) -> bytes:
        if len(message) < self.overhead:
            raise AuthError("message shorter than its MAC")
        body, tag = message[: -self.overhead], message[-self.overhead :]
        if not hmac.compare_digest(tag, self._mac(_MSG_DOMAIN, body)):
            raise AuthError("MAC does not verify (wrong run secret or tampered message)")
        return body

    def prove(self, challenge: bytes, context: bytes = b"") -> bytes:
        _parse_challenge(challenge)
        ident = _pack_id(self.peer_id)
        return ident + self._mac(_JOIN_DOMAIN, challenge + ident + context)

    def check_proof(self, challenge: bytes, proof: bytes, context: bytes = b"") -> str:
        self._consume(challenge)
        peer_id, tag = _unpack_id(proof)
        if len(tag) != self.overhead:
            raise AuthError("membership proof has no MAC")
        ident = proof[: len(proof) - self.overhead]
        if not hmac.compare_digest(tag, self._mac(_JOIN_DOMAIN, challenge + ident + context)):
            raise AuthError(f"membership proof of {peer_id!r} does not verify (wrong run secret)")
        return peer_id


class Ed25519Auth(Authenticator):
    """Per-peer Ed25519 keys: a message ends with the signer's key id and its signature.

    ``allowed`` is the run's member list (peer id -> public key, or a path for
    :func:`farlink.robust.keys.load_allowed_keys`). ``private_key`` may be omitted on a node that
    only verifies (a coordinator); such a node cannot sign or prove.
    """

    name = "ed25519"
    overhead = keyfiles.KEY_ID_BYTES + _SIG_BYTES

    def __init__(
        self,
        allowed: dict[str, Ed25519PublicKey] | Path,
        private_key: Ed25519PrivateKey | Path | None = None,
        challenge_window: float = 30.0,
    ) -> None:
        if isinstance(allowed, (str, Path)):
            allowed = keyfiles.load_allowed_keys(Path(allowed))
        if not allowed:
            raise ValueError("an empty allowed-keys list admits nobody")
        self._allowed = {bytes.fromhex(k): v for k, v in allowed.items()}
        if isinstance(private_key, (str, Path)):
            private_key = keyfiles.load_private_key(Path(private_key))
        self._private = private_key
        self._kid = keyfiles.key_id_bytes(private_key.public_key()) if private_key else b""
        super().__init__(self._kid.hex() if private_key else "verifier", challenge_window)

    @property
    def members(self) -> list[str]:
        return sorted(k.hex() for k in self._allowed)

    def _signer(self) -> Ed25519PrivateKey:
        if self._private is None:
            raise AuthError("this node has no private key, so it cannot sign")
        return self._private

    def _check(self, kid: bytes, sig: bytes, data: bytes, what: str) -> str:
        public = self._allowed.get(kid)
        if public is None:
            raise AuthError(f"{what} signed by unknown key {kid.hex()} (not a member of this run)")
        try:
            public.verify(sig, data)
        except InvalidSignature as exc:
            raise AuthError(f"bad signature on {what} from {kid.hex()} "
                            f"(tampered or forged)") from exc
        return kid.hex()

    def sign(self, message: bytes) -> bytes:
        sig = self._signer().sign(_MSG_DOMAIN + message + self._kid)
        return message + self._kid + sig

    def open(self, message: bytes) -> tuple[str | None, bytes]:
        if len(message) < self.overhead:
            raise AuthError("message shorter than its key id and signature")
        body = message[: -self.overhead]
        kid = message[-self.overhead : -_SIG_BYTES]
        sig = message[-_SIG_BYTES:]
        return self._check(kid, sig, _MSG_DOMAIN + body + kid, "message"), body

    def verify(self, message: bytes) -> bytes:
        return self.open(message)[1]

    def prove(self, challenge: bytes, context: bytes = b"") -> bytes:
        _parse_challenge(challenge)
        return self._kid + self._signer().sign(_JOIN_DOMAIN + challenge + self._kid + context)

    def check_proof(self, challenge: bytes, proof: bytes, context: bytes = b"") -> str:
        self._consume(challenge)
        if len(proof) != self.overhead:
            raise AuthError(f"membership proof has {len(proof)} bytes, expected {self.overhead}")
        kid, sig = proof[: keyfiles.KEY_ID_BYTES], proof[keyfiles.KEY_ID_BYTES :]
        return self._check(kid, sig, _JOIN_DOMAIN + challenge + kid + context, "membership proof")


class OpenKeyAuth(Authenticator):
    """Ed25519 join proofs from anyone: the proof carries the prover's public key, and the
    prover is named by that key's id. It proves which key a peer holds, never that the peer is
    a member of anything: for open volunteers (rollout workers), where a name must not be
    claimable by another peer, but anyone may make a key and join. Join proofs only: messages
    are not signed (:meth:`sign` and :meth:`open` refuse)."""

    name = "ed25519-open"
    overhead = 32 + _SIG_BYTES  # raw public key + signature

    def __init__(self, private_key: Ed25519PrivateKey | None = None,
                 challenge_window: float = 30.0) -> None:
        self._private = private_key
        self._kid = keyfiles.key_id_bytes(private_key.public_key()) if private_key else b""
        super().__init__(self._kid.hex() if private_key else "verifier", challenge_window)

    def sign(self, message: bytes) -> bytes:
        raise AuthError("an open key proves who joins; it does not sign messages")

    def open(self, message: bytes) -> tuple[str | None, bytes]:
        raise AuthError("an open key proves who joins; it does not sign messages")

    def verify(self, message: bytes) -> bytes:
        return self.open(message)[1]

    def prove(self, challenge: bytes, context: bytes = b"") -> bytes:
        _parse_challenge(challenge)
        if self._private is None:
            raise AuthError("this node has no private key, so it cannot prove")
        public = keyfiles.raw_public(self._private.public_key())
        return public + self._private.sign(_JOIN_DOMAIN + challenge + self._kid + context)

    def check_proof(self, challenge: bytes, proof: bytes, context: bytes = b"") -> str:
        self._consume(challenge)
        if len(proof) != self.overhead:
            raise AuthError(f"key proof has {len(proof)} bytes, expected {self.overhead}")
        public = Ed25519PublicKey.from_public_bytes(proof[:32])
        kid = keyfiles.key_id_bytes(public)
        try:
            public.verify(proof[32:], _JOIN_DOMAIN + challenge + kid + context)
        except InvalidSignature as exc:
            raise AuthError(f"bad signature on the key proof of {kid.hex()}") from exc
        return kid.hex()


AUTH_KINDS = ("none", "secret", "ed25519")


def make_authenticator(
    kind: str,
    secret: str | None = None,
    key_file: Path | None = None,
    allowed_keys: Path | None = None,
    peer_id: str | None = None,
) -> Authenticator:
    """Build the authenticator a run was configured with; bad settings fail here, not mid-run.

    ``peer_id`` names this peer for ``none``/``secret`` (``ed25519`` peers are named by key id).
    Missing or unreadable key files raise :class:`~farlink.robust.keys.KeyFileError`
    (a ValueError) naming the file.
    """
    kind = (kind or "none").strip().lower()
    name = peer_id or "anonymous"
    if kind == "none":
        return Authenticator(name)
    if kind == "secret":
        if not secret:
            raise ValueError("auth 'secret' needs a non-empty run secret")
        return SharedSecretAuth(secret, name)
    if kind == "ed25519":
        if allowed_keys is None:
            raise ValueError("auth 'ed25519' needs allowed_keys (a file of public keys or a "
                             "directory of *.pub files)")
        auth = Ed25519Auth(Path(allowed_keys), Path(key_file) if key_file else None)
        if key_file is not None and auth.peer_id not in auth.members:
            raise ValueError(f"this peer's key {auth.peer_id} is not in {allowed_keys}; the "
                             f"run would refuse it")
        return auth
    raise ValueError(f"unknown auth kind {kind!r}; choose from {', '.join(AUTH_KINDS)}")


MEMBERS = ("trusted", "open")
#: what a run of ``members = "open"`` aggregates with unless it says otherwise
OPEN_DEFAULTS = {"aggregator": "centered_clip", "score": "loss"}


class TrustOptions(BaseModel):
    """How a run's members prove membership: the kind (:data:`AUTH_KINDS`), the run secret's
    sources (never saved) and ed25519's key files. What :func:`run_authenticator` builds from;
    ``RunConfig`` composes these fields (flat flags, ``[trust]`` in TOML)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    auth: str = Field("none", description="none, secret (HMAC with the run secret) or ed25519")
    secret: str | None = Field(
        None, exclude=True, repr=False, description="run secret: every update is MACed with it "
        "(never saved; FARLINK_SECRET or --secret-file keep it out of `ps` too)")
    secret_file: Path | None = Field(
        None, exclude=True, description="file holding the run secret, readable by its owner "
        "only (chmod 600); never saved")
    key_file: Path | None = Field(None, description="ed25519: this peer's private key file")
    allowed_keys: Path | None = Field(None, description="ed25519: file/dir of members' keys")
    members: str = Field("trusted", description="trusted (one owner's replicas: the plain mean "
                         "unless --aggregator says otherwise) or open (members not all trusted; "
                         "farlink swarm's default: centered_clip and --score loss unless given)")

    @model_validator(mode="after")
    def _check_trust(self) -> TrustOptions:
        if self.auth not in AUTH_KINDS:
            raise ValueError(f"auth {self.auth!r} unknown; choose none, secret or ed25519")
        if self.members not in MEMBERS:
            raise ValueError(f"members {self.members!r} unknown; choose trusted or open")
        return self


SECRET_ENV = "FARLINK_SECRET"
SECRET_SOURCES = f"{SECRET_ENV}=..., --secret-file PATH (mode 600) or --secret"


def read_secret_file(path: Path) -> str:
    """The run secret kept in ``path``; refused, as ssh refuses a private key, when the file is
    readable or writable by anyone but its owner (a secret others can read proves nothing)."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except FileNotFoundError:
        raise ValueError(f"secret file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read secret file {path}: {exc}") from None
    if mode & 0o077:
        raise ValueError(f"secret file {path} is accessible by group/others (mode "
                         f"{mode & 0o777:o}); run `chmod 600 {path}`")
    if not text:
        raise ValueError(f"secret file {path} is empty")
    return text


def resolve_secret(secret: str | None, secret_file: Path | None) -> str | None:
    """The run secret from ``--secret``, else ``--secret-file``, else ``FARLINK_SECRET``.

    Nothing here ever writes it: the launcher hands it to its workers in their environment
    (``FARLINK_SECRET``), where neither ``ps`` nor the run directory shows it.
    """
    if secret and secret_file:
        raise ValueError("give the run secret once: --secret or --secret-file, not both")
    if secret:
        return secret
    if secret_file:
        return read_secret_file(secret_file)
    return os.environ.get(SECRET_ENV) or None


def run_secret(cfg: TrustOptions) -> str | None:
    """The secret of a run with ``--auth secret`` (None for other kinds); a ValueError that
    names the sources when there is none."""
    if (cfg.auth or "none").strip().lower() != "secret":
        return None
    secret = resolve_secret(cfg.secret, cfg.secret_file)
    if not secret:
        raise ValueError(f"auth 'secret' needs the run secret: give {SECRET_SOURCES}")
    return secret


def run_authenticator(cfg: TrustOptions, peer_id: str,
                      verifier: bool = False) -> Authenticator | None:
    """The authenticator a run's processes prove or check membership with; None for ``none``.

    ``verifier`` builds one that only checks proofs (the Lighthouse gate needs no member key).
    """
    if (cfg.auth or "none").strip().lower() == "none":
        return None
    secret = run_secret(cfg)
    return make_authenticator(cfg.auth, secret=secret,
                              key_file=None if verifier else cfg.key_file,
                              allowed_keys=cfg.allowed_keys, peer_id=peer_id)
