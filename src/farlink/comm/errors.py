"""Errors a communication backend raises when it cannot do its job at all.

Peer failures inside a round are not errors (``commit`` returns False); these are for conditions
a person has to fix: a daemon that cannot start, a swarm that cannot be reached, a round nobody
joins. Each message states the cause and a suggested fix, because the underlying libraries
(libp2p daemon, gRPC) report them in terms that do not point at the remedy.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """A backend cannot start, reach its peers, or finish a round; the message says how to fix it."""


class DaemonFailed(CommError):
    """The transport's helper daemon (e.g. hivemind's p2pd) did not start."""


class PeerUnreachable(CommError):
    """No initial peer could be reached, or an address is malformed."""


class RoundTimeout(CommError):
    """Matchmaking or a collective did not complete within its timeout."""


class MembershipRefused(PeerUnreachable):
    """A run with ``--auth``: the initial peers did not accept this peer (down, or they refused
    its membership proof)."""
