"""``farlink swarm start | join``: a community run's bootstrap peer, and a volunteer that trains.

``start`` takes a run's config (``--config run.toml`` and/or flags, as ``farlink train``),
prepares its data, saves it in its own run dir and starts a hivemind DHT peer that serves the
run's definition (:mod:`farlink.swarm.definition`) to admitted peers. It prints the exact
command a volunteer runs and serves until Ctrl-C; it trains nothing itself.

``join`` is that command. With only the bootstrap's address it fetches the definition (checked
against ``--digest``, and on a restart against the copy in its run dir), prepares the corpus on
its own machine and checks the data's fingerprint, claims a shard in the DHT
(:mod:`farlink.comm.swarm_shards`), then runs the same worker as ``farlink train``
(:func:`farlink.train.worker.run_worker`): its first round heals it from up-to-date peers
(hivemind's chunked, hash-checked state download), and it trains the run's model with the run's
algorithm until the run's ``steps`` are done or Ctrl-C. It writes only its own run dir
(default ``runs/swarm-<digest>``); the same command later resumes from its checkpoints.

Everything listens on loopback unless ``--host``/``--public`` say otherwise; ``--public`` is the
only switch that enables NAT traversal and relays. ``start`` prints the join command for the
address other machines can dial best and carries ``--host 0.0.0.0`` / ``--public`` into it when
the run needs them; ``join`` says on the console when others cannot dial it directly (client
mode, relay only, NAT, loopback) and which TCP port to open
(:func:`farlink.comm.hivemind_net.reachability`). When the bootstrap peer saw the definition
request come from an address that is none of the volunteer's own, a NAT stands between and
nobody could dial what it announces: without ``--public`` it then joins in client mode by itself
and says so (:func:`farlink.comm.hivemind_net.nat_in_between`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from farlink import interrupt

CODE_REFUSED = 3  # membership not proven: the same code as a refused worker


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.secho(f"error: {message}", fg="red", err=True)
    return typer.Exit(code)


def join_command(maddr: str, digest: str, auth: str, public: bool = False) -> str:
    """The command a volunteer runs (the secret, if any, travels out of band). For a bootstrap
    peer other machines can reach, the volunteer listens on every interface too (its default,
    loopback, would let it dial out but never be dialed), and a ``--public`` run's volunteers
    may use port mapping and relays as the bootstrap peer does."""
    from farlink.comm.hivemind_net import is_loopback_only

    command = f"farlink swarm join --initial-peers {maddr} --digest {digest}"
    if not is_loopback_only([maddr]):
        command += " --host 0.0.0.0"
    if public:
        command += " --public"
    if auth == "secret":
        command += " --auth secret"
    elif auth == "ed25519":
        command += " --auth ed25519 --key-file YOUR_KEY --allowed-keys MEMBERS_KEYS"
    return command


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    from farlink.flags import config_from, config_options

    swarm = typer.Typer(help="Community mode: a hivemind swarm of volunteer peers.")
    app.add_typer(swarm, name="swarm")

    @swarm.command("start", context_settings={"help_option_names": ["-h", "--help"]})
    @config_options
    def start(
        port: int = typer.Option(0, "--port", help="TCP port (0 = any free port)."),
        public: bool = typer.Option(False, "--public", help="Allow NAT port mapping, AutoNAT "
                                    "and relays (internet runs)."),
        **values: Any,
    ) -> None:
        """Start the run's bootstrap peer: it serves the run's definition to volunteers and
        prints the command they join with; runs until Ctrl-C."""
        from farlink.comm.errors import CommError
        from farlink.swarm.definition import DefinitionServer, make_definition
        from farlink.config import ConfigError
        from farlink.data import CorpusError, prepare_data
        from farlink.robust.auth import run_authenticator
        from farlink.train.launcher import check_data, check_launch, write_model_files
        from farlink.train.rundir import open_run_dir, plan_run_dir

        interrupt.install()
        values["backend"] = values.get("backend") or "hivemind"
        # volunteers are not all trusted: a robust rule and loss scoring unless the run says so
        values["members"] = values.get("members") or "open"
        cfg = config_from(values)
        try:
            from farlink import matrix

            matrix.check(cfg, ["swarm"])  # hivemind, a preset, one process per volunteer
            cfg, link = plan_run_dir(cfg)
            check_launch(cfg)
            data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir,
                                tokenizer=cfg.given_tokenizer)
            check_data(cfg, data)
        except (ConfigError, CorpusError, ValueError) as exc:
            raise _fail(str(exc)) from None
        open_run_dir(cfg, link)
        write_model_files(cfg, data)
        blob = make_definition(cfg, data)
        server = dht = None
        try:
            member = run_authenticator(cfg, "bootstrap")
            authorizer = None
            if member is not None:
                from farlink.comm.hivemind_admission import RunAuthorizer

                authorizer = RunAuthorizer(member)
            from farlink.comm.hivemind_net import (best_address, is_loopback_only,
                                                   start_bootstrap_peer)

            dht, maddrs = start_bootstrap_peer(cfg.host, port, public, authorizer=authorizer)
            server = DefinitionServer(dht, blob, auth=member, auth_kind=cfg.auth)
        except (CommError, ValueError) as exc:
            if dht is not None:
                dht.shutdown()
            raise _fail(str(exc)) from None
        try:  # Ctrl-C may arrive while the addresses are still being printed
            typer.echo(f"run {server.digest[:16]}: {cfg.algorithm} on model {cfg.model}, corpus "
                       f"{cfg.corpus}, {cfg.workers} shards, rounds of at least "
                       f"{cfg.min_replicas} peers; run dir {cfg.run_dir}")
            typer.echo("bootstrap peer running; its addresses:")
            for addr in maddrs:
                typer.echo(addr)
            if is_loopback_only(maddrs):
                typer.echo("(this peer listens on loopback: only volunteers on this machine "
                           "can join. For volunteers elsewhere start it with --host 0.0.0.0 "
                           "--port P and open TCP port P; see docs/community.md)")
            typer.echo("a volunteer joins with:")
            typer.echo("  " + join_command(best_address(maddrs), server.digest, cfg.auth,
                                           public))
            if cfg.auth == "secret":
                typer.echo("  (with the run secret in FARLINK_SECRET, or --secret-file F)")
            while dht.is_alive():
                interrupt.check()
                time.sleep(1.0)
        except KeyboardInterrupt:
            typer.echo("shutting down")
        finally:
            server.close()
            dht.shutdown()

    @swarm.command("join", context_settings={"help_option_names": ["-h", "--help"]})
    def join(
        initial_peers: Annotated[
            list[str], typer.Option("--initial-peers", help="Multiaddress of a live peer (the "
                                    "one `farlink swarm start` printed).")
        ],
        digest: Annotated[
            str | None, typer.Option(help="The run's digest, as `farlink swarm start` prints "
                                     "it; a definition that does not match is refused.")
        ] = None,
        run_dir: Annotated[
            Path | None, typer.Option(help="This volunteer's own directory (default: "
                                      "runs/swarm-<digest>); the same dir resumes.")
        ] = None,
        cache_dir: Annotated[
            Path, typer.Option(help="Tokenized-data cache.")
        ] = Path.home() / ".cache" / "farlink",
        host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every "
                                          "interface, for a swarm beyond this machine).")
                        ] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="TCP port to listen on (0: any free port); the "
                                          "one to open or forward for peers elsewhere.")] = 0,
        client_mode: Annotated[
            bool, typer.Option(help="This peer cannot accept connections (behind NAT); "
                               "chosen without it when the bootstrap peer sees a NAT between.")
        ] = False,
        public: Annotated[bool, typer.Option(help="Allow NAT traversal and relays.")] = False,
        auth: Annotated[str, typer.Option(help="none, secret or ed25519: what the run uses.")
                        ] = "none",
        secret: Annotated[
            str | None, typer.Option(help="--auth secret: the run secret (FARLINK_SECRET or "
                                     "--secret-file keep it out of `ps`).")
        ] = None,
        secret_file: Annotated[
            Path | None, typer.Option(help="--auth secret: a file holding the run secret "
                                      "(chmod 600).")
        ] = None,
        key_file: Annotated[
            Path | None, typer.Option(help="--auth ed25519: this member's private key.")
        ] = None,
        allowed_keys: Annotated[
            Path | None, typer.Option(help="--auth ed25519: the members' public keys.")
        ] = None,
        log_to: Annotated[
            str, typer.Option(help="Also send this volunteer's metrics to tensorboard, wandb "
                              "or both (comma-separated; farlink[metrics]).")
        ] = "",
    ) -> None:
        """Join a swarm as a volunteer and train the run on a shard of its own until the run
        ends or Ctrl-C."""
        from farlink.loggers import require_sinks

        require_sinks(log_to)  # --log-to's packages (farlink[metrics]), before fetching the run
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise _fail("a volunteer is one process: start `farlink swarm join` without "
                        "torchrun (this process is one of WORLD_SIZE="
                        f"{os.environ['WORLD_SIZE']}); one volunteer per machine or GPU")
        from farlink.comm.errors import CommError, MembershipRefused
        from farlink.swarm.definition import (
            DefinitionError, data_fingerprint, digest_of, fetch_definition, parse_definition,
            run_id_of, write_definition_files)
        from farlink.comm.hivemind_net import (identity_key, nat_in_between, reachability,
                                               tcp_maddr)
        from farlink.comm.swarm_shards import ShardClaim, SwarmFull
        from farlink.config import ConfigError, load_config
        from farlink.data import CorpusError, prepare_data
        from farlink.model.build import model_description
        from farlink.compose import build_collective
        from farlink.robust.auth import make_authenticator, resolve_secret
        from farlink.train.rundir import holds_run, write_run_config
        from farlink.train.worker import run_worker

        try:
            member = None
            if auth.strip().lower() != "none":
                member = make_authenticator(auth, resolve_secret(secret, secret_file), key_file,
                                            allowed_keys, "volunteer")
            fetched = fetch_definition(initial_peers, member, host, public)
            blob = fetched.blob
            body = parse_definition(blob, digest)
        except MembershipRefused as exc:
            raise _fail(str(exc), CODE_REFUSED) from None
        except (CommError, ValueError) as exc:
            raise _fail(str(exc)) from None
        except TimeoutError:
            raise _fail(f"no answer from {initial_peers} within 60 s. Fix: check that `farlink "
                        "swarm start` runs there and the address is the one it printed") from None
        run_digest = digest_of(blob)
        run_dir = run_dir or Path("runs") / f"swarm-{run_digest[:16]}"
        saved = run_dir / "definition.json"
        if saved.is_file() and digest_of(saved.read_bytes()) != run_digest:
            raise _fail(f"{run_dir} holds a volunteer of another run (digest "
                        f"{digest_of(saved.read_bytes())[:16]}, this run {run_digest[:16]}); "
                        "nothing was changed. Join this run with another --run-dir")
        if not saved.is_file() and holds_run(run_dir):
            raise _fail(f"{run_dir} holds a run that is not this swarm's; nothing was changed. "
                        "Join with another --run-dir")
        write_definition_files(run_dir, blob, body)
        try:
            cfg = load_config(None, {
                **body["config"], "run_dir": run_dir, "cache_dir": cache_dir,
                "tokenizer": str(run_dir / "tokenizer.json"),
                "initial_peers": ",".join(initial_peers), "host": host, "secret": secret,
                "secret_file": secret_file, "key_file": key_file, "allowed_keys": allowed_keys,
                "log_to": log_to})
            data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir,
                                tokenizer=cfg.given_tokenizer)
            if data_fingerprint(data) != body["data"]["fingerprint"]:
                raise DefinitionError(
                    f"the corpus {cfg.corpus!r} on this machine gives other tokens than the "
                    "run's (data fingerprints differ): every volunteer must read the same text. "
                    "Fix: install the corpus the run names (or the run's farlink version)")
            if model_description(cfg.model, data.vocab_size, cfg.seq_len) != body["model"]:
                raise DefinitionError("the model this farlink builds from the run's config "
                                      "differs from the run's; install the run's farlink version")
        except (ConfigError, CorpusError, DefinitionError) as exc:
            raise _fail(str(exc)) from None
        write_run_config(cfg)  # never the secret: RunConfig does not dump it
        nat_address = nat_in_between(fetched.seen_from, fetched.own_maddrs)
        forced_client_mode = bool(nat_address) and not client_mode and not public
        if forced_client_mode:
            client_mode = True  # what it announces cannot be dialed: averaging would stall
            typer.secho(
                f"note: behind NAT: the bootstrap peer sees this volunteer at {nat_address}, "
                "which is none of its own addresses, so no peer can dial it; it joins in client "
                "mode (it dials out only). To take a full part, join from a machine with a "
                "public address and an open TCP port, or with --public (port mapping, relays)",
                fg="yellow")
        try:
            collective = build_collective(
                cfg, "volunteer", cfg.initial_peers, run_id=run_id_of(run_digest),
                identity_path=str(run_dir / "identity.key"), client_mode=client_mode,
                public=public, host_maddrs=[tcp_maddr(host, port)])
        except MembershipRefused as exc:
            raise _fail(str(exc), CODE_REFUSED) from None
        except CommError as exc:
            raise _fail(str(exc)) from None
        note = None if forced_client_mode else reachability(collective.maddrs, client_mode,
                                                             initial_peers)
        if note:
            typer.secho(f"note: {note}", fg="yellow")
        state_path = run_dir / "swarm.json"
        previous = json.loads(state_path.read_text()).get("shard") if state_path.is_file() \
            else None
        claim = ShardClaim(collective.dht, f"{collective.prefix}_shards", cfg.workers,
                           identity_key(str(run_dir / "identity.key")),
                           progress=lambda: collective.round_id)
        try:
            shard = claim.acquire(previous)
        except SwarmFull as exc:
            collective.close()
            raise _fail(str(exc)) from None
        # a round is full with every live volunteer, not with --workers (the run's room)
        collective.swarm_size = lambda: claim.live
        state_path.write_text(json.dumps({"digest": run_digest, "shard": shard,
                                          "peer_id": str(collective.peer_id),
                                          "join_round": claim.join_round}, indent=1))
        resume = (run_dir / "checkpoints" / f"w{shard}").is_dir()
        cfg = cfg.model_copy(update={"resume": resume})
        typer.echo(f"volunteer {collective.peer_id} of run {run_digest[:16]}: shard {shard} of "
                   f"{cfg.workers} (join round {claim.join_round}), "
                   f"{'resuming its checkpoints' if resume else 'new'}; run dir {run_dir}; "
                   "Ctrl-C leaves (committed rounds are kept)")
        try:
            # a founder of a swarm still at round 0 holds the run's initial state like the
            # other founders, and counts as such (farlink.robust.heal.group_round); a volunteer
            # joining a swarm that has made progress first heals, holding nothing to keep
            code = run_worker(cfg, shard, cfg.initial_peers,
                              joining=resume or claim.join_round > 0, collective=collective,
                              shard_claim=claim)
        finally:
            claim.release()
        raise typer.Exit(code)
