"""Did every member receive the same update from each member?

A member that sends one update to some groupmates and another to the rest (equivocation) makes
each receiver aggregate a different set of updates, so replicas commit different states and
nothing notices. After the gather, members all-gather a short digest of each slot they received
(``SLOT_DIGEST`` bytes per slot) and compare: a slot whose digests differ between members was
not the same everywhere, and the round must not commit anywhere. The owner of that slot is the
one named: it is the only member that could have sent different bytes (an honest groupmate that
reports a wrong digest can fail the round too, as it can by voting no, but it cannot make two
replicas commit different states).
"""

from __future__ import annotations

import hashlib

SLOT_DIGEST = 8
#: the digest reported for an empty slot (nothing arrived): the collective fails such a round
#: itself, and a member is not named for a payload lost on the way
MISSING = bytes(SLOT_DIGEST)


def slot_digests(received: list[bytes]) -> bytes:
    """The digest of each slot received, concatenated in slot order."""
    return b"".join(hashlib.sha256(r).digest()[:SLOT_DIGEST] if r else MISSING
                    for r in received)


def differing_slots(reports: list[bytes], slots: int) -> dict[int, list[int]]:
    """Slots whose digests are not the same in every member's report: slot -> the members
    whose report disagrees with the majority's. A report of the wrong length (a member that
    sent nothing or garbage) is left out; a missing slot is left out of that slot's count."""
    size = slots * SLOT_DIGEST
    valid = [(m, r) for m, r in enumerate(reports) if len(r) == size]
    out: dict[int, list[int]] = {}
    for slot in range(slots):
        seen: dict[bytes, list[int]] = {}
        for member, report in valid:
            digest = report[slot * SLOT_DIGEST:(slot + 1) * SLOT_DIGEST]
            if digest != MISSING:
                seen.setdefault(digest, []).append(member)
        if len(seen) > 1:
            majority = max(seen.values(), key=len)
            out[slot] = sorted(m for group in seen.values() if group is not majority
                               for m in group)
    return out
