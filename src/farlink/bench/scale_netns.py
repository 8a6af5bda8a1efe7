"""``farlink bench scale-netns``: the compressed all-reduce with every peer a process in its own
network namespace, all behind one shared bottleneck, counted by the kernel.

Each variant trains the nano preset with ``farlink train`` (torchft, DiLoCo or SparseLoCo)
inside a :class:`farlink.emulate.Topology` whose workers each have their own access link and
whose uploads all cross one ``shared`` token bucket. It runs twice, for ``rounds[0]`` and
``rounds[1]`` outer rounds, in fresh namespaces; every per-round figure is the difference of the
two runs over the difference of their rounds, which removes setup, quorum, healing and
evaluation traffic. Per row: bytes per worker per round as the kernel counted them (each worker
veth's ``tx_bytes``: frames with Ethernet/IP/TCP headers and the ACKs for what the worker
receives) and as farlink counted them (every message's length), the ideal ``2 (n-1)/n x
payload`` of a ring all-reduce, the TCP segments each worker retransmitted and the packets the
shared queue dropped (resent bytes are in ``tx_bytes`` too), the exchange's seconds per round
(the workers' ``network_s``) and the whole round's (``round_s``: quorum and exchange), both over rounds after the first
(a run of one round gives none), compute utilization and held-out loss of the longer run.

``centered_clip`` runs without ``--auth``: runs inside emulated namespaces refuse it (no
membership gate in front of the router's Lighthouse, a row of :mod:`farlink.matrix`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from farlink.bench.scale import CODECS
from farlink.codecs import make_compressor
from farlink.links import LinkProfile, get_profile

RULES = ("mean", "centered_clip")
DENSE = ("fp32", "int8+ef", "int4+ef")


def variants(codecs: list[str], rules: list[str]) -> list[tuple[str, str]]:
    """(codec, rule) pairs to run: ``centered_clip`` only with the dense codecs (SparseLoCo's
    sparse messages have no dense update for the rule to clip)."""
    return [(c, r) for c in codecs for r in rules if r == "mean" or c in DENSE]


def kernel_tx_bytes(net) -> list[int]:  # noqa: ANN001 - a started emulate.Topology
    """Bytes each worker's interface has transmitted, from the kernel's counters."""
    return [int(subprocess.check_output(
        ["ip", "netns", "exec", net.namespace(i), "cat",
         f"/sys/class/net/{net.ifname(i)}/statistics/tx_bytes"]).strip())
        for i in range(net.n_workers)]


#: TCP counters read in every worker namespace: segments sent again (their bytes are in
#: ``tx_bytes`` too), and what made them: timeouts, tail-loss probes, and the receiver's reports
#: that a resent segment had already arrived (DSACK: the resend was spurious)
TCP_COUNTERS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPDSACKRecv")


def tcp_counters(net) -> list[dict[str, int]]:  # noqa: ANN001 - a started Topology
    """:data:`TCP_COUNTERS` of each worker's namespace (``/proc/net/snmp`` and ``netstat``)."""
    found = []
    for i in range(net.n_workers):
        text = subprocess.check_output(["ip", "netns", "exec", net.namespace(i), "cat",
                                        "/proc/net/snmp", "/proc/net/netstat"], text=True)
        values: dict[str, int] = {}
        lines = [line.split() for line in text.splitlines()]
        for names, numbers in zip(lines, lines[1:]):
            if names[0] in ("Tcp:", "TcpExt:") and names[0] == numbers[0] \
                    and not numbers[1].isalpha():
                values.update({k: int(v) for k, v in zip(names[1:], numbers[1:])
                               if k in TCP_COUNTERS})
        found.append(values)
    return found


def shared_drops(net) -> int:  # noqa: ANN001 - a started Topology
    """Packets the shared bottleneck's queue has dropped (0 without one)."""
    from farlink.emulate.topology import SHARED_IFB

    if net.shared is None:
        return 0
    text = subprocess.check_output(["tc", "-s", "-n", net.router_namespace, "qdisc", "show",
                                    "dev", SHARED_IFB], text=True)
    return int(text.split("dropped ")[1].split(",")[0])


