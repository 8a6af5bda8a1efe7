"""``farlink bench churn --backend hivemind``: a volunteer swarm whose peers come and go.

The run is set up the way a community run really is: a bootstrap peer (``farlink swarm start``)
serves the run's definition, and every volunteer is a ``farlink swarm join`` process with the
printed command, its own run dir and its own data cache (nothing shared but the bootstrap peer's
address). At ``rate`` departures per 100 committed rounds the driver SIGKILLs a random settled
volunteer: the signal goes to its whole process group (the worker, its DHT process, its p2p
daemon), as when a volunteer's machine loses power, so it leaves no goodbye and no claim release.
Each departure is followed by an arrival: a new volunteer with a new, empty run dir joins with
the same command once the departed one's shard claim has expired
(:data:`farlink.comm.swarm_shards.CLAIM_TTL`), so the newcomer finds that shard free, takes it
over and continues from its last committed data position. Arrivals therefore come at the same
rate as departures.

Nobody is killed while the swarm would fall below ``min_replicas`` live peers, in a volunteer's
first round (it has not settled yet) or in the run's last rounds. Afterwards
:func:`farlink.train.swarm_audit.audit_swarm` reads every volunteer's run dir (the departed
included) and says whether a committed token was lost and whether every survivor ended on the
same state; see that module for what "committed" means in community mode.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from farlink.bench.churn import last_committed_outer_step, worker_records
from farlink.bench.report import write_json
from farlink.bench.runner import set_aside_earlier_runs
from farlink.bench.swarm import join_command
from farlink.train.swarm_audit import audit_swarm


def _settled(records: list[dict]) -> bool:
    """Whether a volunteer has taken part in a committed round (healed or averaged)."""
    return any(r["kind"] == "sync" and r.get("committed") for r in records)


class SwarmChurn:
    """Drives one churn run: the bootstrap peer, volunteers arriving and being SIGKILLed."""

    def __init__(self, out: Path, rounds: int, inner_steps: int, volunteers: int, rate: float,
                 model: str, seed: int, timeout_s: float, min_replicas: int = 2,
                 pace_seconds: float | None = None) -> None:
        from farlink.comm.swarm_shards import CLAIM_TTL, SETTLE_S

        self.out, self.rounds, self.inner_steps = out, rounds, inner_steps
        self.start_volunteers, self.rate, self.model = volunteers, rate, model
        self.min_replicas = min_replicas
        # every inner step padded to this long: rounds as slow on an idle machine as on a busy one
        self.pace_seconds = pace_seconds
        self.rng = random.Random(seed)
        self.deadline = time.monotonic() + timeout_s
        # a departed volunteer's claim lives this long after its last refresh
        self.claim_ttl = CLAIM_TTL + SETTLE_S + 2.0
        self.procs: dict[str, subprocess.Popen] = {}
        self.dirs: dict[str, Path] = {}
        self.events: list[dict] = []
        self.t0 = time.time()

    # --- processes -----------------------------------------------------------------------------
    def _farlink(self, name: str, args: list[str]) -> subprocess.Popen:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{name}.log").open("w") as log:
            # a session of its own: one SIGKILL to the group ends all of the volunteer
            return subprocess.Popen([sys.executable, "-m", "farlink.cli", *args],
                                    stdout=log, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True, env={**os.environ,
                                                                 "PYTHONUNBUFFERED": "1"})

    def _arrive(self, command: list[str], committed: int) -> str:
        name = f"v{len(self.dirs)}"
        self.dirs[name] = self.out / "runs" / name
        self.procs[name] = self._farlink(name, [
            *command, "--run-dir", str(self.dirs[name]),
            "--cache-dir", str(self.out / "caches" / name)])
        self.events.append({"event": "arrive", "volunteer": name, "committed_round": committed,
                            "time": round(time.time() - self.t0, 2)})
        return name

    def _depart(self, name: str, committed: int) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        # the swarm's round as the driver last saw it, and the victim's own last commit
        victim_last = last_committed_outer_step(worker_records(self.dirs[name]))
        self.events.append({"event": "sigkill", "volunteer": name, "committed_round": committed,
                            "victim_last_round": victim_last,
                            "time": round(time.time() - self.t0, 2)})

    def _live(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    # --- the run -------------------------------------------------------------------------------
    def run(self) -> dict:
        steps = self.rounds * self.inner_steps
        flags = ["--model", self.model, "--vocab-size", "512", "--seq-len", "32",
                 "--batch-size", "4", "--eval-batches", "2", "--eval-every", "5",
                 "--workers", str(self.start_volunteers), "--min-replicas",
                 str(self.min_replicas), "--steps", str(steps), "--inner-steps",
                 str(self.inner_steps), "--warmup-steps", str(min(5, steps - 1)),
                 "--log-every", "1"]
        if self.pace_seconds:
            flags += ["--pace-seconds", str(self.pace_seconds)]
        boot = self._farlink("boot", ["swarm", "start", *flags, "--run-dir",
                                      str(self.out / "runs" / "boot"), "--cache-dir",
                                      str(self.out / "caches" / "boot")])
        every = 100.0 / self.rate if self.rate > 0 else float("inf")
        # departures a quarter into each interval of `every` rounds, so the arrival that
        # follows (a claim TTL later) still has rounds left to take part in
        next_kill, arrival_due = every / 4, None
        try:
            command = join_command(boot, self.out / "logs" / "boot.log")
            for _ in range(self.start_volunteers):
                self._arrive(command, 0)
            while self._live():
                if time.monotonic() > self.deadline:
                    raise TimeoutError("the swarm churn run did not finish in time; see "
                                       f"{self.out / 'logs'}")
                records = {n: worker_records(d) for n, d in self.dirs.items()}
                committed = max(last_committed_outer_step(r) for r in records.values())
                live = self._live()
                settled = [n for n in live if _settled(records[n])]
                if (committed >= next_kill and committed < self.rounds - 3
                        and len(settled) == len(live) and len(live) > self.min_replicas):
                    victim = self.rng.choice(settled)
                    time.sleep(self.rng.uniform(0, 1.0))  # anywhere in a step or a round
                    self._depart(victim, committed)
                    next_kill += every
                    arrival_due = time.monotonic() + self.claim_ttl
                if arrival_due is not None and time.monotonic() >= arrival_due:
                    arrival_due = None
                    if committed < self.rounds - 2:
                        self._arrive(command, committed)
                time.sleep(0.5)
        finally:
            for name in self._live():
                os.killpg(self.procs[name].pid, signal.SIGKILL)
            if boot.poll() is None:
                boot.send_signal(signal.SIGINT)
                try:
                    boot.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(boot.pid, signal.SIGKILL)
        audit = audit_swarm(self.dirs)
        return {"audit": audit, "events": self.events,
                "exit_codes": {n: p.returncode for n, p in self.procs.items()},
                "wall_s": round(time.time() - self.t0, 1)}


def run(out: Path, rounds: int = 50, inner_steps: int = 2, volunteers: int = 3,
        rate: float = 4.0, model: str = "nano", seed: int = 0,
        timeout_s: float = 1800.0) -> dict:
    """Run the scenario (module docstring) under ``out``; write ``out/churn-hivemind.json`` and
    ``out/churn-hivemind.png``."""
    set_aside_earlier_runs(out)
    load_before = os.getloadavg()[0]
    driver = SwarmChurn(out, rounds, inner_steps, volunteers, rate, model, seed, timeout_s)
    result = driver.run()
    audit = result["audit"]
    kills = [e for e in result["events"] if e["event"] == "sigkill"]
    arrivals = [e for e in result["events"] if e["event"] == "arrive"
                and e["committed_round"] > 0]
    row = {"backend": "hivemind", "departures_per_100_rounds": rate,
           "rounds": audit["committed_rounds"], "sigkills": len(kills),
           "arrivals": len(arrivals), "consistent": audit["consistent"],
           "same_final_state": audit["same_final_state"],
           "lost_committed_tokens": audit["lost_committed_tokens"],
           "committed_tokens": audit["committed_tokens"],
           "all_departed_shards_picked_up": audit["all_departed_shards_picked_up"]}
    extra = {"config": {"model": model, "rounds": rounds, "inner_steps": inner_steps,
                        "volunteers_at_start": volunteers, "min_replicas": driver.min_replicas,
                        "seed": seed},
             "audit": audit, "events": result["events"], "exit_codes": result["exit_codes"],
             "wall_s": result["wall_s"], "cpus": os.cpu_count(),
             "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    write_json(out / "churn-hivemind.json", "churn-hivemind", [row], extra)
    try:
        plot(out / "churn-hivemind.png", driver.dirs, result["events"], audit)
    except ImportError:  # matplotlib is the optional ``plots`` extra
        pass
    return {"rows": [row], **extra}


def plot(path: Path, dirs: dict[str, Path], events: list[dict], audit: dict) -> Path:
    """Left: held-out loss against the swarm's committed tokens. Right: the peers that averaged
    each committed round, with every SIGKILL and arrival marked at the round it came in."""
    from farlink.bench.report import pyplot, save_figure

    plt = pyplot()
    records = {n: worker_records(d) for n, d in dirs.items()}
    per_round: dict[int, int] = {}
    for rs in records.values():
        last = 0
        for r in rs:
            if r["kind"] == "sync" and r.get("committed"):
                if not r.get("healed"):
                    per_round[r["outer_step"]] = per_round.get(r["outer_step"], 0) \
                        + r["tokens"] - last
                last = r["tokens"]
    cumulative, total = {0: 0}, 0
    for rnd in range(1, max(per_round, default=0) + 1):
        total += per_round.get(rnd, 0)
        cumulative[rnd] = total
    group: dict[int, int] = {}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rs in records.items():
        evals = sorted((cumulative.get(r["outer_step"], total), r["loss"]) for r in rs
                       if r["kind"] == "eval")
        if evals:
            left.plot(*zip(*evals), marker="o", markersize=3, label=name)
        for r in rs:
            if r["kind"] in ("sync", "join") and r.get("committed"):
                group[r["outer_step"]] = max(group.get(r["outer_step"], 0), r["world_size"])
    if group:
        right.step(*zip(*sorted(group.items())), where="mid", color="0.3",
                   label="peers in the round")
    for e in events:
        if e["committed_round"] == 0:
            continue
        color = "tab:red" if e["event"] == "sigkill" else "tab:green"
        right.axvline(e["committed_round"], color=color, linestyle=":", linewidth=1.2)
    right.plot([], [], ":", color="tab:red", label="SIGKILL of a volunteer")
    right.plot([], [], ":", color="tab:green", label="a volunteer arrives")
    right.set_ylim(0, max(group.values(), default=1) + 1)
    left.set_xlabel("committed tokens (all volunteers)")
    left.set_ylabel("held-out loss")
    left.set_title("held-out loss, each volunteer's evaluations")
    right.set_xlabel("committed round")
    right.set_ylabel("peers averaged")
    right.set_title(f"lost committed tokens: {audit['lost_committed_tokens']}, "
                    f"same final state: {audit['same_final_state']}")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)
