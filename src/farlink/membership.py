"""Who belongs to a run, read from its config: the run's secret and the authenticator each of
its processes proves (or checks) membership with. Application side: the library's
:mod:`farlink.robust.auth` takes the kind, the secret and the key files as arguments."""

from __future__ import annotations

from farlink.config import RunConfig
from farlink.robust.auth import SECRET_SOURCES, Authenticator, make_authenticator, resolve_secret


def run_secret(cfg: RunConfig) -> str | None:
    """The secret of a run with ``--auth secret`` (None for other kinds); a ValueError that
    names the sources when there is none."""
    if (cfg.auth or "none").strip().lower() != "secret":
        return None
    secret = resolve_secret(cfg.secret, cfg.secret_file)
    if not secret:
        raise ValueError(f"auth 'secret' needs the run secret: give {SECRET_SOURCES}")
    return secret


def run_authenticator(cfg: RunConfig, peer_id: str, verifier: bool = False) -> Authenticator | None:
    """The authenticator a run's processes prove or check membership with; None for ``none``.

    ``verifier`` builds one that only checks proofs (the Lighthouse gate needs no member key).
    """
    if (cfg.auth or "none").strip().lower() == "none":
        return None
    secret = run_secret(cfg)
    return make_authenticator(cfg.auth, secret=secret,
                              key_file=None if verifier else cfg.key_file,
                              allowed_keys=cfg.allowed_keys, peer_id=peer_id)
