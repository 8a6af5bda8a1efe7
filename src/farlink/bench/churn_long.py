"""Long churn: SIGKILLs aimed at every moment a worker can die in, Lighthouse kills, bad disks.

:func:`run_long_churn` runs a job like ``farlink train`` and works through a shuffled schedule of
faults, one at a time, each once the previous victim is back in the run:

- SIGKILL of a random worker at a chosen moment: during an inner step, in an outer round (after
  the last inner step of the round), while it writes its checkpoint (its temporary checkpoint
  directory exists), or while it heals (restarted, in its first round, not yet joined); the
  victim is restarted with ``--resume --join``;
- SIGKILL of the Lighthouse, restarted on the same address after a random pause;
- a damaged checkpoint: a worker is killed, one bit of its newest checkpoint is flipped (or the
  file is cut in half) and it is restarted; it must refuse that checkpoint, resume from an older
  one and heal from a live peer.

The moment of each kill is recorded as observed when the signal was sent (not as intended):
a victim aimed at mid-write whose save had already finished is recorded as killed after the
round. At the end the audit must find one fingerprint per committed outer step, none missing and
none recomputed: replicas consistent and no committed token lost.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from farlink.config import RunConfig
from farlink.train.audit import audit_run
from farlink.state.checkpoint import TEMP_PREFIX, TENSORS
from farlink.train.launcher import _stop_all, spawn_worker, summarize, write_run_config
from farlink.train.lighthouse import Lighthouse

MOMENTS = ("step", "round", "checkpoint_write", "heal")


class MetricsTail:
    """The new complete records of one worker's JSONL metrics since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.records = path, 0, []
        self.committed = 0  # the highest committed outer step it logged

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.records += new
        self.committed = max([self.committed] + [r["outer_step"] for r in new
                                                 if r["kind"] == "sync" and r.get("committed")])
        return new


@dataclass
class WorkerView:
    """What the driver knows of one worker: its process and where its metrics say it is."""

    index: int
    proc: object
    tail: MetricsTail
    spawned: float = 0.0
    started: bool = False  # its 'start' record since the last spawn
    joined: bool = True  # restarted workers: their join round is done
    last: dict = field(default_factory=dict)  # its last step/sync record

    def refresh(self) -> None:
        for r in self.tail.poll():
            if r["kind"] == "start" and r.get("pid") == self.proc.pid:
                self.started = True
            elif r["kind"] == "join" and self.started:
                self.joined = True
            elif r["kind"] in ("step", "sync") and self.started:
                self.last = r

    @property
    def settled(self) -> bool:
        return self.proc.poll() is None and self.started and self.joined


