"""In-process link emulation: timing of the shaped link, bandwidth sharing, a shaped collective
on the real in-process backend, profile validation, and the capability fallback message."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from farlink.comm.inprocess import InProcessGroup
from farlink.links import LinkError, LinkProfile, get_profile, scaled
from farlink.emulate.shaper import ShapedCollective, ShapedLink

torch.set_num_threads(1)


def within(measured: float, expected: float, tol: float = 0.2, wake_up_s: float = 0.1) -> bool:
    """Never faster than the link allows; later only by ``tol`` plus the scheduler's wake-up lag
    (a sleeping thread on a loaded 2-core machine wakes tens of ms late)."""
    return expected * (1 - tol) <= measured <= expected * (1 + tol) + wake_up_s


@pytest.mark.parametrize("nbytes,hops", [(1_000_000, 1), (250_000, 4), (0, 5)])
def test_send_takes_latency_plus_serialization(nbytes: int, hops: int) -> None:
    link = ShapedLink(LinkProfile(bandwidth_mbit=80, latency_ms=20.0))
    expected = hops * 0.020 + nbytes * 8 / 80e6
    assert link.transfer_time(nbytes, hops) == pytest.approx(expected)
    t = time.perf_counter()
    held = link.send(nbytes, hops)
    elapsed = time.perf_counter() - t
    assert within(elapsed, expected), (elapsed, expected)
    assert held == pytest.approx(elapsed, abs=0.05)


def test_concurrent_senders_share_the_rate() -> None:
    link = ShapedLink(LinkProfile(bandwidth_mbit=40))
    finish: list[float] = []
    t0 = time.perf_counter()

    def send() -> None:
        link.send(500_000)
        finish.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=send) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # 2 x 0.5 MB through one 40 Mbit/s wire: the first done at 0.1 s, the second at 0.2 s
    assert within(min(finish), 0.1) and within(max(finish), 0.2), finish


def test_downlink_and_loss_are_charged() -> None:
    home = get_profile("home")
    assert ShapedLink(home, direction="down").bytes_per_s == 200e6 / 8
    lossy = ShapedLink(LinkProfile(bandwidth_mbit=80, loss=0.2))
    assert lossy.transfer_time(800_000) == pytest.approx(800_000 / 0.8 * 8 / 80e6)


def test_unshaped_link_does_not_wait() -> None:
    t = time.perf_counter()
    ShapedLink("loopback").send(10**9)
    assert time.perf_counter() - t < 0.2  # 1 GB through a shaped link would take seconds


def test_shaped_collective_on_inprocess_backend() -> None:
    group = InProcessGroup(2)
    link_profile = LinkProfile(bandwidth_mbit=80, latency_ms=10.0)
    members = [ShapedCollective(group.member(r), ShapedLink(link_profile)) for r in range(2)]
    tensors = [torch.full((262_144,), float(r + 1)) for r in range(2)]  # 1 MiB of float32 each
    elapsed: list[float] = [0.0, 0.0]

    def worker(r: int) -> None:
        members[r].begin_round()
        t = time.perf_counter()
        members[r].all_reduce_sum([tensors[r]])
        elapsed[r] = time.perf_counter() - t
        assert members[r].commit()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for r in range(2):
        assert torch.all(tensors[r] == 3.0)
        sent = members[r].stats.bytes_sent
        assert sent == 2**20  # ring all-reduce over 2: 2 (n-1)/n x 1 MiB
        expected = 2 * 0.010 + sent * 8 / 80e6
        assert within(members[r].stats.comm_seconds, expected), members[r].stats
        assert elapsed[r] >= expected * 0.8


@pytest.mark.parametrize("kwargs", [
    {"bandwidth_mbit": -1, "latency_ms": 1}, {"bandwidth_mbit": 10, "latency_ms": -1},
    {"bandwidth_mbit": 10, "latency_ms": 1, "jitter_ms": 5}, {"bandwidth_mbit": 10, "loss": 1.0},
    {"bandwidth_mbit": float("nan")},
])
def test_bad_profiles_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):  # pydantic's ValidationError names the field
        LinkProfile(**kwargs)


def test_profile_lookup_and_scaling() -> None:
    assert get_profile("Cross-Region").latency_ms == 40
    with pytest.raises(LinkError, match="choose from"):
        get_profile("moon")
    s = scaled("home", 10)
    assert (s.up_mbit, s.down_mbit, s.latency_ms, s.jitter_ms) == (10, 40, 60, 10)


def _readable_by_others(path: Path) -> bool:
    """True when an unprivileged user can reach ``path`` (every parent searchable by others)."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop privileges for the check")
def test_capabilities_explain_missing_privileges() -> None:
    import farlink
    for needed in (Path(farlink.__file__).parent, Path(sys.executable).parent):
        if not _readable_by_others(needed):
            pytest.skip(f"{needed} is not reachable by an unprivileged user (a 0700 parent)")
    code = ("import json, dataclasses\n"
            "from farlink.emulate.capabilities import detect_capabilities\n"
            "print(json.dumps(dataclasses.asdict(detect_capabilities())))")
    proc = subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--inh-caps=-all",
         sys.executable, "-c", code],
        check=False, capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": "/tmp"})
    assert proc.returncode == 0, proc.stderr
    caps = json.loads(proc.stdout)
    assert caps["netns"] is False and caps["nfqueue"] is False
    assert "not root" in caps["reason"] and "CAP_NET_ADMIN" in caps["reason"]
