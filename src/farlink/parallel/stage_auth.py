"""Who may talk to a stage peer: only its run's driver, proven on every connection.

A stage peer obeys whatever arrives on its port (weights out, weights in, checkpoints,
shutdown), so every connection first answers a fresh challenge with the run's
:class:`~farlink.robust.auth.Authenticator`, in the admission gate's frames
(:mod:`farlink.robust.gate`: ``FLG1`` challenge, ``FLP1`` proof, ``FLA1`` verdict); nothing
is read as a request before the proof verifies. The credential is the driver's: the process
that starts the stage peers generates a random per-run token (:func:`new_token`) and hands it
to them in their environment (``FARLINK_STAGE_TOKEN``, never on the command line, so ``ps``
does not show it). The run's ``--auth secret`` proves membership, not which member, so it
cannot name the driver; a library user may pass an :class:`~farlink.robust.auth.Ed25519Auth`
instead, and then :func:`may_send` keeps the control operations (weights in, steps,
checkpoints, shutdown) to the driver's key while other admitted members may only compute.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct

from farlink.comm.sockets import recv_exact
from farlink.robust.auth import Authenticator, AuthError, SharedSecretAuth
from farlink.robust.gate import (ADMITTED, CHALLENGE_TAG, MAX_CHALLENGE, MAX_PROOF, MAX_TEXT,
                                 PROOF_TAG, REFUSED, VERDICT_TAG, ProtocolError, frame,
                                 frame_length, verdict)

TOKEN_ENV = "FARLINK_STAGE_TOKEN"
DRIVER = "driver"  # the peer id the driver proves with its token

#: operations that change or end a stage peer: only its driver may send them
CONTROL_OPS = frozenset({"load", "step", "save", "restore", "shutdown"})
#: operations a stage peer serves at all (anything else is refused before it runs)
OPS = CONTROL_OPS | {"ping", "forward", "loss", "backward", "evaluate", "grads", "tied_grad",
                     "state"}

HANDSHAKE_TIMEOUT = 5.0  # a driver needs one round trip


class StageAuthError(RuntimeError):
    """The stage peer refused this driver's proof: a wrong token, not a failure to route
    around (every peer of the run would refuse it too)."""


def new_token() -> str:
    """A fresh random per-run token (256 bits)."""
    return secrets.token_hex(32)


_process_token: str | None = None


def driver_token() -> str:
    """This process's token: the one its starter handed it in ``FARLINK_STAGE_TOKEN`` (a
    trainer started beside the stage peers it drives, e.g. in another network namespace), else
    one made on first use. The stage peers it starts and the trainers it builds share it by
    default, so a process driving its own peers needs no setup."""
    global _process_token
    if _process_token is None:
        _process_token = os.environ.get(TOKEN_ENV) or new_token()
    return _process_token


def driver_auth(token: str | None = None) -> Authenticator:
    """The authenticator a driver proves with and a stage peer checks: HMAC with ``token``."""
    return SharedSecretAuth(token or driver_token(), peer_id=DRIVER)


def auth_from_env() -> Authenticator:
    """A stage peer's authenticator from ``FARLINK_STAGE_TOKEN``; a ValueError saying what
    to do when its starter gave none (a stage peer never serves unauthenticated)."""
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"a stage peer serves only its run's driver: set {TOKEN_ENV} to the "
                         "driver's token (farlink train and start_stage_peer do this)")
    return driver_auth(token)


def may_send(op: str, peer_id: str, drivers: frozenset[str]) -> str | None:
    """None when ``peer_id`` may send ``op``; else why not (the policy of a stage peer)."""
    if op not in OPS:
        return f"unknown operation {op!r}"
    if op in CONTROL_OPS and peer_id not in drivers:
        return f"{op!r} is a control operation: only the run's driver may send it"
    return None


# -- the handshake on blocking sockets (the stage server and trainer are threaded) --------------
def _read(sock: socket.socket, n: int) -> bytes:
    return recv_exact(sock, n, closed=f"connection closed mid-handshake before {n} bytes")


def _read_frame(sock: socket.socket, tag: bytes, limit: int) -> bytes:
    return _read(sock, frame_length(_read(sock, len(tag) + 2), tag, limit))


def admit(sock: socket.socket, auth: Authenticator,
          timeout: float = HANDSHAKE_TIMEOUT) -> tuple[str | None, str]:
    """Server side: (the proven peer id, "") or (None, why refused). The socket's timeout is
    ``timeout`` during the handshake and none after (a request may wait for compute)."""
    sock.settimeout(timeout)
    challenge = auth.make_challenge()
    try:
        sock.sendall(frame(CHALLENGE_TAG, challenge))
        peer_id = auth.check_proof(challenge, _read_frame(sock, PROOF_TAG, MAX_PROOF))
    except TimeoutError:
        return None, f"no complete proof within {timeout:g} s"
    except (AuthError, ProtocolError) as exc:
        reason = str(exc)
    except OSError as exc:
        return None, f"connection failed during the handshake: {exc}"
    else:
        sock.sendall(verdict(ADMITTED, peer_id))
        sock.settimeout(None)
        return peer_id, ""
    try:
        sock.sendall(verdict(REFUSED, reason))
    except OSError:
        pass
    return None, reason


def prove(sock: socket.socket, auth: Authenticator, where: str,
          timeout: float = HANDSHAKE_TIMEOUT) -> str:
    """Client side: answer the stage peer's challenge; its verdict's text (our peer id).
    StageAuthError (naming ``where`` and what to do) when the peer refuses the proof,
    ConnectionError when what answers is no stage peer."""
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        challenge = _read_frame(sock, CHALLENGE_TAG, MAX_CHALLENGE)
        sock.sendall(frame(PROOF_TAG, auth.prove(challenge)))
        head = _read(sock, len(VERDICT_TAG) + 3)
        if head[:len(VERDICT_TAG)] != VERDICT_TAG:
            raise ProtocolError(f"not a farlink verdict: {head[:4]!r}")
        code, n = struct.unpack("<BH", head[len(VERDICT_TAG):])
        text = _read(sock, min(n, MAX_TEXT)).decode(errors="replace")
    except (ProtocolError, AuthError) as exc:
        raise ConnectionError(f"stage peer {where} did not complete the handshake ({exc}); is "
                              "it a farlink stage peer of this version?") from None
    finally:
        sock.settimeout(previous)
    if code != ADMITTED:
        raise StageAuthError(f"stage peer {where} refused this driver: {text}. It serves only "
                             f"the process that started it (the token in {TOKEN_ENV})")
    return text
