"""hivemind's Matchmaking with client-mode followers accepted whatever their schedule.

In hivemind's matchmaking every peer that accepts connections declares itself in the DHT with an
expiration time (when its window to form a group ends); peers rank would-be leaders by it, and a
leader turns away a join request whose expiration is earlier than its own
(``BAD_EXPIRATION_TIME``), so that two peers never follow each other. A client-mode peer never
declares and can never lead, yet its request still carries its own schedule. When it expects the
round sooner than the leader does (each member estimates its boundary from its own training time),
the leader refuses it, the client marks the leader as tried until the leader declares again, and
the group forms only when the leader's window has run out: a whole ``matchmaking_time`` after all
members were looking. Accepting a client whatever its expiration breaks no ranking (it leads
nobody) and forms the group as soon as everyone looks.
"""

from __future__ import annotations

from math import isfinite
from typing import Any

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.proto import averaging_pb2


class ClientAwareMatchmaking(Matchmaking):
    """Matchmaking whose leader ranks join requests by expiration only among peers that can
    lead: a client-mode request is checked as if it expired with the leader's own window."""

    def _check_reasons_to_reject(self, request: averaging_pb2.JoinRequest, context: Any) -> Any:
        declared = self.potential_leaders.declared_expiration_time
        if request.client_mode and isfinite(declared) and request.expiration < declared:
            ranked_as_leader = averaging_pb2.JoinRequest()
            ranked_as_leader.CopyFrom(request)
            ranked_as_leader.expiration = declared
            request = ranked_as_leader
        return super()._check_reasons_to_reject(request, context)