def measure(codec: str, rule: str, peers: int, rounds: tuple[int, int], link: LinkProfile,
            shared: LinkProfile | None, base: dict, out: Path) -> dict:
    """Both run lengths of one variant: what each run counted, per worker."""
    from farlink.bench.runner import run_variant
    from farlink.emulate import Topology
    from farlink.train.metrics import read_metrics

    runs = []
    for count in rounds:
        label = f"{codec}-{rule}-{peers}-{'shared' if shared else 'own'}-R{count}"
        with Topology(peers, link, shared=shared) as net:
            before = kernel_tx_bytes(net)
            tcp_before, drops_before = tcp_counters(net), shared_drops(net)
            row = run_variant(label, {**base, "workers": peers,
                                      "steps": count * base["inner_steps"]},
                              out, network=net, aggregator=rule, **CODECS[codec])
            kernel = [a - b for a, b in zip(kernel_tx_bytes(net), before)]
            tcp = [{k: after[k] - was[k] for k in after}
                   for after, was in zip(tcp_counters(net), tcp_before)]
            drops = shared_drops(net) - drops_before
        metrics = [read_metrics(out / "runs" / label / "metrics" / f"w{w}.jsonl")
                   for w in range(peers)]
        network_s, round_s, paths = [], [], set()
        for records in metrics:
            syncs = [r for r in records if r["kind"] == "sync"]
            network_s += [b["network_s"] - a["network_s"] for a, b in zip(syncs, syncs[1:])]
            round_s += [r["round_s"] for r in syncs[1:]]
            paths |= {r["exchange_path"] for r in syncs if r.get("exchange_path")}
        runs.append({"rounds": count, "kernel_tx_bytes": kernel,
                     "tcp": tcp, "shared_drops": drops,
                     "counted_bytes": [row["per_worker"][f"w{w}"]["bytes_sent"]
                                       for w in range(peers)],
                     "network_s": network_s, "round_s": round_s, "paths": sorted(paths),
                     "heldout_loss": row["final_heldout_loss"],
                     "utilization": row["compute_utilization"], "wall_s": row["wall_s"],
                     "params": next(r["params"] for r in metrics[0] if r["kind"] == "start")})
    return {"codec": codec, "rule": rule, "peers": peers, "runs": runs}


def row_of(m: dict, params: int) -> dict:
    """One table row from both run lengths of a variant (see the module docstring)."""
    short, long = m["runs"][0], m["runs"][-1]
    extra = long["rounds"] - short["rounds"]
    kernel = [(b - a) / extra for a, b in zip(short["kernel_tx_bytes"], long["kernel_tx_bytes"])]
    counted = [(b - a) / extra for a, b in zip(short["counted_bytes"], long["counted_bytes"])]
    n = m["peers"]
    wire_codec = CODECS[m["codec"]]["codec"]
    payload = make_compressor(wire_codec).codec.max_payload_nbytes((params,))
    ideal = 2 * (n - 1) / n * payload
    kernel_mean, counted_mean = statistics.mean(kernel), statistics.mean(counted)
    return {
        "codec": m["codec"], "rule": m["rule"], "peers": n, "shared": m.get("shared"),
        "path": "/".join(long["paths"]), "rounds": [short["rounds"], long["rounds"]],
        "kernel_bytes_per_peer_per_round": kernel_mean,
        "counted_bytes_per_peer_per_round": counted_mean,
        "kernel_vs_counted": kernel_mean / counted_mean if counted_mean else None,
        "dense_payload": payload, "ideal_allreduce_bytes": ideal,
        "counted_vs_ideal": counted_mean / ideal, "kernel_vs_ideal": kernel_mean / ideal,
        "exchange_s": statistics.median(short["network_s"] + long["network_s"]),
        "round_s": statistics.median(short["round_s"] + long["round_s"]),
        "utilization": long["utilization"], "heldout_loss": long["heldout_loss"],
        "wall_s": long["wall_s"],
        **({f"{k}_per_peer_per_round": statistics.mean(
            (b[k] - a[k]) / extra for a, b in zip(short["tcp"], long["tcp"]))
            for k in TCP_COUNTERS} if "tcp" in long else {}),
        "shared_drops_per_round": (long["shared_drops"] - short["shared_drops"]) / extra
        if "shared_drops" in long else None,
        "kernel_bytes_per_worker": kernel, "counted_bytes_per_worker": counted,
    }