class LongChurn:
    def __init__(self, cfg: RunConfig, seed: int, timeout: float) -> None:
        self.cfg, self.rng = cfg, random.Random(seed)
        self.deadline = time.time() + timeout
        self.events: list[dict] = []
        self.port = None
        self.lighthouse: Lighthouse | None = None
        self.workers: dict[int, WorkerView] = {}
        self.t0 = time.time()

    # --- processes -----------------------------------------------------------------------------
    def _lighthouse(self) -> Lighthouse:
        cfg = self.cfg
        return Lighthouse(cfg.host, port=self.port, min_replicas=cfg.min_replicas,
                          join_timeout=cfg.join_timeout, heartbeat_timeout=cfg.heartbeat_timeout,
                          log_path=cfg.run_dir / "lighthouse.log").start()

    def _spawn(self, index: int, restart: bool) -> None:
        proc = spawn_worker(self.cfg, index, self.lighthouse.address, resume=restart,
                            join=restart)
        view = self.workers.get(index)
        tail = view.tail if view else MetricsTail(self.cfg.run_dir / "metrics" / f"w{index}.jsonl")
        self.workers[index] = WorkerView(index, proc, tail, spawned=time.time(), joined=not restart)

    def _kill(self, view: WorkerView, aimed: str) -> dict:
        view.refresh()
        moment = self._moment(view)
        os.kill(view.proc.pid, signal.SIGKILL)
        view.proc.wait()
        ckpt = self.cfg.run_dir / "checkpoints" / f"w{view.index}"
        torn = [p.name for p in ckpt.glob(f"{TEMP_PREFIX}*{view.proc.pid}")] \
            if ckpt.is_dir() else []  # what this very kill left half-written
        event = {"event": "kill", "worker": view.index, "aimed": aimed, "moment": moment,
                 "step": view.last.get("step"), "outer_step": self.committed(),
                 "time": round(time.time() - self.t0, 3), "torn_files": torn}
        self.events.append(event)
        return event

    def _moment(self, view: WorkerView) -> str:
        """Where the victim is as the signal goes out, from what it has left on disk."""
        ckpt = self.cfg.run_dir / "checkpoints" / f"w{view.index}"
        if not view.started:
            return "startup"
        if not view.joined:
            return "heal"
        if ckpt.is_dir() and any(ckpt.glob(f"{TEMP_PREFIX}*{view.proc.pid}")):
            return "checkpoint_write"
        last = view.last
        if last.get("kind") == "sync":
            return "after_round"  # between its round and the next step: checkpoint, evaluation
        if last and last["step"] % self.cfg.inner_steps == self.cfg.inner_steps - 1:
            return "round"  # the round's last inner step and the round itself
        return "step"

    # --- observing ---------------------------------------------------------------------------
    def committed(self) -> int:
        return max((v.tail.committed for v in self.workers.values()), default=0)

    def _refresh(self) -> None:
        for view in self.workers.values():
            view.refresh()

    def _wait(self, what: str, until, poll: float = 0.05, limit: float = 300.0) -> bool:
        """Poll until ``until()``; False when a worker exited on its own or the run ended."""
        end = min(self.deadline, time.time() + limit)
        while time.time() < end:
            self._refresh()
            if until():
                return True
            if any(v.proc.poll() is not None for v in self.workers.values()):
                return False  # finished (or failed): no more faults
            time.sleep(poll)
        raise TimeoutError(f"long churn: no {what} within {limit:.0f}s "
                           f"(events so far: {len(self.events)})")

    def _near_end(self) -> bool:
        return self.committed() >= self.cfg.steps // self.cfg.inner_steps - 3

    # --- faults ------------------------------------------------------------------------------
    def kill_worker(self, aimed: str, view: WorkerView | None = None) -> bool:
        """SIGKILL one settled worker at the ``aimed`` moment and restart it."""
        view = view or self.rng.choice([v for v in self.workers.values() if v.settled])
        h = self.cfg.inner_steps
        if aimed == "step":
            seen = view.last.get("step", -1)
            ok = self._wait("inner step", lambda: view.last.get("kind") == "step"
                            and view.last["step"] != seen
                            and view.last["step"] % h not in (0, h - 1), poll=0.01)
            time.sleep(self.rng.uniform(0, 0.02))
        elif aimed == "round":
            ok = self._wait("round", lambda: view.last.get("kind") == "step"
                            and view.last["step"] % h == h - 1, poll=0.01)
            time.sleep(self.rng.uniform(0, 0.2))
        elif aimed == "checkpoint_write":
            ckpt = self.cfg.run_dir / "checkpoints" / f"w{view.index}"
            pid = view.proc.pid
            ok = self._wait("checkpoint write", lambda: any(ckpt.glob(f"{TEMP_PREFIX}*{pid}")),
                            poll=0.002)
        else:  # heal: kill it once, then again once restarted, inside its first round
            if not self.kill_worker("step", view):
                return False
            view = self.workers[view.index]
            ok = self._wait("restarted worker", lambda: view.started, poll=0.02)
            time.sleep(self.rng.uniform(0, 0.3))
        if not ok or self._near_end():
            return False
        self._kill(view, aimed)
        self._spawn(view.index, restart=True)
        return True

    def corrupt_checkpoint(self, flavour: str) -> bool:
        def checkpoints(v: WorkerView) -> list[Path]:
            return sorted((self.cfg.run_dir / "checkpoints" / f"w{v.index}").glob("step-*"))

        ok = self._wait("a settled worker with a checkpoint", lambda: any(
            v.settled and checkpoints(v) for v in self.workers.values()))
        if not ok:
            return False
        view = self.rng.choice([v for v in self.workers.values() if v.settled and checkpoints(v)])
        self._kill(view, "corrupt")
        newest = checkpoints(view)[-1]  # the one a resume tries first
        target = newest / TENSORS
        data = bytearray(target.read_bytes())
        if flavour == "flip":
            data[len(data) // 2] ^= 0x10
        else:
            data = data[: len(data) // 2]
        target.write_bytes(bytes(data))
        self.events.append({"event": "corrupt", "worker": view.index, "checkpoint": newest.name,
                            "how": flavour, "time": round(time.time() - self.t0, 3)})
        self._spawn(view.index, restart=True)
        return True

    def kill_lighthouse(self) -> bool:
        self.lighthouse.stop(kill=True)
        down = self.rng.uniform(0.5, 3.0)
        self.events.append({"event": "lighthouse_kill", "down_s": round(down, 2),
                            "outer_step": self.committed(),
                            "time": round(time.time() - self.t0, 3)})
        time.sleep(down)
        self.lighthouse = self._lighthouse()
        before = self.committed()
        return self._wait("round after the Lighthouse restart",
                          lambda: self.committed() > before, limit=600)

    # --- the run -----------------------------------------------------------------------------
    def run(self, kills: int, lighthouse_kills: int, corruptions: int) -> dict:
        self.targets = {"worker_sigkills": kills, "lighthouse_sigkills": lighthouse_kills,
                        "corrupted_checkpoints": corruptions}
        cfg = self.cfg
        write_run_config(cfg)
        from farlink.data import prepare_data

        prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir)
        self.lighthouse = self._lighthouse()
        self.port = self.lighthouse.port
        for i in range(cfg.workers):
            self._spawn(i, restart=False)
        # heal kills cost two SIGKILLs (the restart they aim at needs a first kill)
        moments = [self.rng.choice(MOMENTS) for _ in range(kills)]
        schedule = [("kill", m) for m in moments]
        self.rng.shuffle(schedule)
        # the Lighthouse kills and corruptions go in the schedule's first half: the schedule
        # stops near the run's end, and a fault drawn last would never be injected
        for fault in [("lighthouse", None)] * lighthouse_kills \
                + [("corrupt", f) for f in (["flip", "truncate"] * corruptions)[:corruptions]]:
            schedule.insert(self.rng.randint(0, len(schedule) // 2), fault)
        try:
            self._wait("first committed round", lambda: self.committed() >= 1, limit=600)
            for kind, arg in schedule:
                worker_kills = sum(e["event"] == "kill" for e in self.events)
                if kind == "kill" and worker_kills >= kills:
                    continue
                if not self._wait("settled workers", lambda: all(
                        v.settled for v in self.workers.values()), limit=600):
                    break
                if self._near_end():
                    break
                done = {"kill": self.kill_worker, "corrupt": self.corrupt_checkpoint,
                        "lighthouse": lambda _: self.kill_lighthouse()}[kind](arg)
                if not done:
                    break
            while any(v.proc.poll() is None for v in self.workers.values()):
                if time.time() > self.deadline:
                    raise TimeoutError("long churn run did not finish in time")
                time.sleep(0.5)
        finally:
            _stop_all([v.proc for v in self.workers.values()])
            self.lighthouse.stop()
        return self.result()

    def _first_record_time(self) -> float:
        return min((v.tail.records[0]["time"] for v in self.workers.values() if v.tail.records),
                   default=self.t0)

    def result(self) -> dict:
        cfg = self.cfg
        self._refresh()  # the records written after the last fault
        audit = audit_run(cfg.run_dir)
        summary = summarize(cfg)
        kills = [e for e in self.events if e["event"] == "kill"]
        rejected = [r for v in self.workers.values() for r in v.tail.records
                    if r["kind"] == "checkpoint_rejected"]
        tokens_per_round = cfg.inner_steps * cfg.tokens_per_step * cfg.workers
        by_moment = {m: sum(e["moment"] == m for e in kills)
                     for m in sorted({e["moment"] for e in kills})}
        result = {
            "workers": cfg.workers, "steps": cfg.steps, "inner_steps": cfg.inner_steps,
            "worker_sigkills": len(kills),
            "sigkills_by_moment": by_moment,
            "kills_leaving_torn_checkpoint_files": sum(bool(e["torn_files"]) for e in kills),
            "lighthouse_sigkills": sum(e["event"] == "lighthouse_kill" for e in self.events),
            "corrupted_checkpoints": sum(e["event"] == "corrupt" for e in self.events),
            "corrupt_checkpoints_refused": len(rejected),
            "outer_steps": audit["outer_steps"],
            "consistent": audit["consistent"] and summary["final_replicas"]["consistent"],
            "audit": {k: audit[k] for k in ("divergent_steps", "missing_steps", "repeated_steps",
                                            "redone_steps", "restarts")},
            "lost_committed_steps": audit["lost_committed_steps"],
            "redone_committed_steps": audit["redone_committed_steps"],
            # committed work that had to be done again or never came back
            "lost_committed_tokens": (audit["lost_committed_steps"]
                                      + audit["redone_committed_steps"]) * tokens_per_round,
            "final_heldout_loss": summary["final_heldout_loss"],
            "first_eval_loss": audit["first_eval_loss"],
            "returncodes": [v.proc.returncode for v in self.workers.values()],
            "targets": self.targets,
            "wall_s": round(time.time() - self.t0, 1),
            "driver_offset_s": round(self.t0 - self._first_record_time(), 3),
            "events": self.events,
            "evals": summary["evals"],
        }
        # the run ends at --steps; faults still scheduled then are not injected
        result["targets_met"] = all(result[k] >= v for k, v in self.targets.items())
        return result


def run_long_churn(cfg: RunConfig, kills: int = 100, lighthouse_kills: int = 2,
                   corruptions: int = 3, seed: int = 0, timeout: float = 4 * 3600.0) -> dict:
    return LongChurn(cfg, seed, timeout).run(kills, lighthouse_kills, corruptions)


def plot_timeline(path: Path, result: dict, run_dir: Path) -> Path:
    """Committed outer step over wall-clock, with every fault marked where it struck."""
    from farlink.bench.report import pyplot, save_figure
    from farlink.train.metrics import read_metrics

    plt = pyplot()

    start = min((r["time"] for p in (run_dir / "metrics").glob("w*.jsonl")
                 for r in read_metrics(p)[:1]), default=0.0)
    commits = sorted((r["time"] - start, r["outer_step"])
                     for p in (run_dir / "metrics").glob("w*.jsonl") for r in read_metrics(p)
                     if r["kind"] == "sync" and r.get("committed"))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if commits:
        ax.plot(*zip(*commits), ".", markersize=2, color="0.5", label="committed rounds")
    offset = result.get("driver_offset_s", 0.0)
    kills = [e for e in result["events"] if e["event"] == "kill"]
    for moment, color in zip(sorted({e["moment"] for e in kills}),
                             ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                              "tab:brown", "tab:pink"]):
        xs = [e["time"] + offset for e in kills if e["moment"] == moment]
        ys = [e["outer_step"] for e in kills if e["moment"] == moment]
        ax.scatter(xs, ys, s=14, color=color, label=f"SIGKILL {moment} ({len(xs)})", zorder=3)
    for e in result["events"]:
        if e["event"] == "lighthouse_kill":
            ax.axvline(e["time"] + offset, color="black", linestyle="--", linewidth=1)
        elif e["event"] == "corrupt":
            ax.axvline(e["time"] + offset, color="tab:red", linestyle=":", linewidth=1)
    ax.plot([], [], "k--", label=f"Lighthouse SIGKILL ({result['lighthouse_sigkills']})")
    ax.plot([], [], ":", color="tab:red",
            label=f"corrupted checkpoint ({result['corrupted_checkpoints']})")
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("committed outer step")
    ax.set_title(f"long churn: {result['workers']} workers, consistent={result['consistent']}, "
                 f"lost committed tokens={result['lost_committed_tokens']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path)
