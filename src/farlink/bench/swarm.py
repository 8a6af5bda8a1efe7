"""``farlink bench swarm``: a community run on emulated home links, two volunteers behind NAT.

Four network namespaces (:class:`farlink.emulate.Topology`), each on a ``home`` link (asymmetric
rates) at its own one-way delay, spread over 50-150 ms (:func:`farlink.links.latency_spread`):

- peer 0: the bootstrap peer (``farlink swarm start``) at a reachable address; it trains nothing;
- peer 1: a reachable volunteer (``farlink swarm join --host ITS_ADDRESS``);
- peers 2 and 3: volunteers each behind a NAT router of their own (masquerade out, no inbound
  connections), joining with the same command as peer 1. Each learns from the bootstrap peer
  that it was seen at its router's address, none of its own, and joins in hivemind's client
  mode by itself (it only dials out, announces no address and reduces no share of the
  all-reduce), saying so on its console.

The path: no peer runs with ``--public``, so relays are off and every byte between peers travels
on a direct TCP connection; the report lists whom each NATed volunteer dialed, read from its
router's connection tracking, and the inbound packets its router dropped. The NATed volunteers open theirs to the bootstrap peer (DHT) and to
the reachable volunteer, which reduces the whole all-reduce (hivemind sends a client-mode peer's
part to the non-client peers and the result back). Two NATed peers never need to reach each
other, so no relay is needed; were the reachable volunteer gone, the NATed ones could not average.

Every volunteer trains the run to its end; the report records per peer its reachability, the
note its console printed, bytes sent, the time of each committed round and the group it was
averaged in, and checks that all volunteers end on the same state (the fingerprints their
workers record).

Against what the links allow: each timed round of each volunteer is set against the round's
transfer time (``TRANSFER_TIME``: its largest upload over the home uplink) with its phases, and
after training, in the same namespaces, plain TCP is timed serving what the reachable volunteer
serves each NATed one per round, both asking at once (:func:`serving_floor`). ``swarm.png``
draws both.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import IO

from farlink.bench.report import write_json
from farlink.bench.runner import set_aside_earlier_runs
from farlink.train.metrics import read_metrics

BOOTSTRAP, REACHABLE, NATTED = 0, 1, (2, 3)
LATENCY_RANGE_MS = (50.0, 150.0)


def _farlink_swarm(topo, index: int, args: list[str], log: IO[str] | int) -> subprocess.Popen:
    return topo.spawn(index, [sys.executable, "-m", "farlink.cli", "swarm", *args],
                      env={"PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT,
                      text=True)


def join_command(boot: subprocess.Popen, log_path: Path, timeout_s: float = 300.0) -> list[str]:
    """The arguments after ``farlink`` of the join command the bootstrap peer printed to its
    log (what a volunteer runs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and boot.poll() is None:
        for line in log_path.read_text().splitlines():
            if line.strip().startswith("farlink swarm join "):
                return line.split()[1:]
        time.sleep(0.3)
    raise RuntimeError(f"the bootstrap peer printed no join command; see {log_path}")


def peer_records(run_dir: Path) -> list[dict]:
    """The metrics records a volunteer's worker wrote."""
    return [r for path in sorted((run_dir / "metrics").glob("w*.jsonl"))
            for r in read_metrics(path)]


def peer_report(run_dir: Path) -> dict:
    """A volunteer's committed rounds and end record, from the metrics its worker wrote."""
    records = peer_records(run_dir)
    rounds = [r for r in records if r["kind"] == "sync" and r["committed"]]
    ends = [r for r in records if r["kind"] == "end"]
    end = ends[-1] if ends else {}
    round_s = [r["round_s"] for r in rounds]
    phases = round_phases(records)
    # the first round of a joining volunteer heals it from the others (a "join" record, no
    # round time); the rounds after it are the ones timed here
    return {"finished": end.get("finished", False), "fingerprint": end.get("fingerprint"),
            "outer_steps": end.get("outer_step"), "bytes_sent": end.get("bytes_sent"),
            "mean_round_bytes": (end["bytes_sent"] // end["outer_step"]
                                 if end.get("outer_step") else None),
            "wall_s": end.get("wall_s"), "setup_s": end.get("setup_s"),
            "compute_s": end.get("compute_s"), "comm_s": end.get("comm_s"),
            "round_s": round_s, "mean_round_s": statistics.fmean(round_s) if round_s else None,
            "mean_round_phases_s": phases,
            "group_sizes": [r["world_size"] for r in rounds]}


TRANSFER_TIME = (
    "a round's transfer time: the most bytes any member of the round sent in it (all-reduce, "
    "all-gather and serving client-mode members; votes and state downloads excluded) over the "
    "home uplink's rate (the slowest link those bytes cross: up 50 vs down 200 Mbit/s, the "
    "bootstrap and NAT links no slower). Every byte of a round crosses its sender's uplink and a "
    "round ends for every member only when all of its bytes have arrived (the commit vote waits "
    "for them), so no member's round can be shorter. Each peer's ratio is its round time over "
    "its round's transfer time; rounds whose bytes are not known apart from the joining round "
    "(a volunteer's first timed round) are left out.")


def round_uploads(records: list[dict]) -> dict[int, int]:
    """Bytes this peer sent in each committed round, by the outer step the round ended at:
    the difference of the cumulative ``bytes_sent`` of consecutive sync records (the first sync
    record also holds the joining round's bytes, so it gives none)."""
    syncs = [r for r in records if r["kind"] == "sync" and r.get("bytes_sent") is not None]
    return {after["outer_step"]: after["bytes_sent"] - before["bytes_sent"]
            for before, after in pairwise(syncs) if after.get("committed")}


def transfer_ratios(round_s: dict[int, float], uploads_by_peer: list[dict[int, int]],
                    up_mbit: float) -> list[dict]:
    """Per committed round of one peer: its round time, the round's transfer time (see
    ``TRANSFER_TIME``) and their ratio; rounds where some member's bytes are unknown are left
    out."""
    rows = []
    for step, seconds in sorted(round_s.items()):
        sent = [uploads.get(step) for uploads in uploads_by_peer]
        if not sent or any(b is None for b in sent):
            continue
        transfer_s = max(sent) * 8 / (up_mbit * 1e6)
        rows.append({"outer_step": step, "round_s": seconds,
                     "transfer_s": round(transfer_s, 4), "ratio": round(seconds / transfer_s, 3)})
    return rows


def phases_by_round(records: list[dict]) -> dict[int, dict[str, float]]:
    """Where each committed round after the first spent its time, by the outer step it ended
    at: the collective's phases (matchmaking, all-reduce, all-gather, commit vote) and the rest
    of the round on this peer (encoding, validation, aggregation, the outer step), from the
    cumulative ``phases_s`` of the worker's sync records (none when the backend reports none)."""
    syncs = [r for r in records if r["kind"] == "sync" and "phases_s" in r]
    rounds: dict[int, dict[str, float]] = {}
    for before, after in pairwise(syncs):
        if not after.get("committed"):
            continue
        spent = {k: v - before["phases_s"].get(k, 0.0) for k, v in after["phases_s"].items()}
        spent["rest"] = after["rounds_s"] - before["rounds_s"] - sum(spent.values())
        rounds[after["outer_step"]] = spent
    return rounds


def round_phases(records: list[dict]) -> dict[str, float] | None:
    """The phases of :func:`phases_by_round`, averaged over the rounds; None when the backend
    does not report phases."""
    per_round = list(phases_by_round(records).values())
    if not per_round:
        return None
    return {k: round(statistics.fmean(p.get(k, 0.0) for p in per_round), 3)
            for k in per_round[-1]}


def serving_floor(topo, server_run_dir: Path, repeats: int = 4) -> dict | None:
    """Plain TCP in the same namespaces for the reachable volunteer's round: each NATed
    volunteer asks it at once for half its median round upload (what it serves each of them),
    ``repeats`` times over one connection, idle between (:func:`measure_serving`). Seconds from
    request to last byte, by client; per request, the time until both had everything (a round
    ends only then); and the median of that over the requests after the first (a round's
    connections are open already; the first includes the new connection's ramp). None if the
    volunteer sent nothing."""
    from farlink.emulate.measure import measure_serving

    uploads = list(round_uploads(peer_records(server_run_dir)).values())
    if not uploads:
        return None
    nbytes = int(statistics.median(uploads)) // len(NATTED)
    seconds = measure_serving(topo, REACHABLE, list(NATTED), nbytes, repeats=repeats)
    all_served = [max(times) for times in zip(*seconds.values())]
    return {"bytes_per_client": nbytes, "seconds": {str(i): s for i, s in seconds.items()},
            "all_served_s": all_served,
            "median_s": round(statistics.median(all_served[1:] or all_served), 4)}


def round_over_serving(rows: list[dict], tcp_serving: dict | None) -> float | None:
    """The volunteers' median timed round over plain TCP's time for the same serving."""
    rounds = [r["round_s"] for row in rows for r in row.get("round_over_transfer", [])]
    if not rounds or not tcp_serving:
        return None
    return round(statistics.median(rounds) / tcp_serving["median_s"], 3)


def add_transfer_ratios(rows: list[dict], records_by_peer: list[list[dict]],
                        up_mbit: float) -> None:
    """Give each volunteer's row its rounds' transfer times, ratios (``TRANSFER_TIME``) and
    phases, and the median ratio."""
    uploads = [round_uploads(records) for records in records_by_peer]
    for row, records in zip(rows, records_by_peer):
        round_s = {r["outer_step"]: r["round_s"] for r in records
                   if r["kind"] == "sync" and r.get("committed")}
        per_round = transfer_ratios(round_s, uploads, up_mbit)
        phases = phases_by_round(records)
        for r in per_round:
            if r["outer_step"] in phases:
                r["phases_s"] = {k: round(v, 3) for k, v in phases[r["outer_step"]].items()}
        row["round_over_transfer"] = per_round
        row["median_round_over_transfer"] = _median([r["ratio"] for r in per_round])


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def _console_notes(log_path: Path) -> list[str]:
    return [line.strip() for line in log_path.read_text().splitlines()
            if line.strip().startswith("note:")]


def _path(rows: list[dict]) -> str:
    """How the NATed volunteers' bytes travelled, from whom their routers saw them dial."""
    natted = [r for r in rows if r["reachability"] == "client mode behind NAT"]
    reachable = {r["peer"] for r in rows if r["reachability"] == "reachable"}
    if natted and all(set(r["dialed_peers"]) <= reachable for r in natted):
        return ("direct, no relay (relays off: no --public): the NATed client-mode volunteers "
                "dialed only reachable peers " + ", ".join(
                    f"{r['peer']} -> {r['dialed_peers']}" for r in natted))
    return "not only direct to reachable peers: " + ", ".join(
        f"{r['peer']} -> {r['dialed_peers']}" for r in natted)


def run(out: Path, model: str = "tiny", steps: int = 30, inner_steps: int = 10,
        bandwidth_mbit: float | None = None, timeout_s: float = 900.0) -> dict:
    """Run the scenario (see the module docstring) under ``out``; write ``out/swarm.json``."""
    from farlink.emulate import Topology, detect_capabilities, nat
    from farlink.links import latency_spread, scaled

    caps = detect_capabilities()
    if not caps.full:
        raise SystemExit(f"bench swarm needs network namespace emulation: {caps.reason}")
    set_aside_earlier_runs(out)
    home = scaled("home", bandwidth_mbit) if bandwidth_mbit else "home"
    links = latency_spread(home, 4, *LATENCY_RANGE_MS)
    volunteers = [REACHABLE, *NATTED]
    flags = ["--model", model, "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4",
             "--eval-batches", "2", "--workers", str(len(volunteers)), "--steps", str(steps),
             "--inner-steps", str(inner_steps), "--warmup-steps", "5"]
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with Topology(4, overrides=dict(enumerate(links)), behind_nat=NATTED) as topo:
        with (logs / "boot.log").open("w") as log:
            boot = _farlink_swarm(topo, BOOTSTRAP, [
                "start", "--host", topo.address(BOOTSTRAP), *flags, "--run-dir",
                str(out / "runs" / "boot"), "--cache-dir", str(out / "cache")], log)
        procs: dict[int, subprocess.Popen] = {}
        dialed: dict[int, set[tuple[str, int]]] = {i: set() for i in NATTED}
        try:
            command = join_command(boot, logs / "boot.log")[1:]  # without "swarm"
            for i in volunteers:
                with (logs / f"v{i}.log").open("w") as log:
                    procs[i] = _farlink_swarm(topo, i, [
                        *command, "--host", topo.address(i), "--run-dir",
                        str(out / "runs" / f"v{i}"), "--cache-dir", str(out / f"cache{i}")],
                        log)
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
                for i in NATTED:  # whom each NATed volunteer dialed, seen by its router
                    dialed[i] |= nat.dialed(topo.nat_namespace(i))
                time.sleep(2.0)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
            boot.send_signal(signal.SIGINT)
            try:
                boot.wait(30)
            except subprocess.TimeoutExpired:
                boot.kill()
        for i in NATTED:
            dialed[i] |= nat.dialed(topo.nat_namespace(i))
        tcp_serving = serving_floor(topo, out / "runs" / f"v{REACHABLE}")
        peer_at = {topo.wan_address(j): j for j in range(4)}
        rows = [{"peer": BOOTSTRAP, "role": "bootstrap", "reachability": "reachable",
                 "address": topo.address(BOOTSTRAP), "latency_ms": links[BOOTSTRAP].latency_ms}]
        for i in volunteers:
            rows.append({
                "peer": i, "role": "volunteer",
                "reachability": "client mode behind NAT" if i in NATTED else "reachable",
                "address": topo.address(i), "seen_at": topo.wan_address(i),
                "latency_ms": round(links[i].latency_ms, 1), "exit_code": procs[i].returncode,
                "console_notes": _console_notes(logs / f"v{i}.log"),
                **({"dialed_peers": sorted({peer_at.get(a, a) for a, _ in dialed[i]}, key=str),
                    "inbound_packets_dropped_by_nat": nat.dropped_inbound_packets(
                        topo.nat_namespace(i), nat.WAN_IF.format(i))} if i in NATTED else {}),
                **peer_report(out / "runs" / f"v{i}")})
    trained = [r for r in rows if r["role"] == "volunteer"]
    link = links[0]
    add_transfer_ratios(trained, [peer_records(out / "runs" / f"v{i}") for i in volunteers],
                        link.up_mbit)
    same_state = (all(r["finished"] for r in trained)
                  and len({r["fingerprint"] for r in trained}) == 1)
    extra = {
        "same_state": same_state,
        "transfer_time": TRANSFER_TIME,
        "median_round_over_transfer": _median([r["median_round_over_transfer"] for r in trained]),
        "tcp_serving": tcp_serving,
        "median_round_over_tcp_serving": round_over_serving(trained, tcp_serving),
        "path": _path(rows),
        "links": {"up_mbit": link.up_mbit, "down_mbit": link.down_mbit,
                  "jitter_ms": link.jitter_ms, "latency_ms": [p.latency_ms for p in links]},
        "config": {"model": model, "steps": steps, "inner_steps": inner_steps,
                   "workers": len(volunteers)},
        "wall_s": round(time.monotonic() - started, 1),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "emulation": "netns",
    }
    write_json(out / "swarm.json", "swarm", rows, extra)
    return {"rows": rows, **extra}


PHASE_COLORS = {"matchmaking": "tab:red", "all_reduce": "tab:purple", "all_gather": "tab:blue",
                "commit": "tab:orange", "rest": "0.6"}


def plot_rounds(runs: dict[str, dict], path: Path) -> Path:
    """One panel per run (a swarm.json document, by label): each timed round of each volunteer
    as a bar of its phases, against the round's transfer time (``TRANSFER_TIME``) and, where
    measured, plain TCP's time for the reachable volunteer's serving."""
    from farlink.bench.report import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.6), sharey=True,
                             squeeze=False)
    for ax, (label, doc) in zip(axes[0], runs.items()):
        volunteers = [r for r in doc["rows"] if r["role"] == "volunteer"]
        x = 0.0
        ticks, names = [], []
        for row in volunteers:
            for r in row.get("round_over_transfer", []):
                bottom = 0.0
                for phase, seconds in r.get("phases_s", {}).items():
                    ax.bar(x, max(0.0, seconds), bottom=bottom, width=0.8,
                           color=PHASE_COLORS.get(phase, "0.3"))
                    bottom += max(0.0, seconds)
                ax.plot([x - 0.4, x + 0.4], [r["transfer_s"]] * 2, color="k", linewidth=1.5)
                x += 1
            ticks.append(x - 0.5 - len(row.get("round_over_transfer", [])) / 2)
            where = "NAT" if "NAT" in row["reachability"] else "reachable"
            names.append(f"peer {row['peer']}\n{where}")
            x += 1
        floor = (doc.get("tcp_serving") or {}).get("median_s")
        if floor:
            ax.axhline(floor, color="tab:green", linestyle="--", linewidth=1)
        ax.set_xticks(ticks, names, fontsize=7)
        load = doc.get("load_average", [])
        ax.set_title(f"{label}: median round / transfer {doc.get('median_round_over_transfer')}\n"
                     f"load {load}", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    axes[0][0].set_ylabel("seconds per timed round")
    axes[0][0].set_ylim(0, axes[0][0].get_ylim()[1] * 1.35)  # room for the legend
    handles = [Patch(color=color, label=phase) for phase, color in PHASE_COLORS.items()]
    handles += [Line2D([], [], color="k", label="transfer time (bytes / uplink)"),
                Line2D([], [], color="tab:green", linestyle="--",
                       label="plain TCP, same serving")]
    axes[0][-1].legend(handles=handles, fontsize=6, loc="upper center", ncol=3)
    return save_figure(fig, path, dpi=110)