def run(out: Path, runs_dir: Path, peers: list[int], codecs: list[str], rules: list[str],
        rounds: tuple[int, int], link: LinkProfile | str, shared: LinkProfile | str,
        unshared: list[str], inner_steps: int = 5, name: str = "scale_netns") -> dict:
    """Every variant at every peer count behind ``shared``, and the ``unshared`` codecs (with
    mean) also without it, for the bottleneck's effect on round time; ``NAME.json`` and
    ``NAME.png`` under ``out`` (written after every variant, with the machine's load)."""
    from farlink.bench.runner import set_aside_earlier_runs

    out.mkdir(parents=True, exist_ok=True)
    set_aside_earlier_runs(runs_dir)
    link, shared = get_profile(link), get_profile(shared)
    base = {"model": "nano", "inner_steps": inner_steps, "warmup_steps": 2, "batch_size": 2,
            "seq_len": 64, "eval_batches": 4, "threads": 1, "backend": "torchft"}
    plan = [(c, r, n, shared) for n in peers for c, r in variants(codecs, rules)]
    plan += [(c, "mean", n, None) for n in peers for c in unshared]
    rows, raw = [], []
    for codec, rule, n, bottleneck in plan:
        started, load = time.time(), os.getloadavg()
        m = measure(codec, rule, n, rounds, link, bottleneck, base, runs_dir)
        m.update({"shared": None if bottleneck is None else bottleneck.name, "load": load,
                  "seconds": time.time() - started})
        raw.append(m)
        rows.append({**row_of(m, m["runs"][-1]["params"]), "load_before": load})
        result = _write(out, name, rows, raw, base, link, shared, rounds)
    _plot(out, name, rows)
    return result


def _write(out: Path, name: str, rows: list[dict], raw: list[dict], base: dict,
           link: LinkProfile, shared: LinkProfile, rounds: tuple[int, int]) -> dict:
    result = {
        "config": base, "rounds": list(rounds), "link": link.model_dump(),
        "shared": shared.model_dump(),
        "emulation": "network namespaces: each worker a process (farlink train, torchft over "
                     "Gloo) behind its own veth (tbf up and down, NFQUEUE delayer), every "
                     "upload also through one shared tbf (ifb in the router namespace)",
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "cpus": os.cpu_count(), "rows": rows, "raw": raw}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


def _plot(out: Path, name: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["shared"]]
    labels = [f"{r['codec']}\n{r['rule'].replace('centered_clip', 'cclip')}\nn={r['peers']}"
              for r in mine]
    xs = range(len(mine))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.8 * len(mine)), 8), sharex=True)
    width = 0.27
    top.bar([x - width for x in xs], [r["kernel_bytes_per_peer_per_round"] for r in mine],
            width, label="kernel tx_bytes")
    top.bar(list(xs), [r["counted_bytes_per_peer_per_round"] for r in mine], width,
            label="counted by farlink")
    top.bar([x + width for x in xs], [r["ideal_allreduce_bytes"] for r in mine], width,
            label="2(n-1)/n x dense payload")
    top.set_yscale("log")
    top.set_ylabel("bytes per peer per round")
    top.legend(fontsize=8)
    bottom.bar(list(xs), [r["exchange_s"] for r in mine], 0.5, label="shared bottleneck")
    for r in rows:
        if not r["shared"]:
            x = next((i for i, s in enumerate(mine) if (s["codec"], s["rule"], s["peers"])
                      == (r["codec"], r["rule"], r["peers"])), None)
            if x is not None:
                bottom.plot([x], [r["exchange_s"]], "k_", markersize=22, mew=3,
                            label="own links only" if "own links only" not in
                            bottom.get_legend_handles_labels()[1] else None)
    bottom.set_ylabel("exchange seconds per round")
    bottom.set_xticks(list(xs), labels, fontsize=7)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
