"""A swarm's run definition: what a volunteer needs to train the run, served by its bootstrap peer.

A volunteer starts with nothing but the bootstrap peer's address, and no filesystem is shared, so
``farlink swarm start`` serves the run itself. The definition is one JSON document:

* ``config``: the run's saved config minus what belongs to one machine (its paths, addresses and
  key files, :data:`MACHINE_FIELDS`) and never the secret (``RunConfig`` never dumps it, and
  :data:`SECRET_FIELDS` are dropped again here);
* ``tokenizer``: the run's ``tokenizer.json``, so every peer encodes the corpus to the same ids;
* ``model``: the model description (``model.json``), checked against what the volunteer builds;
* ``data``: the corpus name and a fingerprint of the token arrays (:func:`data_fingerprint`),
  checked after the volunteer prepares the corpus on its own machine.

Its SHA-256 is the run's digest. ``swarm start`` prints it in the join command, the volunteer
checks every fetched copy against it (and against the copy in its run dir on a restart, so a run
dir only ever resumes the run it began), and the hivemind run id is derived from it, so peers with
different definitions never meet in a round.

Transport: a libp2p stream on the bootstrap peer's p2p daemon (hivemind's ``P2P``, framed as
farlink's other streams, :mod:`farlink.comm.hivemind_wire`). In a run with ``--auth`` the stream
answers only peers that passed the mutual membership handshake of
:class:`~farlink.comm.hivemind_admission.Admission` on the same daemon; anyone else gets a refusal
that names the run's ``--auth`` kind, so a volunteer learns what it is missing. The volunteer
fetches with a short-lived ``P2P`` of its own (no DHT: it does not know the run's settings yet),
with hivemind's NAT traversal and relays off unless ``--public``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from farlink.comm.errors import CommError, MembershipRefused, PeerUnreachable

log = logging.getLogger(__name__)

PROTOCOL = "farlink_swarm"  # the bootstrap peer's handler names: PROTOCOL.admit, .definition
DEFINITION_HANDLER = f"{PROTOCOL}.definition"
FORMAT = 1
REQUEST_BYTES = 4096  # a definition request is one small map

# RunConfig fields that name things on the machine that started the run: a volunteer has its own
MACHINE_FIELDS = frozenset({"run_dir", "cache_dir", "key_file", "allowed_keys", "initial_peers",
                            "lighthouse", "host", "tokenizer", "log_to"})
SECRET_FIELDS = frozenset({"secret", "secret_file"})


class DefinitionError(CommError):
    """A definition that cannot be used as fetched (digest, format, data); the message says why."""


def data_fingerprint(data: Any) -> str:
    """SHA-256 of the prepared token arrays (train, then held-out): equal means every peer reads
    the same tokens, whatever produced them."""
    digest = hashlib.sha256()
    for array in (data.train, data.heldout):
        digest.update(f"{array.dtype.str}:{len(array)}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def make_definition(cfg: Any, data: Any) -> bytes:
    """The definition of ``cfg`` trained on ``data`` (a PreparedData), as served bytes."""
    from farlink.model.build import model_description

    config = {k: v for k, v in cfg.model_dump(mode="json").items()
              if k not in MACHINE_FIELDS | SECRET_FIELDS and v is not None}
    body = {"format": FORMAT, "config": config, "tokenizer": data.tokenizer.to_str(),
            "model": model_description(cfg.model, data.vocab_size, cfg.seq_len),
            "data": {"corpus": cfg.corpus, "fingerprint": data_fingerprint(data),
                     "train_tokens": int(len(data.train))}}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def digest_of(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def parse_definition(blob: bytes, expected: str | None) -> dict:
    """The definition in ``blob``, refused unless it hashes to ``expected`` (when given)."""
    actual = digest_of(blob)
    if expected is not None and actual != expected:
        raise DefinitionError(
            f"the run definition served has digest {actual[:16]}..., not the expected "
            f"{expected[:16]}...: this is another run (or its definition changed). Fix: copy the "
            "join command `farlink swarm start` prints now, or use another --run-dir")
    body = json.loads(blob)
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise DefinitionError(f"run definition of format {body.get('format')!r}; this farlink "
                              f"reads format {FORMAT}: install the run's farlink version")
    return body


def run_id_of(digest: str) -> str:
    """The hivemind run id of a swarm: peers of different definitions never share a round."""
    return f"swarm-{digest[:16]}"


class DefinitionServer:
    """Serves ``blob`` on the p2p daemon of ``dht`` (the bootstrap peer) until :meth:`close`.

    ``auth``: the run's authenticator; then only peers that proved membership get the blob.
    """

    def __init__(self, dht: Any, blob: bytes, auth: Any = None, auth_kind: str = "none") -> None:
        self.blob, self.digest = blob, digest_of(blob)
        self.auth, self.auth_kind = auth, auth_kind
        self.admission = None
        self.served = 0
        self.refused = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="swarm-definition")
        self._thread.start()
        self._call(self._setup(dht))

    def _call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _setup(self, dht: Any) -> None:
        from farlink.comm.hivemind_admission import Admission

        self._p2p = await dht.replicate_p2p()
        if self.auth is not None:
            self.admission = Admission(self.auth, self._p2p, PROTOCOL)
            await self.admission.add_handler()
        await self._p2p.add_binary_stream_handler(DEFINITION_HANDLER, self._handle)

    async def _handle(self, info: Any, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        from farlink.comm.hivemind_wire import FrameRefused, recv_message, send_message

        try:
            # a request is a few KB at most, read before membership is known: a longer one
            # is refused unread, so nobody's request can grow this peer's memory
            await asyncio.wait_for(recv_message(reader, max_body=0, max_bodies=0,
                                                max_header=REQUEST_BYTES), 30.0)
            if self.admission is not None and not self.admission.admitted(
                    info.peer_id, "definition request"):
                self.refused += 1
                await send_message(writer, {"error": "members only", "auth": self.auth_kind}, [])
                return
            # where the request came from, as this peer sees it: a volunteer compares it with
            # its own addresses to learn whether a NAT stands between (hivemind_net.nat_in_between)
            await send_message(writer, {"sha256": self.digest, "seen_from": str(info.addr)},
                               [self.blob])
            self.served += 1
        except FrameRefused as exc:
            self.refused += 1
            log.warning("refused a definition request from %s: %s; its stream is closed",
                        info.peer_id, exc)
        except Exception as exc:  # noqa: BLE001 - one broken stream from one peer
            log.info("definition request from %s failed: %r", info.peer_id, exc)
        finally:
            writer.close()

    def close(self) -> None:
        try:
            self._call(self._p2p.shutdown(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.debug("definition server shutdown: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def _refusal(kind: str) -> str:
    how = {"secret": "--auth secret with the run secret in FARLINK_SECRET (or --secret-file F, "
                     "chmod 600)",
           "ed25519": "--auth ed25519 --key-file K, whose public key is in the run's "
                      "--allowed-keys, and --allowed-keys with the members' keys"}
    return (f"the run's bootstrap peer serves its definition to members only (the run uses "
            f"--auth {kind}) and this peer did not prove membership. Fix: join with "
            f"{how.get(kind, f'--auth {kind} and its credentials')}")


class FetchedDefinition(NamedTuple):
    blob: bytes
    seen_from: str | None  # the address the serving peer saw this request come from
    own_maddrs: list[str]  # the addresses this machine listened on while fetching


def fetch_definition(initial_peers: Sequence[str], auth: Any = None, host: str = "127.0.0.1",
                     public: bool = False, timeout: float = 60.0) -> FetchedDefinition:
    """The definition blob from the first of ``initial_peers`` that serves it (checked against
    the digest it announces; the caller checks it against the one it expects), with the address
    that peer saw the request come from and this machine's own addresses, so the caller can
    tell whether a NAT stands between.

    Raises :class:`MembershipRefused` when membership cannot be proven (no ``auth`` in a run
    with ``--auth``, or a wrong secret/key), :class:`PeerUnreachable` when no peer answers.
    """
    from farlink.comm.hivemind_net import check_p2pd, validate_initial_peers

    check_p2pd()
    peers = validate_initial_peers(initial_peers)
    return asyncio.run(asyncio.wait_for(_fetch(peers, auth, host, public), timeout))


async def _fetch(peers: list[str], auth: Any, host: str, public: bool) -> FetchedDefinition:
    from hivemind.p2p import P2P, P2PDaemonError, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from farlink.comm.hivemind_admission import Admission
    from farlink.comm.hivemind_net import LOCAL_ONLY, PUBLIC, tcp_maddr, translate_daemon_error
    from farlink.comm.hivemind_wire import recv_message, send_message
    from farlink.robust.auth import AuthError

    try:
        p2p = await P2P.create(initial_peers=peers, host_maddrs=[tcp_maddr(host, 0)],
                               **(PUBLIC if public else LOCAL_ONLY))
    except P2PDaemonError as exc:
        raise translate_daemon_error(str(exc), peers, [tcp_maddr(host, 0)]) from exc
    problems = []
    try:
        admission = Admission(auth, p2p, PROTOCOL) if auth is not None else None
        for addr in peers:
            peer = PeerID.from_base58(Multiaddr(addr).value_for_protocol("p2p"))
            if admission is not None:
                try:
                    await admission.ensure(peer)
                except AuthError as exc:
                    raise MembershipRefused(
                        f"the run's bootstrap peer {addr} did not admit this peer: {exc}") from None
                except Exception as exc:  # noqa: BLE001 - no handshake there: try the next peer
                    problems.append(f"{addr}: no membership handshake ({exc!r}; if the run "
                                    "has no --auth, join without --auth)")
                    continue
            try:
                _, reader, writer = await p2p.call_binary_stream_handler(peer, DEFINITION_HANDLER)
                try:
                    await send_message(writer, {"want": "definition"}, [])
                    header, bodies = await recv_message(reader)
                finally:
                    writer.close()
            except Exception as exc:  # noqa: BLE001 - try the next peer
                problems.append(f"{addr}: {exc!r}")
                continue
            if header.get("error"):
                raise MembershipRefused(_refusal(str(header.get("auth", "secret"))))
            if len(bodies) != 1 or digest_of(bodies[0]) != header.get("sha256"):
                problems.append(f"{addr}: the definition does not match the digest it announced")
                continue
            seen = header.get("seen_from")
            return FetchedDefinition(bodies[0], seen if isinstance(seen, str) else None,
                                     [str(m) for m in await p2p.get_visible_maddrs()])
    finally:
        await p2p.shutdown()
    raise PeerUnreachable(
        "no initial peer served the run's definition (" + "; ".join(problems) + "). Fix: pass "
        "the address `farlink swarm start` printed, and check that it still runs")


def write_definition_files(run_dir: Path, blob: bytes, body: dict) -> None:
    """The volunteer's own copies: the definition (what a restart compares against), the
    tokenizer and the model description (what ``farlink export``/``generate`` read)."""
    from farlink.state.files import atomic_write
    from farlink.model.build import MODEL_FILE

    atomic_write(run_dir / "definition.json", blob)
    atomic_write(run_dir / "tokenizer.json", body["tokenizer"].encode("utf-8"))
    atomic_write(run_dir / MODEL_FILE, json.dumps(body["model"], indent=1).encode())
