"""``farlink bench rl``: GRPO with rollout workers, side by side, in one process.

Scenarios (one base model, pre-trained once by the short recipe):

- ``rise``: held-out accuracy before and after, for several seeds (2 workers, staleness 2);
- ``workers``: 1, 2 and 4 workers paced at ``PACE`` seconds per job: rollouts per second;
- ``staleness``: max staleness 0, 2 and 8 with 4 unpaced workers;
- ``cheats``: 2 honest workers beside one of each dishonest kind, for several seeds: who is
  banned, how many of a cheat's groups reached a step, and how many of those were forged (not
  what an honest worker would have handed in: none may be);
- ``diloco_two_groups``: the trainer as two replica groups, DiLoCo between them;
- ``false_rejects``: honest groups sampled with 1 and 2 threads and in fp32 and bf16, checked
  as the trainer checks: the rate the verifier wrongly refuses; beside it ``detection``:
  fabricated groups (the reference answer with honest commitments) passed, refused as
  near-ties, or refused outright;
- ``processes``: two worker processes over TCP, one SIGKILLed, the trainer restarted from its
  checkpoint halfway: committed steps lost (none) and groups accepted per worker.
- ``home_links``: 4 workers whose job requests, policy fetches and hand-ins each cross an
  emulated ``home`` link (in-process emulation, :mod:`farlink.rl.linked`), beside the same run
  on no link, paced and unpaced: throughput, staleness and bytes per policy update.

Writes ``rl.json`` and ``rl.png`` to ``out``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from farlink.rl.policy import sample_group
from farlink.rl.trainer import RLConfig
from farlink.rl.verify import NEAR_TIE, check, recomputed_logits
from farlink.train.rl import LR, TASK, make_base, make_session, run_session

PACE = 0.4


def _session(seed: int, steps: int, **options) -> dict:
    base = make_base(TASK, seed=0)
    config = RLConfig(seed=seed, max_staleness=options.pop("max_staleness", 2))
    torch.manual_seed(seed)
    max_wall_s = options.pop("max_wall_s", 1e9)
    session = make_session(base, config, **options)
    summary = run_session(session, steps, eval_every=max(steps // 3, 1), max_wall_s=max_wall_s)
    summary["curve"] = [{k: r.get(k) for k in ("step", "reward", "wall_s", "rollouts_total",
                                               "heldout_accuracy", "staleness_mean")}
                        for r in session.logs]
    return summary


def diloco_groups(steps: int, inner_steps: int = 5, lr: float = LR) -> dict:
    """Two trainer replica groups (2 workers each) with DiLoCo between them: each steps its
    own AdamW and every ``inner_steps`` steps they average their pseudo-gradients."""
    import farlink
    from farlink.comm.inprocess import InProcessGroup

    def member(rank: int, collective) -> dict:  # noqa: ANN001
        base = make_base(TASK, seed=0)
        model = base.model
        inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        sync = farlink.Optimizer(model, inner, collective=collective, index=rank,
                                 backend="inprocess", algorithm="diloco",
                                 inner_steps=inner_steps, grad_clip=1.0)
        session = make_session(base, RLConfig(seed=rank), workers=2,
                               step_fn=lambda tokens: sync.step(tokens=tokens))
        summary = run_session(session, steps, eval_every=max(steps // 3, 1))
        summary["outer_steps"] = sync.outer_step
        summary["bytes_sent"] = sync.metrics().get("bytes_sent")
        return summary

    groups = InProcessGroup(2).run(member, timeout=3600)
    return {"groups": groups,
            "heldout_accuracy_final": [g["heldout_accuracy_final"] for g in groups]}


def false_rejects(groups: int = 200) -> dict:
    """Honest groups under other thread counts and bf16, checked by the trainer's recompute
    (one thread, in the precision each group names)."""
    base = make_base(TASK, seed=0)
    config = RLConfig()
    rates = {}
    for label, threads, dtype in (("fp32_1thread", 1, torch.float32),
                                  ("fp32_2threads", 2, torch.float32),
                                  ("bf16_1thread", 1, torch.bfloat16),
                                  ("bf16_2threads", 2, torch.bfloat16)):
        rejected = total = 0
        reasons: list[str] = []
        for g in range(groups):
            problem = base.task.draw(__import__("random").Random(g))
            torch.set_num_threads(threads)
            rollouts = sample_group(base.model, base.codec.prompt_ids(problem.prompt),
                                    [g * 100 + i for i in range(config.group_size)], worker="h",
                                    job=g, version=0, stop_id=base.codec.eot,
                                    max_new_tokens=config.max_new_tokens,
                                    every=config.fingerprint_every, k=config.fingerprint_k,
                                    dtype=dtype)
            torch.set_num_threads(1)
            logits = recomputed_logits(base.model, rollouts)
            for r, lg in zip(rollouts, logits):
                total += 1
                reason = check(r, lg, config.temperature, config.fingerprint_every)
                if reason is not None:
                    rejected += 1
                    reasons.append(reason)
        clear = sum(1 for r in reasons if not r.startswith(NEAR_TIE))
        rates[label] = {"rollouts": total, "rejected": rejected, "rate": rejected / total,
                        "rejected_beyond_near_tie": clear, "reasons": reasons}
    return rates


def detection(groups: int = 200) -> dict:
    """Fabricated groups (every completion replaced by the reference answer, with commitments
    and log-probabilities honestly computed for it: the strongest form) checked as the trainer
    checks: how many that differ from the honest draw pass, are refused as near-ties, or are
    refused outright. A fabricated group equal to the honest draw is the honest group."""
    from farlink.rl.board import RolloutBoard
    from farlink.rl.broadcast import PolicyPublisher, PolicyReplica
    from farlink.codecs import make_codec
    from farlink.rl.workers import RolloutWorker

    base = make_base(TASK, seed=0)
    config = RLConfig()
    cheat = RolloutWorker("f", RolloutBoard(base.task, base.codec, config.group_size),
                          PolicyPublisher(base.model, make_codec("int4")),
                          PolicyReplica(base.model, make_codec("int4")), config,
                          behaviour="fabricate")
    counts = {"groups": 0, "equal_to_honest": 0, "passed": 0, "near_tie": 0, "refused": 0}
    for g in range(groups):
        problem = base.task.draw(__import__("random").Random(g))
        honest = sample_group(base.model, base.codec.prompt_ids(problem.prompt),
                              [g * 100 + i for i in range(config.group_size)], worker="f",
                              job=g, version=0, stop_id=base.codec.eot,
                              max_new_tokens=config.max_new_tokens,
                              every=config.fingerprint_every, k=config.fingerprint_k)
        answer = base.codec.tokenizer.encode(problem.answer, add_special_tokens=False).ids
        with torch.no_grad():
            forged = [cheat._committed(r, answer + [base.codec.eot]) for r in honest]
        counts["groups"] += 1
        if [r.completion_ids for r in forged] == [r.completion_ids for r in honest]:
            counts["equal_to_honest"] += 1
            continue
        reasons = [check(r, lg, config.temperature, config.fingerprint_every)
                   for r, lg in zip(forged, recomputed_logits(base.model, forged))]
        refusals = [r for r in reasons if r is not None]
        if not refusals:
            counts["passed"] += 1
        elif all(r.startswith(NEAR_TIE) for r in refusals):
            counts["near_tie"] += 1
        else:
            counts["refused"] += 1
    return counts


def processes(steps: int, pace_seconds: float = 0.2) -> dict:
    """Two ``farlink rl-worker`` processes over TCP: one SIGKILLed a third of the way in;
    halfway the trainer goes down (its server and every connection cut) and a new trainer
    resumes from the last checkpoint on the same port, where the surviving worker reconnects.
    Counts the committed steps (none may be lost) and what each worker got accepted."""
    import signal
    import tempfile

    from farlink.train.rl import restore_state, serve, spawn_workers

    first = make_session(make_base(TASK, seed=0), RLConfig(seed=0), workers=0)
    server = serve(first, "int4")
    address = server.address
    keys = tempfile.TemporaryDirectory()  # the workers' identities, for this run only
    children = spawn_workers(address, 2, pace_seconds, identity_dir=Path(keys.name))
    killed: dict = {}

    def kill_one(row: dict) -> None:
        if row["step"] + 1 >= steps // 3 and not killed:
            children[0].send_signal(signal.SIGKILL)
            killed["after_step"] = row["step"]

    result: dict = {"steps": steps}
    try:
        with tempfile.TemporaryDirectory() as checkpoints:
            a = run_session(first, steps // 2, eval_every=10**9, echo=kill_one,
                            checkpoints=Path(checkpoints), remote=True, server=server)
            server.close()  # the trainer is gone
            second = make_session(make_base(TASK, seed=0), RLConfig(seed=0), workers=0)
            result["resumed_after_step"] = restore_state(Path(checkpoints), second)
            server = serve(second, "int4", *address)
            b = run_session(second, steps - result["resumed_after_step"], eval_every=10**9,
                            remote=True, server=server)
    finally:
        server.close()
        for child in children:
            child.kill()
            child.wait(timeout=30)
        keys.cleanup()
    result.update(killed_after_step=killed.get("after_step"), committed_steps=b["steps"],
                  lost_steps=steps - b["steps"], killed_returncode=children[0].returncode,
                  rejections=a["rejections"] + b["rejections"],
                  accepted_at_restart=a["groups_accepted"],
                  accepted_total=b["groups_accepted"],
                  worker_labels={**a["worker_labels"], **b["worker_labels"]},
                  wall_s=a["wall_s"] + b["wall_s"],
                  heldout_accuracy_base=a["heldout_accuracy_base"],
                  heldout_accuracy_final=b["heldout_accuracy_final"])
    return result


def home_links(wall_s: float, profile: str = "home", workers: int = 4) -> dict:
    """``workers`` workers for ``wall_s`` seconds each run, on no link and on ``profile``
    links, paced at ``PACE`` and unpaced, side by side."""
    from farlink.links import get_profile

    link = get_profile(profile)
    result: dict = {
        "profile": link.model_dump(), "workers": workers, "wall_s_per_run": wall_s,
        "emulation": "in-process (farlink.rl.linked over farlink.comm.LinkModel): each "
                     "worker's job request and version check are held one round trip, its "
                     "deltas or snapshot bytes at the download rate, its hand-in one way plus "
                     "its bytes at the upload rate, all at the profile's per-hop latency "
                     "(latency + jitter); no queueing, jitter draws or loss; the trainer side "
                     "is not shaped", "runs": {}}
    for pace in (PACE, 0.0):
        for name in ("plain", profile):
            row = _session(0, 10_000, workers=workers, pace_seconds=pace, max_wall_s=wall_s,
                           worker_link=None if name == "plain" else profile)
            staleness = [c["staleness_mean"] for c in row["curve"]
                         if c.get("staleness_mean") is not None]
            crew = row["workers"].values()
            row.update(
                rollouts_per_s=row["rollouts_made"] / row["loop_s"],
                steps_per_s=row["steps"] / row["loop_s"],
                staleness_mean=sum(staleness) / max(len(staleness), 1),
                delta_bytes_per_version=max(w["delta_bytes_per_version"] for w in crew),
                full_fetches=sum(w["full_fetches"] for w in crew),
                bytes_received_per_step=sum(w["bytes_received"] for w in crew)
                / max(row["steps"], 1),
                link_s_per_worker=(sum(w.get("link_s", 0.0) for w in crew) / workers))
            result["runs"][f"{name}_pace{pace}"] = row
    for pace in (PACE, 0.0):
        plain, linked = result["runs"][f"plain_pace{pace}"], result["runs"][f"{profile}_pace{pace}"]
        result[f"ratios_pace{pace}"] = {  # link over plain, side by side
            "rollouts_made_per_s": linked["rollouts_per_s"] / plain["rollouts_per_s"],
            "steps_per_s": linked["steps_per_s"] / plain["steps_per_s"],
            "staleness_mean": {"plain": plain["staleness_mean"],
                               profile: linked["staleness_mean"]},
            "delta_bytes_per_version": {"plain": plain["delta_bytes_per_version"],
                                        profile: linked["delta_bytes_per_version"]},
            "delta_bytes_per_version_over_fp32": linked["delta_bytes_per_version"]
            / linked["bytes_full_fp32"],
            "link_s_per_worker": linked["link_s_per_worker"]}
    return result


SCENARIOS = ("rise", "workers", "staleness", "cheats", "diloco_two_groups", "false_rejects",
             "processes", "home_links")


def run(out: Path, steps: int = 40, seeds: int = 3, worker_wall_s: float = 15.0,
        only: tuple[str, ...] = SCENARIOS) -> dict:
    """Every scenario side by side into ``rl.json`` + ``rl.png``; with ``only`` a subset, into
    ``rl-<names>.json`` (and a plot when ``rise`` is among them), leaving ``rl.json`` alone."""
    unknown = set(only) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    torch.set_num_threads(1)
    started = time.monotonic()
    result: dict = {"task": TASK, "steps": steps, "load_before": os.getloadavg()}
    if "rise" in only:
        result["rise"] = [_session(s, steps, workers=2) for s in range(seeds)]
    if "workers" in only:
        result["workers"] = {n: _session(0, 10_000, workers=n, pace_seconds=PACE,
                                         max_wall_s=worker_wall_s) for n in (1, 2, 4)}
        for row in result["workers"].values():
            row["rollouts_per_s"] = row["rollouts_made"] / row["loop_s"]
    if "staleness" in only:
        result["staleness"] = {k: _session(0, steps, workers=4, max_staleness=k)
                               for k in (0, 2, 8)}
    if "cheats" in only:
        result["cheats"] = [_session(s, steps, workers=2,
                                     malicious=["fabricate", "wrong_model", "stale", "replay"])
                            for s in range(seeds)]
    if "diloco_two_groups" in only:
        result["diloco_two_groups"] = diloco_groups(steps)
    if "false_rejects" in only:
        result["false_rejects"] = false_rejects()
        result["detection"] = detection()
    if "processes" in only:
        result["processes"] = processes(steps)
    if "home_links" in only:
        result["home_links"] = home_links(worker_wall_s)
    result["load_after"] = os.getloadavg()
    result["wall_s"] = time.monotonic() - started
    out.mkdir(parents=True, exist_ok=True)
    name = "rl" if set(only) == set(SCENARIOS) else "rl-" + "-".join(only)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    if "rise" in result:
        _plot(result, out / f"{name}.png")
    elif "home_links" in result:
        _plot_links(result["home_links"], out / f"{name}.png")
    return result


def _plot_links(links: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = links["runs"]
    labels = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in ((axes[0], "rollouts_per_s", "rollouts per second"),
                           (axes[1], "staleness_mean", "mean staleness of used groups"),
                           (axes[2], "delta_bytes_per_version", "delta bytes per version")):
        ax.bar(labels, [runs[k][key] for k in labels])
        ax.set(title=title)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{links['workers']} rollout workers on no link vs "
                 f"{links['profile']['name']} links (in-process emulation)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, row in enumerate(result["rise"]):
        curve = [c for c in row["curve"] if c["reward"] is not None]
        axes[0].plot([c["wall_s"] for c in curve], [c["reward"] for c in curve], label=f"seed {i}")
        axes[1].plot([c["rollouts_total"] for c in curve], [c["reward"] for c in curve],
                     label=f"seed {i}")
    for n, row in result.get("workers", {}).items():
        curve = [c for c in row["curve"] if c["reward"] is not None]
        axes[0].plot([c["wall_s"] for c in curve], [c["reward"] for c in curve], "--",
                     label=f"{n} paced workers")
    axes[0].set(xlabel="wall-clock (s)", ylabel="batch reward", title="reward vs wall-clock")
    axes[1].set(xlabel="rollouts consumed", ylabel="batch reward", title="reward vs rollouts")
    labels, values = [], []
    for i, row in enumerate(result["rise"]):
        labels += [f"s{i} base", f"s{i} RL"]
        values += [row["heldout_accuracy_base"], row["heldout_accuracy_final"]]
    for k, row in result.get("staleness", {}).items():
        labels.append(f"stale {k}")
        values.append(row["heldout_accuracy_final"])
    axes[2].bar(labels, values)
    axes[2].set(ylabel="held-out pass@1 (sampled, T=1)", title="held-out accuracy")
    axes[2].tick_params(axis="x", rotation=60)
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def headline(result: dict) -> dict:
    """The numbers the issue's targets are stated in, from a bench result (of the scenarios
    it holds)."""
    out: dict = {}
    if "rise" in result:
        rise = [(r["heldout_accuracy_base"], r["heldout_accuracy_final"]) for r in result["rise"]]
        greedy = [(r["heldout_greedy_base"], r["heldout_greedy_final"]) for r in result["rise"]]
        per_version = [w["delta_bytes_per_version"] / r["bytes_full_fp32"]
                       for r in result["rise"] for w in r["workers"].values()
                       if "delta_bytes_per_version" in w]
        out.update(heldout_rise_per_seed=[round(b2 - b1, 4) for b1, b2 in rise],
                   heldout_base_final=rise, heldout_greedy_base_final=greedy,
                   delta_bytes_per_version_over_fp32=max(per_version) if per_version else None)
    if "workers" in result:
        speeds = {int(n): r["rollouts_per_s"] for n, r in result["workers"].items()}
        out.update(throughput_4_over_1=speeds[4] / speeds[1],
                   throughput_2_over_1=speeds[2] / speeds[1])
    if "staleness" in result:
        out["staleness_final_accuracy"] = {k: r["heldout_accuracy_final"]
                                           for k, r in result["staleness"].items()}
    if "cheats" in result:
        per_seed = []
        for cheats in result["cheats"]:
            workers = cheats["workers"]
            per_seed.append({
                "banned": sorted({w for w, _ in cheats["rejections"]}),
                "honest_groups_refused": sum(1 for w, _ in cheats["rejections"] if "honest" in w),
                "cheat_groups_accepted": {k: v["groups_accepted"] for k, v in workers.items()
                                          if "honest" not in k},
                "forged_groups_handed_in": {k: v["forged_groups_handed_in"]
                                            for k, v in workers.items() if "honest" not in k},
                "forged_groups_accepted": sum(v["forged_groups_accepted"]
                                              for v in workers.values())})
        out["cheats_per_seed"] = per_seed
    if "false_rejects" in result:
        out["false_reject_rate"] = {k: v["rate"] for k, v in result["false_rejects"].items()}
        out["fabricated_groups"] = result.get("detection")
    if "diloco_two_groups" in result:
        out["diloco_two_groups_final"] = result["diloco_two_groups"]["heldout_accuracy_final"]
    if "home_links" in result:
        links = result["home_links"]
        out["home_links"] = {k: v for k, v in links.items() if k.startswith("ratios")}
    if "processes" in result:
        out["processes"] = {k: result["processes"][k] for k in
                            ("killed_after_step", "resumed_after_step", "committed_steps",
                             "lost_steps", "rejections")}
    return out
