"""A hostile torchft replica built from farlink's own collective, with an in-process Lighthouse and
replicas as threads: it reports step 10000 (torchft's Lighthouse heals everyone below the highest
step from that replica) and serves other weights or NaN. Honest replicas refuse the state, keep
their own and their step, name the replica, and stay finite and equal."""

from __future__ import annotations

import math

import pytest
import torch
from torchft._torchft import LighthouseServer

from farlink.comm.torchft_backend import TorchftCollective
from farlink.testing import in_threads
from farlink.robust.auth import SharedSecretAuth
from farlink.robust.gate import Gate
from farlink.robust.heal import state_fingerprint

# torchft runs in this process: after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

torch.set_num_threads(1)


class InflatedStep(TorchftCollective):
    """Reports step 10000 to the Lighthouse (a resumed count nobody can check)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.load_committed_step(10000)


def replicas(lighthouse: LighthouseServer, names: dict[str, type], values: dict[str, float],
             step: int, newcomers: frozenset[str] = frozenset(),
             secret: str | None = None, address: str | None = None) -> tuple[dict, dict]:
    """Replicas named ``names`` holding ``w = values[name]``; honest ones at ``step`` except the
    ``newcomers``, which have committed nothing; with ``secret``, members of a run with --auth
    reaching the Lighthouse at ``address`` (its gate)."""
    members, states = {}, {}
    for name, cls in names.items():
        admission = SharedSecretAuth(secret, name) if secret else None
        coll = cls(name, address or lighthouse.address(), min_replicas=len(names),
                   round_timeout=20, quorum_timeout=60, join_timeout=5, admission=admission)
        if cls is TorchftCollective and step and name not in newcomers:
            coll.load_committed_step(step)
        state = {"w": torch.full((16,), values[name])}
        coll.register_state(lambda s=state: {"w": s["w"].clone()},
                            lambda new, s=state: s.update(w=new["w"].clone()))
        members[name], states[name] = coll, state
    return members, states


def one_round_each(members: dict, needed: set[str] | None = None) -> dict:
    """One round on every member at once: (its round info, what it gathered, commit), of the
    ``needed`` members (default: all; the others are closed once those are done)."""
    def one_round(name: str, coll: TorchftCollective) -> tuple:
        info = coll.begin_round()
        gathered = coll.all_gather_bytes(name.encode())
        return info, gathered, coll.commit()

    return in_threads(one_round, members, timeout=120, needed=needed)


def test_honest_replicas_refuse_a_replica_reporting_step_10000() -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=4, join_timeout_ms=5000)
    members, states = replicas(
        lighthouse, {"h0": TorchftCollective, "h1": TorchftCollective, "h2": TorchftCollective,
                     "x": InflatedStep}, {"h0": 1.0, "h1": 1.0, "h2": 1.0, "x": -777.0}, step=5)
    try:
        results = one_round_each(members)
        for name in ("h0", "h1", "h2"):
            info, gathered, ok = results[name]
            assert info.world_size == 4 and info.round_id == 5 and not info.healed, results
            assert ok and members[name].manager.current_step() == 6
            assert torch.equal(states[name]["w"], torch.full((16,), 1.0)), name
            refusal = members[name].last_refusal
            assert refusal is not None and "x" in refusal and "10000" in refusal, refusal
    finally:
        for coll in members.values():
            coll.close()
        lighthouse.shutdown()


def test_a_newcomer_refuses_nan_weights_served_at_step_10000() -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000)
    members, states = replicas(lighthouse, {"n": TorchftCollective, "x": InflatedStep},
                               {"n": 0.5, "x": math.nan}, step=0)
    try:  # x's send to the refusing newcomer waits out its timeout: nothing to assert there
        results = one_round_each(members, needed={"n"})
        info, _, ok = results["n"]
        assert not ok and not info.healed
        assert torch.equal(states["n"]["w"], torch.full((16,), 0.5))
        assert members["n"].manager.current_step() == 0
        refusal = members["n"].last_refusal
        assert refusal is not None and "NaN" in refusal and "(x)" in refusal, refusal
    finally:
        for coll in members.values():
            coll.close()
        lighthouse.shutdown()


@pytest.mark.parametrize("auth", [False, True], ids=["open", "auth"])
def test_a_newcomer_heals_from_the_honest_majority_while_a_replica_reports_step_10000(
        auth: bool) -> None:
    """torchft heals everyone below the top step from the replica reporting it; the newcomer
    refuses that state and fetches the honest majority's instead (through the source's gate in a
    run with --auth), so the round commits for all."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=5, join_timeout_ms=5000)
    gate = None
    if auth:
        port = int(lighthouse.address().rsplit(":", 1)[1])
        gate = Gate(SharedSecretAuth("run-secret", "lighthouse"), ("127.0.0.1", port),
                    name="Lighthouse").start()
    honest = ("h0", "h1", "h2")
    members, states = replicas(
        lighthouse, {**dict.fromkeys(honest, TorchftCollective), "x": InflatedStep,
                     "n": TorchftCollective},
        {"h0": 1.0, "h1": 1.0, "h2": 1.0, "x": -777.0, "n": 0.5}, step=5,
        newcomers=frozenset({"n"}), secret="run-secret" if auth else None,
        address=gate.url if gate else None)
    try:
        results = one_round_each(members)
        majority = {state_fingerprint(states[name]) for name in honest}
        assert len(majority) == 1
        info, gathered, ok = results["n"]
        assert info.healed and info.round_id == 5 and info.world_size == 5, results
        assert ok and members["n"].manager.current_step() == 6
        assert state_fingerprint(states["n"]) in majority
        refusal = members["n"].last_refusal
        assert refusal is not None and "(x)" in refusal and "10000" in refusal, refusal
        for name in honest:
            info, gathered, ok = results[name]
            assert ok and not info.healed and members[name].manager.current_step() == 6, name
            assert sorted(gathered) == sorted(n.encode() for n in members), gathered
            assert "x" in (members[name].last_refusal or ""), name
        if auth:  # the newcomer fetched the honest state through an honest source's gate
            admitted = [who for name in honest for who in members[name]._transport._gate.admitted]
            assert "n" in admitted and set(admitted) == {"n"}, admitted
    finally:
        for coll in members.values():
            coll.close()
        if gate is not None:
            gate.close()
        lighthouse.shutdown()


