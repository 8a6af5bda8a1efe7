"""Round payloads of a few MB travel as slices on parallel streams (real hivemind daemons and
sockets): every member still gets every payload byte for byte and in rank order, a server's
mailbox saw the slices, the bytes booked are the payloads', and small payloads and votes go
whole on one stream. A peer asking for more slices than any sender uses is refused. Closing
after such a round leaves nothing pending on the collective's loop."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_hivemind_early_matchmaking import FAST, in_threads

from farlink.comm.hivemind_backend import (
    STREAM_PART_MIN,
    STREAM_PARTS,
    HivemindCollective,
    slice_in,
    slice_of,
    stream_parts,
)

BIG = STREAM_PARTS * STREAM_PART_MIN + 12_345  # sliced into STREAM_PARTS, unevenly
SMALL = STREAM_PART_MIN + 1  # under two slices' worth: one stream


def payload(name: str, size: int) -> bytes:
    return random.Random(f"{name}/{size}").randbytes(size)


def sliced_rounds() -> tuple[dict, dict, dict]:
    """A round of BIG and one of SMALL payloads among two servers and a client-mode member."""
    first = HivemindCollective("sliced", target_group_size=3, min_group_size=3, **FAST)
    members = {
        "a": first,
        "b": HivemindCollective("sliced", first.maddrs, target_group_size=3, min_group_size=3,
                                **FAST),
        "c": HivemindCollective("sliced", first.maddrs, client_mode=True, target_group_size=3,
                                min_group_size=3, **FAST),
    }

    def gather(size: int):
        def one(name: str, coll: HivemindCollective) -> tuple:
            info = coll.begin_round()
            before = coll.stats.bytes_sent
            got = coll.all_gather_bytes(payload(name, size))
            sent = coll.stats.bytes_sent - before
            slices = {key: len(pieces) for key, pieces in coll._mailbox.slots.items()
                      if b"/part/" in key}
            return info, got, sent, slices, coll.commit()
        return one

    try:
        return members, in_threads(gather(BIG), members), in_threads(gather(SMALL), members)
    finally:
        for coll in members.values():
            coll.close()


def test_payloads_split_over_streams_arrive_whole_in_rank_order() -> None:
    members, big, small = sliced_rounds()
    for name, coll in members.items():  # closed: nothing left pending on its loop (the process
        # test below, slow, also sees that no task is destroyed pending at exit)
        pending = asyncio.all_tasks(coll._loop)
        assert not pending, (name, pending)

    for size, results in ((BIG, big), (SMALL, small)):
        order = results["a"][0].peers  # rank order: the same list on every member
        names = {str(members[n].peer_id): n for n in members}
        want = [payload(names[str(p)], size) for p in order]
        for name, (info, got, sent, slices, ok) in results.items():
            assert ok and info.peers == order, name
            assert got == want, f"{name} got other bytes than were sent ({size} B payloads)"
            client = name == "c"
            if client:  # pushes to both servers; fetches the rest
                assert sent == 2 * size
            else:  # pushes to the other server, serves the client if it is its server
                assert sent in (size, 3 * size), (name, sent)
            if size == BIG and not client:  # each pushing member's payload came in slices
                assert sorted(slices.values()) == [STREAM_PARTS] * 2, (name, slices)
            else:
                assert slices == {}, (name, slices)
        assert sorted(r[2] for r in results.values()) == [size, 2 * size, 3 * size]


def test_slices_cover_the_payload_and_bad_slice_requests_are_refused() -> None:
    data = bytes(range(256)) * 41
    for parts in range(1, STREAM_PARTS + 1):
        assert b"".join(slice_of(data, i, parts) for i in range(parts)) == data
    assert stream_parts(10 * STREAM_PART_MIN, "data") == STREAM_PARTS
    assert stream_parts(2 * STREAM_PART_MIN, "data") == 2
    assert stream_parts(10 * STREAM_PART_MIN, "control") == 1  # votes: one stream
    assert slice_in({}) == (0, 1)  # a peer that sends whole payloads
    for bad in ({"part": 0, "parts": STREAM_PARTS + 1}, {"part": 4, "parts": 4},
                {"part": -1, "parts": 2}, {"part": 0, "parts": 0}):
        with pytest.raises(ValueError, match="slices"):
            slice_in(bad)


@pytest.mark.slow  # a process for the same rounds: by default the loops' pending tasks are
# checked after test_payloads_split_over_streams_arrive_whole_in_rank_order's rounds
def test_closing_after_a_round_leaves_no_task_pending() -> None:
    """Handlers still waiting when the collective closes (a fetch waiting out its deadline)
    are cancelled, not dropped with the stopped loop: no "Task was destroyed but it is
    pending!" lines on the console at exit."""
    here = Path(__file__).parent
    script = (f"import sys; sys.path.insert(0, {str(here)!r}); "
              "import test_hivemind_sliced_payloads as t; t.sliced_rounds(); "
              "import gc; gc.collect()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Task was destroyed" not in done.stderr, done.stderr[-3000:]
