"""A pipeline across the namespace emulator: 2 stages x 2 peers and the trainer, each in its own
namespace behind a ``home`` link (50 Mbit/s up, 60 ms), training through real shaped links."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from farlink.data import prepare_data
from farlink.emulate.capabilities import detect_capabilities
from farlink.emulate.pipeline import interface_bytes, start_stage_peers
from farlink.emulate.topology import Topology
from farlink.parallel.stage_auth import TOKEN_ENV, driver_token
from farlink.model import preset_config

CAPS = detect_capabilities()
netns_only = pytest.mark.skipif(not CAPS.full,
                                reason=f"namespace emulation unavailable: {CAPS.reason}")

TRAINER = 4  # namespaces 0-3 hold the stage peers (s0p0, s0p1, s1p0, s1p1)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.serial  # step seconds over shaped home links: alone on the machine
@netns_only
def test_two_stages_of_two_peers_train_over_home_links(cache_dir: Path) -> None:
    vocab = prepare_data("kjv", 512, cache_dir).vocab_size  # the trainer reads this cache
    config = preset_config("tiny", vocab_size=vocab, seq_len=32)
    with Topology(5, "home") as topo:
        stages = start_stage_peers(topo, config, stages=2, peers_per_stage=2, lr=1e-2)
        before = interface_bytes(topo, TRAINER)
        trainer = topo.spawn(TRAINER, [sys.executable, "-m", "farlink.emulate.pipeline",
                                       "--stages", json.dumps(stages), "--steps", "8",
                                       "--average-every", "4", "--cache-dir", str(cache_dir)],
                             {TOKEN_ENV: driver_token()},  # it drives the peers started here
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, err[-2000:]
        after = interface_bytes(topo, TRAINER)
    report = json.loads(out.strip().splitlines()[-1])
    moved = {k: after[k] - before[k] for k in after}
    counted = sum(report["bytes"].values())
    print(f"held-out {report['heldout_before']:.3f} -> {report['heldout_after']:.3f}; "
          f"step s {[round(s, 2) for s in report['seconds']]}; bytes by kind {report['bytes']}; "
          f"trainer interface {moved}")
    assert report["heldout_after"] < report["heldout_before"] - 0.3  # training proceeds
    assert report["reroutes"] == 0
    # activations go stage to stage through the trainer, their gradients come back
    assert report["bytes"]["activations"] > 0 and report["bytes"]["gradients"] > 0
    # every counted frame crossed the trainer's emulated link; the kernel adds TCP/IP headers,
    # handshakes and acknowledgements on top, and nothing else uses that link
    assert counted <= moved["tx_bytes"] + moved["rx_bytes"] <= 1.25 * counted
    # a micro-batch's forward, loss and backward each wait for a request and its reply across a
    # 60 ms one-way path (trainer link + peer link): a step can never beat 3 round trips
    assert min(report["seconds"]) > 3 * 2 * 0.060