class _RunsCode:
    """What a hostile replica can pickle into its healing state: unpickling it runs a call."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        return (open, (self.path, "w"))


def test_a_served_checkpoint_that_would_run_code_is_refused(tmp_path) -> None:  # noqa: ANN001
    """torchft unpickles a fetched checkpoint with weights_only=False: a replica serving an
    object whose unpickling calls a function ran that call on every peer healing from it."""
    from datetime import timedelta

    from farlink.comm.torchft_listeners import HostHTTPTransport

    marker = tmp_path / "ran"
    timeout = timedelta(seconds=10)
    source, receiver = HostHTTPTransport("127.0.0.1", timeout), HostHTTPTransport("127.0.0.1",
                                                                                    timeout)
    try:
        source.send_checkpoint([1], 3, {"user": {"w": torch.ones(2)}, "evil": _RunsCode(
            str(marker))}, timeout)
        with pytest.raises(Exception, match="(?i)not an allowed global|weights.only"):
            receiver.recv_checkpoint(0, source.metadata(), 3, timeout)
        assert not marker.exists()  # nothing the source pickled ran here
        source.send_checkpoint([1], 4, {"user": {"w": torch.ones(2)}, "torchft": {"step": 4}},
                               timeout)
        state = receiver.recv_checkpoint(0, source.metadata(), 4, timeout)
        assert torch.equal(state["user"]["w"], torch.ones(2)) and state["torchft"]["step"] == 4
    finally:
        source.shutdown(wait=False)
        receiver.shutdown(wait=False)
