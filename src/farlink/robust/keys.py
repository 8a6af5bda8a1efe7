"""Ed25519 key files: how a run's members are named and how a peer proves it is one of them.

A peer keeps a private key (PKCS#8 PEM, mode 0600) and hands its public key (one hex line) to the
run's organizer, who collects the members' public keys in an *allowed keys* file (one hex or
base64 key per line, ``#`` comments allowed) or a directory of ``*.pub`` files. A peer's id is the
key id: the first 8 bytes of SHA-256 of its raw public key, in hex, so an id cannot be claimed
without the matching private key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_ID_BYTES = 8
PUBLIC_SUFFIX = ".pub"


class KeyFileError(ValueError):
    """A key file that is missing, unreadable or does not hold an Ed25519 key."""


def raw_public(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_key_text(public_key: Ed25519PublicKey) -> str:
    """The one-line form used in ``.pub`` and allowed-keys files (64 hex digits)."""
    return raw_public(public_key).hex()


def key_id_bytes(public_key: Ed25519PublicKey) -> bytes:
    return hashlib.sha256(raw_public(public_key)).digest()[:KEY_ID_BYTES]


def key_id(public_key: Ed25519PublicKey) -> str:
    """The peer id that belongs to ``public_key`` (16 hex digits)."""
    return key_id_bytes(public_key).hex()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """Read a public key written as 64 hex digits or as base64 of the 32 raw bytes."""
    text = text.strip()
    raw: bytes | None = None
    if len(text) == 64:
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = None
    if raw is None:
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raw = None
    if raw is None or len(raw) != 32:
        raise KeyFileError(f"not an Ed25519 public key (64 hex digits or base64 of 32 bytes): "
                           f"{text[:20]!r}")
    return Ed25519PublicKey.from_public_bytes(raw)


def _read_bytes(path: Path, what: str) -> bytes:
    path = Path(path)
    if not path.exists():
        raise KeyFileError(f"{what} {path} does not exist")
    if path.is_dir():
        raise KeyFileError(f"{what} {path} is a directory, expected a file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Load a peer's private key (PEM as written by :func:`generate_keypair`, or 64 hex digits)."""
    data = _read_bytes(path, "private key file")
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            key = serialization.load_pem_private_key(data, password=None)
        else:
            key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(data.decode().strip()))
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"private key file {path} does not hold an unencrypted Ed25519 "
                           f"key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"private key file {path} holds a {type(key).__name__}, not Ed25519")
    return key


def _parse_key_lines(text: str, source: Path) -> list[Ed25519PublicKey]:
    keys = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            keys.append(parse_public_key(line.split()[0]))
        except KeyFileError as exc:
            raise KeyFileError(f"{source}:{lineno}: {exc}") from exc
    return keys


def load_public_keys(path: Path) -> list[Ed25519PublicKey]:
    """Every public key in a file (one per line) or in the ``*.pub`` files of a directory."""
    path = Path(path)
    if not path.exists():
        raise KeyFileError(f"allowed keys {path} does not exist")
    if path.is_dir():
        files = sorted(path.glob(f"*{PUBLIC_SUFFIX}"))
        if not files:
            raise KeyFileError(f"allowed keys directory {path} has no *{PUBLIC_SUFFIX} files")
    else:
        files = [path]
    keys: list[Ed25519PublicKey] = []
    for file in files:
        data = _read_bytes(file, "public key file")
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            raise KeyFileError(f"public key file {file} is not text") from exc
        keys.extend(_parse_key_lines(text, file))
    return keys


def load_allowed_keys(path: Path) -> dict[str, Ed25519PublicKey]:
    """The run's members by peer id; an empty list is an error (it would admit nobody)."""
    keys = {key_id(k): k for k in load_public_keys(path)}
    if not keys:
        raise KeyFileError(f"allowed keys {path} lists no keys")
    return keys


def generate_keypair(path: Path, overwrite: bool = False) -> str:
    """Write a new private key to ``path`` (0600) and its public key to ``path`` + ``.pub``.

    Returns the public key text. Refuses to replace an existing key unless ``overwrite``: losing a
    private key silently would lock its peer out of the run.
    """
    path = Path(path)
    pub_path = path.with_name(path.name + PUBLIC_SUFFIX)
    if not overwrite:
        for p in (path, pub_path):
            if p.exists():
                raise KeyFileError(f"{p} already exists (pass overwrite to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)
    text = public_key_text(key.public_key())
    pub_path.write_text(text + "\n")
    return text


def load_or_generate(path: Path) -> Ed25519PrivateKey:
    """The private key kept at ``path``, made there (0600, with its ``.pub``) the first time:
    a peer that names itself by its key keeps one name across restarts."""
    path = Path(path).expanduser()
    if not path.exists():
        try:
            generate_keypair(path)
        except KeyFileError:
            pass  # another process made it between the check and here: read that one
    return load_private_key(path)
