"""``farlink swarm start | join`` as a person runs them: real processes, real output."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from swarm_output import read_multiaddress

# The swarm sub-app on its own typer app, as farlink.cli wires it via register(app, bench_app).
LAUNCH = (
    "import typer, sys; from farlink.swarm.command import register; "
    "app = typer.Typer(); register(app, typer.Typer()); app()"
)


def swarm(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "swarm", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_start_prints_full_multiaddress_and_stops_on_ctrl_c(tmp_path, cache_dir) -> None:
    proc = swarm("start", "--host", "127.0.0.1", "--port", "0", "--vocab-size", "512",
                 "--run-dir", str(tmp_path / "boot"), "--cache-dir", str(cache_dir))
    try:
        addr = read_multiaddress(proc, timeout=300)  # after the run's data is prepared
        assert "/p2p/12D3KooW" in addr
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert "shutting down" in out
    finally:
        proc.kill()


def swarm_in_process(*args: str, env: dict | None = None):
    """The same swarm sub-app run in this process (typer's CliRunner): its exit code and its
    stderr, for messages that need no process of their own."""
    import typer
    from typer.testing import CliRunner

    from farlink.swarm.command import register

    app = typer.Typer()
    register(app, typer.Typer())
    return CliRunner().invoke(app, ["swarm", *args], env=env)


def test_join_with_bad_address_and_several_ranks_say_how_to_fix_in_process(tmp_path) -> None:
    """The messages of the two process tests below (marked slow), from the same sub-app."""
    bad = swarm_in_process("join", "--initial-peers", "127.0.0.1:4000")
    assert bad.exit_code == 2
    assert "not a valid multiaddress" in bad.stderr and "farlink swarm start" in bad.stderr

    start = swarm_in_process("start", "--ranks-per-worker", "2", "--run-dir",
                             str(tmp_path / "boot"))
    assert start.exit_code == 2, start.stderr
    assert "one process each" in start.stderr and "Drop it" in start.stderr, start.stderr
    assert not (tmp_path / "boot").exists()
    join = swarm_in_process("join", "--initial-peers", "/ip4/127.0.0.1/tcp/4000",
                            env={"WORLD_SIZE": "2"})
    assert join.exit_code == 2 and "without torchrun" in join.stderr, join.stderr


def test_join_commands_for_a_start_on_every_interface_and_on_loopback() -> None:
    """What ``swarm start`` prints (the process test below, marked slow): on every interface the
    join command names an address other machines can dial and has the volunteer listen on
    every interface too; on loopback only, neither, and the start says only this machine can
    join (it says so exactly when ``is_loopback_only``)."""
    from farlink.comm.hivemind_net import best_address, is_loopback_only
    from farlink.swarm.command import join_command

    everywhere = ["/ip4/127.0.0.1/tcp/4000/p2p/QmBoot", "/ip4/192.168.1.4/tcp/4000/p2p/QmBoot"]
    args = join_command(best_address(everywhere), "d" * 64, "none").split()
    assert args[args.index("--initial-peers") + 1] == everywhere[1]
    assert args[args.index("--host") + 1] == "0.0.0.0" and "--public" not in args
    assert not is_loopback_only(everywhere)

    loopback = everywhere[:1]
    args = join_command(best_address(loopback), "d" * 64, "none").split()
    assert args[args.index("--initial-peers") + 1] == loopback[0]
    assert "--host" not in args and "--public" not in args and is_loopback_only(loopback)


@pytest.mark.slow  # a process for a parse error: test_join_with_bad_address_and_several_ranks_...
def test_join_with_bad_address_says_how_to_fix() -> None:
    proc = swarm("join", "--initial-peers", "127.0.0.1:4000")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "not a valid multiaddress" in err and "farlink swarm start" in err


@pytest.mark.slow  # two processes: test_join_with_bad_address_and_several_ranks_... in-process
def test_volunteers_of_several_ranks_are_refused_with_what_to_do(tmp_path) -> None:
    """A volunteer is one process: a run of several ranks per worker cannot be served, and
    ``swarm join`` under torchrun would make each rank a volunteer of its own."""
    import os

    start = swarm("start", "--ranks-per-worker", "2", "--run-dir", str(tmp_path / "boot"))
    _, err = start.communicate(timeout=60)
    assert start.returncode == 2 and "one process each" in err and "Drop it" in err, err
    assert not (tmp_path / "boot").exists()
    join = swarm("join", "--initial-peers", "/ip4/127.0.0.1/tcp/4000",
                 env={**os.environ, "WORLD_SIZE": "2"})
    _, err = join.communicate(timeout=60)
    assert join.returncode == 2 and "without torchrun" in err, err


@pytest.mark.slow  # two bootstrap processes: test_join_commands_for_a_start_on_every_interface_...
def test_start_on_every_interface_prints_a_command_for_other_machines(tmp_path, cache_dir) -> None:
    """``--host 0.0.0.0``: the printed join command names an address other machines can dial
    (not loopback, when the machine has another) and has the volunteer listen on every
    interface too; a loopback start says that only this machine can join."""
    import ipaddress

    def join_line(host: str, run: str) -> tuple[list[str], str]:
        proc = swarm("start", "--host", host, "--port", "0", "--vocab-size", "512",
                     "--run-dir", str(tmp_path / run), "--cache-dir", str(cache_dir))
        try:
            lines: list[str] = []
            for line in proc.stdout:  # up to the join command (its notes come before it)
                lines.append(line.strip())
                if lines[-1].startswith("farlink swarm join"):
                    break
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        command = next((l for l in lines if l.startswith("farlink swarm join")), None)
        assert command is not None, f"no join command; stdout: {lines}; stderr: {err}"
        return command.split(), "\n".join(lines) + "\n" + out

    args, output = join_line("0.0.0.0", "everywhere")
    addr = args[args.index("--initial-peers") + 1]
    printed = [l for l in output.splitlines() if l.startswith("/ip4/")]
    others = [a for a in printed if not ipaddress.ip_address(a.split("/")[2]).is_loopback]
    if others:  # a machine with a network interface besides loopback
        assert addr in others and args[args.index("--host") + 1] == "0.0.0.0"
        assert "only volunteers on this machine" not in output
    assert "--public" not in args

    args, output = join_line("127.0.0.1", "local")
    assert "--host" not in args and "only volunteers on this machine can join" in output


def test_join_with_client_mode_says_what_it_gives_up_and_what_to_open() -> None:
    """A volunteer in client mode is told on its console, and what port to open instead."""
    from farlink.comm.hivemind_backend import HivemindCollective
    from farlink.comm.hivemind_net import reachability, tcp_port

    server = HivemindCollective("reach", matchmaking_time=1.5, request_timeout=1.0)
    client = HivemindCollective("reach", server.maddrs, client_mode=True, matchmaking_time=1.5,
                                request_timeout=1.0)
    try:
        assert reachability(server.maddrs, False, server.maddrs) is None  # all on loopback
        note = reachability(client.maddrs, True, server.maddrs)
        assert note.startswith("client mode") and "drop --client-mode" in note
        port = tcp_port(client.maddrs)
        assert port and f"open TCP port {port}" in note
    finally:
        client.close()
        server.close()


def test_reachability_lines_for_addresses_seen_on_the_internet() -> None:
    from farlink.comm.hivemind_net import best_address, is_loopback_only, reachability

    boot = ["/ip4/127.0.0.1/tcp/4000/p2p/QmBoot", "/ip4/84.17.40.2/tcp/4000/p2p/QmBoot"]
    assert best_address(boot) == boot[1]  # a global address before loopback
    assert best_address(["/ip4/127.0.0.1/tcp/1/p2p/Q", "/ip4/192.168.1.4/tcp/1/p2p/Q"]) \
        == "/ip4/192.168.1.4/tcp/1/p2p/Q"
    assert is_loopback_only(boot[:1]) and not is_loopback_only(boot)
    behind_nat = ["/ip4/127.0.0.1/tcp/5123/p2p/QmMe", "/ip4/192.168.1.4/tcp/5123/p2p/QmMe"]
    relayed = behind_nat + ["/ip4/84.17.40.9/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmMe"]
    mapped = behind_nat + ["/ip4/84.17.40.20/tcp/5123/p2p/QmMe"]
    note = reachability(relayed, False, boot)
    assert note.startswith("reachable only through a relay") and "open TCP port 5123" in note
    note = reachability(behind_nat, False, boot)
    assert note.startswith("only a private address (127.0.0.1, 192.168.1.4)") and "--public" in note
    assert reachability(mapped, False, boot) is None  # port mapped: a global address
    assert reachability(behind_nat, False, behind_nat) is None  # a swarm on one LAN
    note = reachability(behind_nat[:1], False, boot)
    assert note.startswith("listening on loopback only") and "--host 0.0.0.0" in note


def test_a_nat_is_seen_when_the_bootstrap_peer_sees_none_of_the_volunteers_addresses() -> None:
    from farlink.comm.hivemind_net import nat_in_between

    own = ["/ip4/127.0.0.1/tcp/5123/p2p/QmMe", "/ip4/192.168.1.4/tcp/5123/p2p/QmMe"]
    assert nat_in_between("/ip4/84.17.40.20/tcp/61002", own) == "84.17.40.20"  # masqueraded
    assert nat_in_between("/ip4/192.168.1.4/tcp/5123", own) is None  # same LAN, seen as is
    assert nat_in_between("/ip4/127.0.0.1/tcp/40111", own[:1]) is None  # one machine
    assert nat_in_between(None, own) is None  # an older bootstrap peer does not say
    assert nat_in_between("/ip4/84.17.40.9/tcp/4001/p2p/QmR/p2p-circuit", own) is None


def test_the_bootstrap_peer_tells_a_volunteer_on_its_machine_where_it_came_from() -> None:
    """The definition fetch of test_hivemind_nat (netns, marked slow) on one machine, in this
    process: the bootstrap peer serves the blob and says which address the request came from,
    one of the fetching peer's own, so no NAT is seen (the NAT case of ``nat_in_between`` is
    the test above)."""
    from farlink.comm.hivemind_net import best_address, nat_in_between, start_bootstrap_peer
    from farlink.swarm.definition import DefinitionServer, fetch_definition

    dht, maddrs = start_bootstrap_peer("127.0.0.1", 0, False)
    server = DefinitionServer(dht, b'{"run": "nat"}')
    try:
        got = fetch_definition([best_address(maddrs)], None, "0.0.0.0", timeout=60)
    finally:
        server.close()
        dht.shutdown()
    assert got.blob == b'{"run": "nat"}'
    assert got.seen_from is not None and got.seen_from.startswith("/ip4/127.0.0.1/tcp/")
    assert nat_in_between(got.seen_from, got.own_maddrs) is None
