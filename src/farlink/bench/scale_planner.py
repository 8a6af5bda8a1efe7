"""``farlink bench scale-planner``: the planner's price of the compressed all-reduce against
in-process emulation on a shared bottleneck.

Each variant runs rounds of the compressed all-reduce (the exchange alone: the subject is the
collective, so no training) among ``n`` peers as threads, on an update of the nano preset's
size, with every peer's bytes queued on one emulated wire (a ``shared`` link profile: all
traffic crosses it) plus the profile's latency per hop. Measured per peer per round: the bytes
handed to the transport (every message's length) and the exchange's wall time (the slowest
peer's; the median over rounds after the first). The same rounds without the link give the
local work per round (encoding, decoding, signing, the rule), which the planner takes as a
measured input (``local_seconds``), as ``farlink bench wan`` does. The planner
(:func:`farlink.plan.model.predict_round`, backend ``inprocess``, ``shared_link``) prices the
rest from the codec's payload and the profile: round seconds and bytes sent per round, compared
by :mod:`farlink.plan.validate` (JSON + PNG).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import torch

from farlink.codecs import make_compressor
from farlink.comm.base import LinkModel
from farlink.comm.inprocess import InProcessGroup
from farlink.links import get_profile
from farlink.robust.aggregators import make_aggregator
from farlink.robust.auth import SharedSecretAuth
from farlink.sync.allreduce import partial_gathers
from farlink.sync.exchange import Exchange

#: the nano preset's parameter shapes (vocabulary 4096 x 64 embedding, two 64-wide blocks)
NANO = {"emb": (4096, 64), "blocks": (2, 12, 64, 64), "norm": (64,)}
RULES = {"mean": ("mean", False), "centered_clip+auth": ("centered_clip", True)}
SECRET = "bench-scale-secret"


def measure(peers: int, codec: str, rule: str, link: LinkModel | None, rounds: int) -> dict:
    """Bytes per peer per round and round seconds of ``rounds`` compressed all-reduces."""
    aggregator, auth = RULES[rule]
    gen = torch.Generator().manual_seed(peers)
    data = [{k: torch.randn(*s, generator=gen) for k, s in NANO.items()} for _ in range(peers)]
    times = [[0.0] * peers for _ in range(rounds)]
    sent = [[0] * peers for _ in range(rounds)]
    paths: set[str] = set()
    lock = threading.Lock()

    def member(rank: int, coll) -> None:  # noqa: ANN001 - an InProcessCollective
        ex = Exchange(coll, make_compressor(codec), f"w{rank}",
                      aggregator=make_aggregator(aggregator), path="allreduce",
                      authenticator=SharedSecretAuth(SECRET, peer_id=f"w{rank}") if auth
                      else None)
        for r in range(rounds):
            before, start = coll.stats.bytes_sent, time.perf_counter()
            result = ex.average(data[rank], 1.0, r)
            times[r][rank] = time.perf_counter() - start
            sent[r][rank] = coll.stats.bytes_sent - before
            if not coll.commit():
                raise RuntimeError(f"round {r} did not commit: {result.rejected}")
            with lock:
                paths.add(result.path)

    torch.set_num_threads(1)
    InProcessGroup(peers, link).run(member, timeout=600)
    steady = range(1, rounds) if rounds > 1 else range(rounds)
    return {"round_seconds": statistics.median(max(times[r]) for r in steady),
            "bytes_sent_per_round": statistics.mean(max(sent[r]) for r in steady),
            "path": "/".join(sorted(paths))}


def _median(runs: list[dict]) -> dict:
    """The median of each number over repeated measurements of one variant."""
    return {k: statistics.median(r[k] for r in runs) if k != "path" else runs[0][k]
            for k in runs[0]}


def run(out: Path, peers: list[int], codecs: list[str], rules: list[str], profile: str,
        rounds: int, name: str = "planner_validation-scale") -> dict:
    """Every (n, codec, rule) measured and predicted; ``NAME.json`` and ``NAME.png`` under
    ``out``."""
    import os

    from farlink.plan.model import predict_round
    from farlink.plan.validate import write_validation_report

    link_profile = get_profile(profile)
    link = LinkModel.of_profile(link_profile)
    numel = sum(torch.Size(s).numel() for s in NANO.values())
    measured, predicted, rows = [], [], []
    for n in peers:
        for codec in codecs:
            for rule in rules:
                label = f"{codec}/{rule}/{n}"
                # local work and link alternate, twice: the machine's load moves both alike
                local, shaped = [], []
                for _ in range(2):
                    local.append(measure(n, codec, rule, None, rounds))
                    shaped.append(measure(n, codec, rule, link, rounds))
                local, shaped = _median(local), _median(shaped)
                payload = make_compressor(codec).codec.max_payload_nbytes((numel,))
                guess = predict_round("diloco", n, 1e-9, link_profile.bandwidth_bps,
                                      link_profile.latency_s, payload_bytes=payload,
                                      codec=codec.split("+")[0], backend="inprocess",
                                      jitter_s=link_profile.jitter_s, loss=link_profile.loss,
                                      local_seconds=local["round_seconds"],
                                      shared_link=link_profile.shared,
                                      partial_gathers=partial_gathers(
                                          make_aggregator(RULES[rule][0])))
                measured.append({"name": label, **{k: shaped[k] for k in
                                                   ("round_seconds", "bytes_sent_per_round")}})
                predicted.append({"name": label, "round_seconds": guess.round_seconds,
                                  "bytes_sent_per_round": guess.bytes_sent_per_round})
                rows.append({"name": label, "peers": n, "codec": codec, "rule": rule,
                             "path": shaped["path"], "payload_bytes": payload,
                             "local_seconds": local["round_seconds"],
                             "measured": measured[-1], "predicted": predicted[-1]})
    paths = write_validation_report(measured, predicted, out,
                                    ("round_seconds", "bytes_sent_per_round"), stem=name)
    report = json.loads(paths["json"].read_text())
    report.update({
        "profile": link_profile.model_dump(), "rounds": rounds, "params": numel,
        "emulation": "in-process: peers as threads; every collective's bytes queued on one "
                     "shared wire at the profile's rate, plus its hops' one-way latency",
        "load": os.getloadavg(), "variants": rows})
    paths["json"].write_text(json.dumps(report, indent=2))
    return report
