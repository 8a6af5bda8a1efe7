"""torchft's healing transfer behind the gate: a member fetches the state, a non-member or a plain
HTTP client gets nothing, and the checkpoint server itself listens on loopback only."""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

from farlink.comm.torchft_admission import GatedHTTPTransport
from farlink.robust.auth import SharedSecretAuth
from farlink.robust.gate import GateRefused

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def source():
    transport = GatedHTTPTransport(SharedSecretAuth("run-secret", "w0"), "127.0.0.1", TIMEOUT)
    state = {"user": {"w": torch.arange(1000.0)}, "torchft": {"step": 7}}
    transport.send_checkpoint(dst_ranks=[1], step=7, state_dict=state, timeout=TIMEOUT)
    yield transport
    transport.shutdown(wait=True)


def test_member_heals_through_the_gate(source):
    healer = GatedHTTPTransport(SharedSecretAuth("run-secret", "w1"), "127.0.0.1", TIMEOUT)
    try:
        got = healer.recv_checkpoint(0, source.metadata(), 7, TIMEOUT)
    finally:
        healer.shutdown(wait=True)
    assert torch.equal(got["user"]["w"], torch.arange(1000.0)) and got["torchft"]["step"] == 7
    assert source._gate.admitted == ["w1", "w1"]  # the probe, then the fetch


def test_non_member_and_plain_http_get_nothing(source):
    thief = GatedHTTPTransport(SharedSecretAuth("guessed", "mallory"), "127.0.0.1", TIMEOUT)
    try:
        with pytest.raises(GateRefused, match="wrong run secret"):
            thief.recv_checkpoint(0, source.metadata(), 7, TIMEOUT)
    finally:
        thief.shutdown(wait=True)
    # torchft's own client, pointed at the advertised address, never gets past the handshake
    with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
        urllib.request.urlopen(f"{source.metadata()}7/full", timeout=5).read()
    # the gate records a refusal in its own thread, which may finish after the client has seen
    # its connection closed: wait for the second one (bounded), then count exactly
    deadline = time.monotonic() + 10
    while len(source._gate.refusals) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source._gate.admitted == [] and len(source._gate.refusals) == 2
    host, _ = source._server.server_address[:2]
    assert host == "127.0.0.1"  # the server behind the gate takes no outside connection


def test_peer_without_auth_fails_fast_at_a_gated_lighthouse():
    """Without --auth a worker would retry its quorum until the timeout (an hour for a joiner);
    it sees the gate's greeting and says what is missing instead."""
    import time

    from farlink.comm.torchft_backend import TorchftCollective
    from farlink.train.lighthouse import Lighthouse

    lighthouse = Lighthouse(authenticator=SharedSecretAuth("run-secret", "gate")).start()
    try:
        start = time.monotonic()
        with pytest.raises(GateRefused, match="admits members only"):
            TorchftCollective("w9", lighthouse.address, quorum_timeout=3600)
        assert time.monotonic() - start < 10
    finally:
        lighthouse.stop()
