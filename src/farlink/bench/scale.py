"""``farlink bench scale``: what one peer sends per round from 4 to 32 peers.

Every variant trains the nano preset with its peers as threads of one process (bytes do not
depend on load, so 32 peers fit two cores; link emulation is in-process: each collective sleeps
``latency + bytes / bandwidth``). For each codec (fp32, int8+ef, int4+ef, SparseLoCo) with the
plain mean and with ``centered_clip`` + ``--auth secret`` it measures, per peer per round: bytes
handed to the transport (every message's length), round time (time spent in the exchange),
utilization (the rest of the wall time), and worker 0's held-out loss at the end. Each runs on
the path the exchange picks (``auto``) and, at ``baseline_peers``, on today's gathered path, so
the table says what the compressed all-reduce saves and what it costs in loss. The ideal
``2 (n-1)/n x payload`` of a ring all-reduce is drawn beside the measured bytes.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from farlink.bench.inprocess import train_in_process
from farlink.codecs import make_compressor
from farlink.comm.base import LinkModel
from farlink.robust.aggregators import make_aggregator
from farlink.robust.auth import SharedSecretAuth
from farlink.sync.exchange import Exchange

CODECS = {
    "fp32": {"algorithm": "diloco", "codec": "none"},
    "int8+ef": {"algorithm": "diloco", "codec": "int8+ef"},
    "int4+ef": {"algorithm": "diloco", "codec": "int4+ef"},
    "sparseloco": {"algorithm": "sparseloco", "codec": "none"},
}
RULES = {"mean": ("mean", False), "centered_clip+auth": ("centered_clip", True)}
SECRET = "bench-scale-secret"


class TimedExchange(Exchange):
    """An exchange that adds up the time its rounds take (the peer's round time)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.seconds, self.rounds, self.paths = 0.0, 0, set()

    def average(self, tensors, weight, round_id):  # noqa: ANN001, ANN201
        start = time.perf_counter()
        try:
            return super().average(tensors, weight, round_id)
        finally:
            self.seconds += time.perf_counter() - start
            self.rounds += 1
            self.paths.add(self.last_path)


def run_one(codec: str, rule: str, peers: int, path: str, base: dict,
            link: LinkModel | None) -> dict:
    """One variant at ``peers`` peers on ``path``: its row of the table."""
    aggregator, auth = RULES[rule]
    values = {**base, **CODECS[codec], "workers": peers, "aggregator": aggregator}
    exchanges: dict[int, TimedExchange] = {}
    lock = threading.Lock()

    def build(collective, rank: int, cfg, **parts) -> TimedExchange:  # noqa: ANN001, ANN003
        ex = TimedExchange(collective, sender=f"w{rank}",
                           aggregator=make_aggregator(cfg.aggregator),
                           authenticator=SharedSecretAuth(SECRET, peer_id=f"w{rank}")
                           if auth else None, path=path, **parts)
        with lock:
            exchanges[rank] = ex
        return ex

    row = train_in_process(f"{codec}/{rule}/{peers}/{path}", values, eval_points=1,
                           exchange_factory=build, link=link)
    rounds = max(ex.rounds for ex in exchanges.values())
    paths = sorted(set().union(*(ex.paths for ex in exchanges.values())))
    payload = make_compressor(values["codec"]).codec.max_payload_nbytes((row["params"],))
    per_round = row["bytes_per_worker"] / max(rounds, 1)
    round_s = max(ex.seconds for ex in exchanges.values()) / max(rounds, 1)
    return {
        "codec": codec, "rule": rule, "peers": peers, "path": "/".join(paths), "asked": path,
        "rounds": rounds, "params": row["params"],
        "bytes_per_peer_per_round": per_round,
        "dense_payload": payload,
        "ideal_allreduce_bytes": 2 * (peers - 1) / peers * payload,
        "ratio_to_ideal": per_round / (2 * (peers - 1) / peers * payload),
        "round_s": round_s,
        "utilization": 1 - round_s * rounds / row["wall_s"] if row["wall_s"] else None,
        "heldout_loss": row["final_heldout_loss"],
        "wall_s": row["wall_s"],
    }


def run(out: Path, peers: list[int], codecs: list[str], rules: list[str], steps: int,
        inner_steps: int, baseline_peers: list[int], link: LinkModel | None,
        extra: dict | None = None, name: str = "scale") -> dict:
    """Every (codec, rule, n) on the picked path, and on the gathered path at
    ``baseline_peers``; writes ``NAME.json`` and ``NAME.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    base = {"model": "nano", "steps": steps, "inner_steps": inner_steps, "warmup_steps": 2,
            "batch_size": 2, "seq_len": 64, "eval_batches": 4, "threads": 1, **(extra or {})}
    rows = []
    for codec in codecs:
        for rule in rules:
            for n in peers:
                for path in ["auto"] + (["gathered"] if n in baseline_peers
                                        and codec != "sparseloco" else []):
                    rows.append(run_one(codec, rule, n, path, base, link))
                    _write(out, rows, base, link, name)
    for row in rows:  # loss and bytes against today's gathered path at the same n
        today = next((r for r in rows if r["asked"] == "gathered" and r["codec"] == row["codec"]
                      and r["rule"] == row["rule"] and r["peers"] == row["peers"]), None)
        if today is not None and row["asked"] == "auto":
            row["loss_vs_gathered"] = row["heldout_loss"] / today["heldout_loss"] - 1
            row["bytes_vs_gathered"] = (row["bytes_per_peer_per_round"]
                                        / today["bytes_per_peer_per_round"])
    result = _write(out, rows, base, link, name)
    _plot(out, rows, name)
    return result


def _write(out: Path, rows: list[dict], base: dict, link: LinkModel | None,
           name: str) -> dict:
    result = {"config": {k: v for k, v in base.items() if k != "cache_dir"}, "link": None if link is None else {
        "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s},
        "emulation": "in-process (threads; each collective sleeps latency + bytes/bandwidth)",
        "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


def _plot(out: Path, rows: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = sorted({r["rule"] for r in rows})
    fig, axes = plt.subplots(1, len(rules), figsize=(6 * len(rules), 4.5), squeeze=False)
    for ax, rule in zip(axes[0], rules):
        for codec in dict.fromkeys(r["codec"] for r in rows):
            mine = sorted((r for r in rows if r["codec"] == codec and r["rule"] == rule),
                          key=lambda r: r["peers"])
            auto = [r for r in mine if r["asked"] == "auto"]
            if not auto:
                continue
            line, = ax.plot([r["peers"] for r in auto],
                            [r["bytes_per_peer_per_round"] for r in auto], "o-",
                            label=f"{codec} ({auto[-1]['path']})")
            if codec != "sparseloco":
                ax.plot([r["peers"] for r in auto], [r["ideal_allreduce_bytes"] for r in auto],
                        ":", color=line.get_color(), label=f"{codec}: 2(n-1)/n x payload")
            today = [r for r in mine if r["asked"] == "gathered"]
            if today:
                ax.plot([r["peers"] for r in today],
                        [r["bytes_per_peer_per_round"] for r in today], "x",
                        color=line.get_color(), markersize=9, label=f"{codec}: gathered")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("peers")
        ax.set_ylabel("bytes per peer per round")
        ax.set_title(rule)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
