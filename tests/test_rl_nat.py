"""A rollout worker process behind a home router's NAT takes part in `farlink rl --listen`.

Issue 34's workers "may sit behind NAT on home links": a `farlink rl-worker` only dials out,
so a worker nobody can dial still fetches the policy and hands in. Here the trainer process
runs in a public namespace of the emulator, one worker process in a namespace behind the
emulated NAT on a (scaled) home link and one public worker on the same link beside it. The
subject is the process on a network, so these are real processes in real namespaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from farlink.emulate import nat, sysnet
from farlink.emulate.capabilities import detect_capabilities
from farlink.emulate.topology import Topology
from farlink.links import scaled

CAPS = detect_capabilities()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.serial,  # home links shaped by user-space delayers: alone on the machine
    pytest.mark.skipif(not CAPS.full, reason=f"namespace emulation unavailable: {CAPS.reason}"),
]
SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {"PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
TRAINER_PORT = 24118
STEPS = 3
HOME = scaled("home", 20)  # home's delay and jitter at a rate the delayers keep up with


def test_a_natted_worker_process_hands_in_and_nobody_can_dial_it(tmp_path) -> None:
    from test_emulate_nat import dial, serve  # the NAT test's listener and dialer

    out = tmp_path / "run"
    with Topology(3, "loopback", overrides={1: HOME, 2: HOME}, behind_nat={1}) as topo:
        trainer_at = f"{topo.address(0)}:{TRAINER_PORT}"
        # the workers start first and dial until the trainer serves
        workers = {name: topo.spawn(i, [sys.executable, "-m", "farlink.train.rl_worker",
                                        "--connect", trainer_at, "--name", name,
                                        "--identity", str(tmp_path / f"{name}.key"),
                                        "--pace-seconds", "0.1", "--reconnect-s", "300"],
                                    ENV, stdout=subprocess.DEVNULL)
                   for i, name in ((1, "natted"), (2, "public"))}
        # the run is over in seconds once it starts: the NATed worker must be dialing by then
        # (its router tracks the attempts), not still importing on a busy machine
        ready_by = time.monotonic() + 180
        while not nat.dialed(topo.nat_namespace(1)):
            assert time.monotonic() < ready_by, "the NATed worker never dialed the trainer"
            time.sleep(0.2)
        with open(tmp_path / "trainer.log", "w") as log:
            trainer = topo.spawn(0, [sys.executable, "-m", "farlink.cli", "rl", "--workers", "0",
                                     "--listen", trainer_at, "--steps", str(STEPS),
                                     "--pretrain-steps", "20", "--group-size", "4",
                                     "--groups-per-step", "2", "--max-staleness", "2",
                                     "--deadline", "30", "--out", str(out)],
                                 ENV, stdout=log, stderr=subprocess.STDOUT)
        # while the run goes on: a listener in the worker's namespace is reached from inside
        # only; from the trainer's namespace neither its public nor its private address answers
        probe = serve(topo, 1)
        assert dial(topo, 0, topo.wan_address(1)) == "TimeoutError"  # the router drops it
        # even with a route to the private address through the router, nothing gets through
        sysnet.ip(topo.namespace(0), "route", "add", f"{topo.address(1).rsplit('.', 1)[0]}.0/24",
                  "via", topo.wan_address(1))
        assert dial(topo, 0, topo.address(1)) == "TimeoutError"
        assert dial(topo, 1, topo.address(1)) == topo.address(1)
        probe.wait(10)

        assert trainer.wait(500) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert all(w.poll() is None for w in workers.values())  # not banned, not gone
        # the worker dialed the trainer and nobody else; dials from outside were dropped
        assert nat.dialed(topo.nat_namespace(1)) == {(topo.address(0), TRAINER_PORT)}
        assert nat.dropped_inbound_packets(topo.nat_namespace(1), "flkn1") >= 2

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["rejections"] == []  # every step committed
    # workers are known by key id; the labels they gave name them here
    label = summary["worker_labels"]
    accepted = {label[key]: count for key, count in summary["groups_accepted"].items()}
    assert accepted.get("natted", 0) > 0, accepted
    assert sum(accepted.values()) >= 2 * STEPS
    # the trainer saw the NATed worker at its router's public address, never its private one,
    # and the public worker at its own
    assert {label[key]: hosts for key, hosts in summary["worker_hosts"].items()} == {
        "natted": [topo.wan_address(1)], "public": [topo.address(2)]}
    assert len(summary["worker_hosts"]) == 2  # two keys, one label each
