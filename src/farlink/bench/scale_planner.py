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
from farlink.links import LinkProfile, get_profile
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


def measure_netns(peers: int, rounds: tuple[int, int], profile: str, mbit: float,
                  out: Path, inner_steps: int = 5) -> dict:
    """The compressed all-reduce on torchft with every worker a process in its own network
    namespace (``farlink.emulate.Topology``: each worker's link shaped and delayed, the
    Lighthouse in the router namespace), DiLoCo with int8+ef on the nano preset. Two runs of
    ``rounds[0]`` and ``rounds[1]`` rounds: bytes per worker per round from the kernel's
    interface counters (transmitted bytes of each worker's veth) as the difference of the two
    runs over the difference of their rounds, which removes setup, healing and evaluation
    traffic; the exchange's seconds per round from the workers' logs (``network_s``, rounds
    after the first). The namespaces are deleted after each run."""
    from farlink.bench.runner import run_variant
    from farlink.bench.scale_netns import kernel_tx_bytes
    from farlink.emulate import Topology
    from farlink.links import scaled
    from farlink.train.metrics import read_metrics

    link = scaled(profile, mbit)
    runs = []
    for count in rounds:
        with Topology(peers, link) as net:
            before = kernel_tx_bytes(net)
            base = {"workers": peers, "steps": count * inner_steps, "inner_steps": inner_steps,
                    "eval_batches": 2, "model": "nano", "batch_size": 2, "seq_len": 64,
                    "warmup_steps": 2, "threads": 1}
            label = f"netns-{peers}-R{count}"
            run_variant(label, base, out, network=net, algorithm="diloco", codec="int8+ef")
            kernel = [a - b for a, b in zip(kernel_tx_bytes(net), before)]
        network = []
        for w in range(peers):
            syncs = [r for r in read_metrics(out / "runs" / label / "metrics" / f"w{w}.jsonl")
                     if r["kind"] == "sync"]
            network += [b["network_s"] - a["network_s"] for a, b in zip(syncs, syncs[1:])]
        runs.append({"rounds": count, "kernel_tx_bytes": kernel, "network_s": network,
                     "params": next(r for r in read_metrics(
                         out / "runs" / label / "metrics" / "w0.jsonl")
                         if r["kind"] == "start")["params"]})
    return {"peers": peers, "profile": link.model_dump(), "runs": runs}


def netns_report(measurements: list[dict], out: Path,
                 name: str = "planner_validation-scale-netns") -> dict:
    """The planner's price of the compressed all-reduce on torchft against namespace runs
    (:func:`measure_netns`): the exchange's seconds per round and the bytes per worker per round
    (kernel counters: frames with their TCP/IP headers, ACKs for what the worker receives, and
    the quorum's traffic, none of which the planner's payload bytes hold). The ring all-reduce's
    price, which the planner gave torchft's compressed all-reduce before, is kept beside it."""
    from farlink.codecs import make_compressor
    from farlink.plan.network import allreduce, compressed_allreduce
    from farlink.plan.validate import write_validation_report

    measured, predicted, rows = [], [], []
    for m in measurements:
        n, short, long = m["peers"], m["runs"][0], m["runs"][-1]
        per_round = [(b - a) / (long["rounds"] - short["rounds"])
                     for a, b in zip(short["kernel_tx_bytes"], long["kernel_tx_bytes"])]
        seconds = statistics.median(short["network_s"] + long["network_s"])
        link = LinkProfile(**m["profile"])
        payload = make_compressor("int8+ef").codec.max_payload_nbytes((long["params"],))
        price = compressed_allreduce("torchft", payload, n, link.bandwidth_bps, link.latency_s)
        ring = allreduce("torchft", payload, n, link.bandwidth_bps, link.latency_s)
        label = f"torchft/int8+ef/mean/{n}"
        measured.append({"name": label, "exchange_seconds": seconds,
                         "bytes_sent_per_round": statistics.median(per_round)})
        predicted.append({"name": label, "exchange_seconds": price.seconds,
                          "bytes_sent_per_round": price.bytes_sent})
        rows.append({"name": label, "peers": n, "payload_bytes": payload,
                     "kernel_bytes_per_round": per_round, "exchange_seconds_per_round":
                     short["network_s"] + long["network_s"],
                     "ring_price": {"exchange_seconds": ring.seconds,
                                    "bytes_sent_per_round": ring.bytes_sent}})
    paths = write_validation_report(measured, predicted, out,
                                    ("exchange_seconds", "bytes_sent_per_round"), stem=name)
    report = json.loads(paths["json"].read_text())
    report.update({"profile": measurements[0]["profile"], "variants": rows, "emulation":
                   "network namespaces: each worker a process behind a veth with tc tbf and "
                   "a delayer, torchft over Gloo, the Lighthouse in the router namespace"})
    paths["json"].write_text(json.dumps(report, indent=2))
    return report
