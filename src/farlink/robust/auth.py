"""Message authentication: every update carries proof that a member of the run sent it."""

from __future__ import annotations

import hashlib
import hmac


class AuthError(ValueError):
    """A message whose signature does not verify, or a peer that is not a member."""


class Authenticator:
    """No authentication: messages pass through unchanged (trusted, organizational runs)."""

    name = "none"
    overhead = 0

    def sign(self, message: bytes) -> bytes:
        return message

    def verify(self, message: bytes) -> bytes:
        return message


class SharedSecretAuth(Authenticator):
    """HMAC-SHA256 with a run secret: cheap, for runs whose members all hold one key."""

    name = "secret"
    overhead = 32

    def __init__(self, secret: str | bytes) -> None:
        if not secret:
            raise ValueError("an empty secret authenticates nobody")
        self._key = secret.encode() if isinstance(secret, str) else secret

    def sign(self, message: bytes) -> bytes:
        return message + hmac.new(self._key, message, hashlib.sha256).digest()

    def verify(self, message: bytes) -> bytes:
        if len(message) < self.overhead:
            raise AuthError("message shorter than its MAC")
        body, tag = message[: -self.overhead], message[-self.overhead :]
        if not hmac.compare_digest(tag, hmac.new(self._key, body, hashlib.sha256).digest()):
            raise AuthError("MAC does not verify (wrong run secret or tampered message)")
        return body
