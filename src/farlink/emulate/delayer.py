"""The packet delayer: holds each queued packet for its path's delay, then lets it through.

This kernel has no ``netem``, so one-way delay is added in user space: an iptables rule on the
*receiving* namespace's INPUT chain sends packets to NFQUEUE, this process gets each packet's
verdict slot, and gives the ``accept`` verdict when the packet's release time comes (the kernel
keeps the packet meanwhile; only its IP header is copied up here). Delaying on INPUT, not OUTPUT,
keeps the sender's TCP stack and qdisc unaware of the hold, as on a real long wire.

Per source address: delay, jitter (uniform in +-jitter, never reordering packets of one source,
so jitter shows up as delay variation rather than as TCP-hostile reordering) and loss.
Packets from unlisted sources pass at once. The process exits when its parent goes away, so a
crashed topology owner does not leave it running.

Run as ``python -m farlink.emulate.delayer --queue 0 --rules '{"10.77.0.2": [0.04, 0, 0]}'``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import select
import signal
import socket
import sys
import time
import warnings

READY = "delayer-ready"
PARENT_POLL_S = 0.5


def parse_rules(text: str) -> dict[bytes, tuple[float, float, float]]:
    """``{"a.b.c.d": [delay_s, jitter_s, loss]}`` -> packed address -> tuple, validated."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise TypeError("rules must be a JSON object of address -> [delay_s, jitter_s, loss]")
    rules: dict[bytes, tuple[float, float, float]] = {}
    for addr, spec in raw.items():
        delay, jitter, loss = (float(x) for x in spec)
        if delay < 0 or jitter < 0 or not 0 <= loss < 1:
            raise ValueError(f"bad rule for {addr}: {spec!r}")
        rules[socket.inet_aton(addr)] = (delay, jitter, loss)
    return rules


def serve(queue_num: int, rules: dict[bytes, tuple[float, float, float]], seed: int) -> None:
    from netfilterqueue import COPY_PACKET, NetfilterQueue

    rng = random.Random(seed)
    held: list[tuple[float, int, object]] = []  # (release time, sequence, packet)
    last_release: dict[bytes, float] = {}
    seq = 0
    clock = time.monotonic

    def on_packet(packet) -> None:
        nonlocal seq
        header = packet.get_payload()
        rule = rules.get(header[12:16]) if len(header) >= 20 else None
        if rule is None:
            packet.accept()
            return
        delay, jitter, loss = rule
        if loss and rng.random() < loss:
            packet.drop()
            return
        if jitter:
            delay = max(0.0, delay + rng.uniform(-jitter, jitter))
        src = header[12:16]
        release = max(clock() + delay, last_release.get(src, 0.0))
        last_release[src] = release
        heapq.heappush(held, (release, seq, packet))
        seq += 1

    queue = NetfilterQueue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # rcvbuf capped by rmem_max: still works
        # only the IP header is copied to user space; the kernel holds the rest
        queue.bind(queue_num, on_packet, max_len=200_000, mode=COPY_PACKET, range=20,
                   sock_len=32 << 20)
    fd = queue.get_fd()
    parent = os.getppid()
    stop = False

    def on_term(signum, frame) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print(READY, flush=True)
    next_parent_check = clock() + PARENT_POLL_S
    while not stop:
        now = clock()
        while held and held[0][0] <= now:
            heapq.heappop(held)[2].accept()
        if now >= next_parent_check:
            if os.getppid() != parent:
                break
            next_parent_check = now + PARENT_POLL_S
        timeout = min(next_parent_check - now, (held[0][0] - now) if held else PARENT_POLL_S)
        try:
            ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
        except InterruptedError:
            continue
        if ready:
            queue.run(block=False)
    for _, _, packet in held:  # let what is in flight through rather than leave it queued
        packet.accept()
    queue.unbind()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--rules", required=True, help="JSON: address -> [delay_s, jitter_s, loss]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        rules = parse_rules(args.rules)
    except (ValueError, TypeError, OSError) as exc:
        print(f"delayer: invalid --rules: {exc}", file=sys.stderr)
        return 2
    serve(args.queue, rules, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
