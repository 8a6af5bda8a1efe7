"""``farlink swarm start | join``: run a community swarm's bootstrap peer, or join one.

``start`` prints the full multiaddresses others pass as ``--initial-peers`` and serves the DHT
until Ctrl-C. ``join`` connects a worker and, until training is wired to it, runs a small demo of
the collective (sum of small tensors and an all-gather) printing the group of each round.
Everything listens on loopback unless ``--host``/``--public`` say otherwise; ``--public`` is the
only switch that enables NAT traversal and relays.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from farlink import interrupt
from farlink.comm.hivemind_net import start_bootstrap_peer, tcp_maddr


def make_hivemind_collective(
    run_id: str,
    initial_peers: list[str],
    host: str = "127.0.0.1",
    client_mode: bool = False,
    public: bool = False,
    port: int = 0,
    **timeouts: Any,
):
    """The collective a training entry uses; ``timeouts`` go to HivemindCollective as is."""
    from farlink.comm.hivemind_backend import HivemindCollective

    return HivemindCollective(
        run_id,
        initial_peers,
        host_maddrs=[tcp_maddr(host, port)],
        client_mode=client_mode,
        public=public,
        **timeouts,
    )


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    swarm = typer.Typer(help="Community mode: a hivemind DHT swarm of volunteer peers.")
    app.add_typer(swarm, name="swarm")

    @swarm.command("start")
    def start(
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="TCP port (0 = any free port).")] = 0,
        public: Annotated[
            bool, typer.Option(help="Allow NAT port mapping, AutoNAT and relays (internet runs).")
        ] = False,
        auth: Annotated[
            str, typer.Option(help="The run's --auth (none, secret, ed25519): members accept "
                              "only a bootstrap peer that signs its DHT answers.")
        ] = "none",
        secret: Annotated[
            str | None, typer.Option(help="--auth secret: the run secret (FARLINK_SECRET or "
                                     "--secret-file keep it out of `ps`).")
        ] = None,
        secret_file: Annotated[
            Path | None, typer.Option(help="--auth secret: a file holding the run secret, "
                                      "readable by its owner only (chmod 600).")
        ] = None,
        key_file: Annotated[
            Path | None, typer.Option(help="--auth ed25519: a member's private key.")
        ] = None,
        allowed_keys: Annotated[
            Path | None, typer.Option(help="--auth ed25519: the members' public keys.")
        ] = None,
    ) -> None:
        """Start a bootstrap peer and print its multiaddresses; runs until Ctrl-C."""
        from farlink.comm.errors import CommError

        interrupt.install()

        try:
            authorizer = None
            if auth.strip().lower() != "none":
                from farlink.comm.hivemind_admission import RunAuthorizer
                from farlink.robust.auth import make_authenticator, resolve_secret

                authorizer = RunAuthorizer(make_authenticator(
                    auth, resolve_secret(secret, secret_file), key_file, allowed_keys,
                    "bootstrap"))
            dht, maddrs = start_bootstrap_peer(host, port, public, authorizer=authorizer)
        except (CommError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        try:  # Ctrl-C may arrive while the addresses are still being printed
            typer.echo("bootstrap peer running; join with --initial-peers and one of:")
            for addr in maddrs:
                typer.echo(addr)
            while dht.is_alive():
                interrupt.check()
                time.sleep(1.0)
        except KeyboardInterrupt:
            typer.echo("shutting down")
        finally:
            dht.shutdown()

    @swarm.command("join")
    def join(
        initial_peers: Annotated[
            list[str], typer.Option("--initial-peers", help="Multiaddress of a live peer.")
        ],
        run_id: Annotated[str, typer.Option(help="Run id shared by all peers.")] = "demo",
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        client_mode: Annotated[
            bool, typer.Option(help="This peer cannot accept connections (behind NAT).")
        ] = False,
        public: Annotated[bool, typer.Option(help="Allow NAT traversal and relays.")] = False,
        rounds: Annotated[int, typer.Option(help="Demo rounds to run (0 = until Ctrl-C).")] = 5,
        min_group_size: Annotated[
            int, typer.Option(help="Smallest group a round may run with.")
        ] = 2,
        pause: Annotated[float, typer.Option(help="Seconds between rounds.")] = 1.0,
    ) -> None:
        """Join a swarm and run a demo of the collective on small tensors."""
        import torch

        from farlink.comm.errors import CommError

        interrupt.install()

        try:
            coll = make_hivemind_collective(
                run_id, initial_peers, host, client_mode, public, min_group_size=min_group_size
            )
        except CommError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        typer.echo(f"joined as {coll.peer_id}")
        done = 0
        try:
            while rounds == 0 or done < rounds:
                interrupt.check()
                try:
                    info = coll.begin_round()
                except CommError as exc:
                    typer.echo(f"round failed: {exc}", err=True)
                    continue
                ones = [torch.ones(16)]
                coll.all_reduce_sum(ones)
                names = coll.all_gather_bytes(str(coll.peer_id).encode())
                ok = coll.commit()
                typer.echo(
                    f"round {info.round_id}: group of {info.world_size} (rank {info.rank}), "
                    f"sum of ones = {ones[0][0].item():.0f}, gathered {len(names)} payloads, "
                    f"{'committed' if ok else 'NOT committed'}, "
                    f"{coll.stats.bytes_sent} bytes sent so far"
                )
                done += 1
                time.sleep(pause)
        except KeyboardInterrupt:
            typer.echo("leaving")
        finally:
            coll.close()
