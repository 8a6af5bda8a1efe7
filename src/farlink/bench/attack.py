"""``farlink bench attack``: clean vs attacked runs, plain mean vs each robust rule.

Attacks are emulated (the attacker's worker rewrites its own pseudo-gradient before encoding:
sign flip, x100, Gaussian noise, free rider, and the adaptive ALIE, IPM and copycat that learn
from the updates they receive, and a token inflator; :mod:`farlink.robust.attacks`). Every run
uses the gathered exchange path (int8 codec, run secret) so each peer's update is seen and
judged individually. The norm screen is turned off here so the aggregation rules, not the
screen, are what is compared. Besides the rules, ``loss`` is the plain mean with loss-scored
contributions (``--score loss``) and ``open`` the default of a run whose members are not all
trusted (``--members open``: centered clipping and loss scoring).

``--in-process`` runs each variant's workers as threads of this process
(:func:`farlink.bench.inprocess.train_in_process`: the real exchange, codec, authentication
and scorer over the in-process collective), which makes the whole matrix affordable on a few
cores; it also records the ratings over rounds, each peer's credited tokens and the scoring
cost (``attack_ratings.png``).

``--protocol`` runs the other matrix: a hostile *member* (:mod:`farlink.robust.hostile`: round
and weight inflation, forged mailbox slots, equivocation, malformed metadata, an always-no voter,
a served NaN state) on each backend, each run judged refused, bounded or FAILED
(:func:`verdict`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from farlink.bench.report import plot_panels, write_json
from farlink.bench.runner import run_variant

RULES = ["mean", "median", "trimmed_mean", "centered_clip", "norm_bounded", "krum", "loss",
         "open"]
#: the emulated attacks the matrix runs by default
ATTACKS = ["sign_flip", "scale:100", "noise:0.1", "free_rider", "alie:1", "alie:3", "alie:10",
           "ipm:0.5", "ipm:4", "ipm:20", "copycat", "inflate:10"]
#: the run settings of a pseudo-rule: loss scoring on the plain mean, an open run's defaults
RULE_SETTINGS = {"loss": {"aggregator": "mean", "score": "loss"}, "open": {"members": "open"}}


def rule_settings(rule: str) -> dict:
    return RULE_SETTINGS.get(rule, {"aggregator": rule})


def run(out: Path, attacks: list[str], setups: list[tuple[int, int]], steps: int,
        inner_steps: int, rules: list[str], reuse: bool = False,
        in_process: bool = False, model: str = "tiny", parallel: int = 1) -> dict:
    """Clean run and every attack x rule, per ``setups`` (workers, attackers); with
    ``in_process``, ``parallel`` variants at once (each in its own process)."""
    jobs = []  # (label, base, overrides, row fields)
    for workers, bad in setups:
        base = {"workers": workers, "steps": steps, "inner_steps": inner_steps,
                "codec": "int8", "auth": "secret", "secret": "bench", "screen_ratio": 0,
                "eval_batches": 8, "model": model,
                "warmup_steps": min(30, steps // 4)}
        attackers = ",".join(str(workers - 1 - i) for i in range(bad))
        jobs.append((f"{workers}w-clean", base, {},
                     {"attack": "none", "aggregator": "mean", "malicious": 0,
                      "workers": workers, "attackers": ""}))
        for attack in attacks:
            for rule in rules:
                # "none" with a rule: the clean run under it (honest peers discounted by scoring)
                count, who = (0, "") if attack == "none" else (bad, attackers)
                label = f"{workers}w-{count}bad-{attack.replace(':', '')}-{rule}"
                jobs.append((label, base, {"attack": attack, "attackers": who,
                                           **rule_settings(rule)},
                             {"attack": attack, "aggregator": rule, "malicious": count,
                              "workers": workers, "attackers": who}))
    if in_process:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max(1, parallel)) as pool:
            trained = list(pool.map(_in_process, *zip(*[(j[0], j[1], j[2]) for j in jobs])))
    else:
        trained = [run_variant(label, base, out, reuse=reuse, **o) for label, base, o, _ in jobs]
    rows = []
    for (label, _, _, fields), row in zip(jobs, trained):
        attackers = fields.pop("attackers")
        row.update(fields)
        if in_process and (attackers or row.get("rating_curves") or row.get("ratings")):
            row.update(_judged(row, {f"w{a}" for a in attackers.split(",") if a}))
        rows.append(row)
    for r in rows:
        clean = next(c for c in rows if c["attack"] == "none" and c["workers"] == r["workers"]
                     and c["aggregator"] == "mean")
        if r["final_heldout_loss"] and clean["final_heldout_loss"]:
            r["loss_vs_clean"] = r["final_heldout_loss"] / clean["final_heldout_loss"] - 1
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    cleans = {r["workers"]: r for r in rows if r["attack"] == "none" and r["aggregator"] == "mean"}
    for r in rows:
        if r["attack"] == "none" and not r.get("malicious") and r["aggregator"] == "mean":
            continue
        title = f"{r['malicious']} of {r['workers']}: {r['attack']}"
        panel = panels.setdefault(title, {"clean": _curve(cleans[r["workers"]])})
        panel[r["aggregator"]] = _curve(r)
    write_json(out / "attack.json", "attack",
               [{k: v for k, v in r.items() if k not in ("per_worker", "ledgers")} for r in rows],
               {"emulation": "attackers rewrite their own update before encoding; ALIE, IPM "
                             "and copycat learn from the updates they received last round",
                "workers": "threads of one process" if in_process else "processes",
                "load_average_at_end": list(os.getloadavg()), "model": model,
                "steps": steps, "inner_steps": inner_steps})
    plot_panels(out / "attack_loss_vs_tokens.png", panels, "tokens (evaluating worker)",
                "held-out loss (log)", columns=max(1, len(attacks)), logy=True)
    rated = [r for r in rows if r.get("rating_curves")]
    if rated:
        plot_ratings(out / "attack_ratings.png", rated)
    return {"rows": rows}


def _in_process(label: str, base: dict, overrides: dict) -> dict:
    """One variant with its workers as threads (see the module doc)."""
    import logging

    logging.basicConfig(level=logging.ERROR)  # each discounted update is logged per member
    from farlink.bench.inprocess import train_in_process
    from farlink.compose import build_exchange
    from farlink.config import load_config
    from farlink.robust.ledger import ContributionLedger

    values = {**base, **overrides}

    def exchange(collective, rank, cfg, **parts):  # noqa: ANN001, ANN003, ANN202
        # path: every peer's update judged on its own, as in the process runs
        return build_exchange(cfg, collective, f"w{rank}", rank, ContributionLedger(),
                              path="gathered", **parts)

    cfg = load_config(None, values)
    row = train_in_process(label, values, eval_points=4, exchange_factory=exchange)
    row["aggregator_used"], row["score"] = cfg.aggregator, cfg.score
    print(f"{label}: held-out loss {row['final_heldout_loss']:.4f}, {row['wall_s']:.0f} s",
          flush=True)
    return row


def _judged(row: dict, attackers: set[str]) -> dict:
    """What the honest worker 0's ledger and ratings show about honest and attacking peers:
    tokens credited, discounted updates, rating curves, and the first round from which every
    honest rating stays above every attacker's."""
    ledger = (row.get("ledgers") or [None])[0] or {"peers": {}}
    peers = ledger["peers"]
    credited = {p: r.get("tokens_credited", 0.0) for p, r in peers.items()}
    curves: dict[str, list[tuple[int, float]]] = {}
    for round_id, ratings in row.get("ratings", []):
        for peer, rating in ratings.items():
            curves.setdefault(peer, []).append((round_id, rating))
    separated = None
    rounds = [r for r, _ in row.get("ratings", [])]
    for i, round_id in enumerate(rounds):
        later = row["ratings"][i:]
        if all(min((v for p, v in rs.items() if p not in attackers), default=1)
               > max((v for p, v in rs.items() if p in attackers), default=-2)
               for _, rs in later):
            separated = i
            break
    threshold = row.get("config", {}).get("score_threshold", 0.25)
    caught = next((r for r, rs in row.get("ratings", [])
                   if max((v for p, v in rs.items() if p in attackers), default=1) < threshold),
                  None)
    return {"credited": credited,
            "attacker_credited": sum(v for p, v in credited.items() if p in attackers),
            **_rates(peers, attackers), "first_round_discounted": caught,
            "discounted": {p: r.get("rejections", {}) for p, r in peers.items()
                           if r.get("rejections")},
            "marks": {p: r.get("marks", {}) for p, r in peers.items() if r.get("marks")},
            "rating_curves": curves, "rounds_to_separate": separated,
            "attackers": sorted(attackers)}


def _rates(peers: dict, attackers: set[str]) -> dict:
    """From a ledger's records: the share of the attackers' rounds in which they were left out
    or credited nothing, and the share of the honest peers' rounds in which they were left out
    (false rejects; the bench turns the norm screen off, so every rejection is the scorer's)."""
    def left_out(record: dict) -> int:  # rejected (score or mark), or accepted but marked
        return record.get("updates_rejected", 0) + sum(record.get("marks", {}).values())

    def share(group: list[dict]) -> float | None:
        rounds = sum(r.get("rounds", 0) for r in group)
        return sum(left_out(r) for r in group) / rounds if rounds else None

    return {"attacker_discount_rate": share([r for p, r in peers.items() if p in attackers]),
            "honest_false_reject_rate": share([r for p, r in peers.items()
                                               if p not in attackers])}


def plot_ratings(path: Path, rows: list[dict]) -> Path:
    """Honest (blue) and attacker (red) ratings over rounds, one panel per rated run."""
    from farlink.bench.report import pyplot, save_figure

    plt = pyplot()
    columns = 4
    lines = math.ceil(len(rows) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4 * columns, 2.8 * lines), squeeze=False)
    for ax, row in zip(axes.flat, rows):
        for peer, curve in sorted(row["rating_curves"].items()):
            bad = peer in row["attackers"]
            ax.plot([r for r, _ in curve], [v for _, v in curve],
                    color="tab:red" if bad else "tab:blue", alpha=0.8,
                    label="attacker" if bad else "honest")
        ax.set_title(f"{row['malicious']}/{row['workers']} {row['attack']} ({row['aggregator']})",
                     fontsize=8)
        ax.set_ylim(-1.1, 1.1)
        ax.axhline(0.25, color="gray", lw=0.5, ls="--")
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    fig.legend(unique.values(), unique.keys(), loc="upper right")
    fig.supxlabel("round")
    fig.supylabel("rating (agreed)")
    return save_figure(fig, path)


def plot_targets(path: Path, rows: list[dict]) -> Path:
    """The targets of loss scoring in one figure: held-out loss against the clean run per
    attack and rule (one bar group per setup, the 5% target dashed), then the honest (blue)
    and attacker (red) ratings over rounds of every scored run."""
    from farlink.bench.report import pyplot, save_figure

    plt = pyplot()
    rated = [r for r in rows if r.get("rating_curves")]
    setups = sorted({(r["workers"], r["malicious"]) for r in rows if r["malicious"]})
    columns = 4
    lines = 1 + math.ceil(len(rated) / columns)
    fig = plt.figure(figsize=(4 * columns, 3.2 * lines))
    grid = fig.add_gridspec(lines, columns)
    for i, (workers, bad) in enumerate(setups[:2]):
        ax = fig.add_subplot(grid[0, 2 * i: 2 * i + 2])
        mine = [r for r in rows if r["workers"] == workers
                and (r["malicious"] == bad or r["attack"] == "none")
                and r.get("loss_vs_clean") is not None and r["aggregator"] != "mean"]
        rules = sorted({r["aggregator"] for r in mine})
        attacks = list(dict.fromkeys(r["attack"] for r in mine))
        width = 0.8 / max(1, len(rules))
        for j, rule in enumerate(rules):
            by = {r["attack"]: r["loss_vs_clean"] * 100 for r in mine if r["aggregator"] == rule}
            ax.bar([k + (j - (len(rules) - 1) / 2) * width for k in range(len(attacks))],
                   [by.get(a, 0.0) for a in attacks], width * 0.9, label=rule)
        ax.axhline(5, color="black", ls="--", lw=0.8)
        ax.axhline(-5, color="black", ls="--", lw=0.8)
        ax.set_xticks(range(len(attacks)), attacks, fontsize=7, rotation=20)
        ax.set_ylabel("held-out vs clean (%)")
        ax.set_title(f"{bad} of {workers} attackers", fontsize=9)
        ax.legend(fontsize=7)
    for k, row in enumerate(rated):
        ax = fig.add_subplot(grid[1 + k // columns, k % columns])
        for peer, curve in sorted(row["rating_curves"].items()):
            bad = peer in row.get("attackers", [])
            ax.plot([r for r, _ in curve], [v for _, v in curve],
                    color="tab:red" if bad else "tab:blue", alpha=0.8)
        ax.set_title(f"{row['malicious']}/{row['workers']} {row['attack']} "
                     f"({row['aggregator']})", fontsize=8)
        ax.set_ylim(-1.1, 1.1)
        ax.axhline(0.25, color="gray", lw=0.5, ls="--")
        ax.set_xlabel("round (red: attackers, blue: honest)", fontsize=7)
    return save_figure(fig, path)


def _curve(row: dict) -> list[tuple[float, float]]:
    return [(e["tokens"], e["loss"]) for e in row["evals"]]


# --- protocol attacks: a hostile member (farlink.robust.hostile) ---------------------------------
#: every protocol attack the matrix runs by default (farlink.robust.hostile)
PROTOCOL_ATTACKS = ["round_inflation", "round_inflation:nan", "weight_inflation",
                    "weight_inflation:1e39", "slot_forging", "equivocation", "bad_metadata",
                    "always_no"]
#: a run whose honest held-out loss is within this of the clean run's is bounded
BOUND = 0.05
#: words of a log line that turns a peer away (a refusal names the peer it refuses)
REFUSAL_WORDS = ("reject", "refus", "exclud", "distrust", "ignor", "suspect", "hostile",
                 "equivocat", "forged", "malformed", "implausible", "not finite", "nonfinite")


def verdict(row: dict) -> str:
    """``refused``: the attacker is named and the honest replicas ended on one finite state;
    ``bounded``: the honest replicas ended on one finite state whose held-out loss is within
    :data:`BOUND` of the clean run's; otherwise ``FAILED`` (``n/a`` where the attack has no
    surface on the backend). An honest worker that crashed fails the row whatever else holds."""
    if row.get("not_applicable"):
        return "n/a"
    sound = (row.get("honest_ok") and row.get("consistent") and not row.get("nonfinite_files")
             and row.get("heldout_loss") is not None and math.isfinite(row["heldout_loss"]))
    if not sound:
        return "FAILED"
    if row.get("attacker_named"):
        return "refused"
    gap = row.get("loss_vs_clean")
    return "bounded" if gap is not None and gap <= BOUND else "FAILED"


def run_protocol(out: Path, attacks: list[str], backends: list[str], workers: int, bad: int,
                 steps: int, inner_steps: int, rule: str, reuse: bool = False,
                 **settings) -> dict:
    """Clean run and one run per protocol attack on each backend (``bad`` of ``workers`` are
    the hostile member), each judged by :func:`verdict`; ``attack_protocol.json`` and
    ``attack_protocol.png`` in ``out``. ``settings``: further run settings (a cache dir)."""
    from farlink.robust import hostile

    rows: list[dict] = []
    attackers = [workers - 1 - i for i in range(bad)]
    for backend in backends:
        base = {"workers": workers, "steps": steps, "inner_steps": inner_steps, "codec": "int8",
                "auth": "secret", "secret": "bench", "aggregator": rule, "backend": backend,
                "eval_batches": 4, "round_timeout": 20.0, "quorum_timeout": 60.0,
                "join_timeout": 5.0, "warmup_steps": steps // 4,
                # the honest members can go on without the hostile one once they exclude it
                "min_replicas": workers - bad, **settings}
        clean = protocol_row(run_variant(f"{backend}-clean", base, out, reuse=reuse), out,
                             f"{backend}-clean", "none", backend, rule, attackers=[])
        clean["verdict"] = "clean"
        rows.append(clean)
        for attack in attacks:
            label = f"{backend}-{attack.replace(':', '')}"
            why = hostile.not_applicable(attack, backend)
            if why is not None:
                rows.append({"label": label, "attack": attack, "backend": backend, "rule": rule,
                             "not_applicable": f"not applicable on {backend}: {why}",
                             "verdict": "n/a"})
                continue
            run = run_variant(label, base, out, reuse=reuse, attack=attack,
                              attackers=",".join(map(str, attackers)))
            row = protocol_row(run, out, label, attack, backend, rule, attackers)
            if row["heldout_loss"] is not None and clean["heldout_loss"]:
                row["loss_vs_clean"] = row["heldout_loss"] / clean["heldout_loss"] - 1
            row["verdict"] = verdict(row)
            rows.append(row)
    write_json(out / "attack_protocol.json", "attack_protocol", rows,
               {"emulation": "a hostile member built from farlink's own collective and "
                             "exchange (farlink.robust.hostile)",
                "verdicts": {"refused": "attacker named, honest replicas consistent and finite",
                             "bounded": f"honest held-out loss within {BOUND:.0%} of clean, "
                                        "consistent, finite",
                             "FAILED": "neither"}})
    plot_verdicts(out / "attack_protocol.png", rows)
    return {"rows": rows}


def protocol_row(run: dict, out: Path, label: str, attack: str, backend: str, rule: str,
                 attackers: list[int]) -> dict:
    """What one run of the protocol matrix shows about its honest workers (see :func:`verdict`)."""
    from farlink.train.metrics import read_metrics

    run_dir = out / "runs" / label
    bad = {f"w{i}" for i in attackers}
    honest = [f"w{i}" for i in range(run["workers"]) if f"w{i}" not in bad]
    ends = {}
    for name in honest:
        records = read_metrics(run_dir / "metrics" / f"{name}.jsonl")
        done = [r for r in records if r["kind"] == "end" and r.get("fingerprint")]
        if done:
            ends[name] = (done[-1].get("outer_step"), done[-1]["fingerprint"])
    codes = list(run["returncodes"])
    honest_codes = [codes[int(n[1:])] for n in honest if int(n[1:]) < len(codes)]
    losses, digests = final_losses(run_dir, honest)
    worst = max(losses.values()) if losses and len(losses) == len(honest) else None
    return {
        "label": label, "attack": attack, "backend": backend, "rule": rule,
        "attackers": sorted(bad), "returncodes": codes,
        "honest_ok": all(c == 0 for c in honest_codes) and len(ends) == len(honest),
        "heldout_loss": worst,  # the worst honest worker's final model's held-out loss
        "honest_losses": losses,
        # one committed state (end fingerprints) and one final model among the honest workers
        "consistent": (len(set(ends.values())) == 1 and len(ends) == len(honest)
                       and len(set(digests.values())) == 1 and len(digests) == len(honest)),
        "final_states": ends,
        "nonfinite_files": nonfinite_files(run_dir, bad),
        "attacker_named": named_where(run_dir, bad, honest) if bad else [],
        "evals": run["evals"],
    }


def final_losses(run_dir: Path, workers: list[str]) -> tuple[dict[str, float], dict[str, str]]:
    """Held-out loss and a digest of each of ``workers``' final models (``final/wI.safetensors``),
    on the run's own held-out batches: every honest worker is judged, not only those that
    happened to evaluate (a round's rank 0). A worker without a final model is left out."""
    import json

    from farlink.sync.digest import state_digest

    from safetensors.torch import load_model

    from farlink.config import RunConfig
    from farlink.data import evaluate, heldout_batches, prepare_data
    from farlink.model.build import MODEL_FILE, model_from_description

    finals = {w: run_dir / "final" / f"{w}.safetensors" for w in workers}
    finals = {w: p for w, p in finals.items() if p.is_file()}
    if not finals:
        return {}, {}
    cfg = RunConfig.model_validate_json((run_dir / "config.json").read_text())
    data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir,
                        tokenizer=cfg.given_tokenizer)
    batches = heldout_batches(data.heldout, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    description = json.loads((run_dir / MODEL_FILE).read_text())
    losses, digests = {}, {}
    for worker, path in finals.items():
        model = model_from_description(description)
        load_model(model, str(path))
        losses[worker] = evaluate(model.eval(), batches)
        digests[worker] = state_digest(model.state_dict()).hex()[:16]
    return losses, digests


def nonfinite_files(run_dir: Path, skip: set[str]) -> list[str]:
    """The run's tensor files (result, finals, checkpoints) holding NaN or Inf, except the
    attackers' own (``skip``: their worker names)."""
    from safetensors.torch import load_file

    bad = []
    for path in sorted(run_dir.rglob("*.safetensors")):
        if skip & ({path.stem} | set(path.parts)):
            continue
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - a torn file is reported, not fatal
            bad.append(f"{path.relative_to(run_dir)} (unreadable: {exc})")
            continue
        if any(t.is_floating_point() and not bool(t.isfinite().all()) for t in tensors.values()):
            bad.append(str(path.relative_to(run_dir)))
    return bad


def attacker_names(run_dir: Path, attackers: set[str]) -> set[str]:
    """Every name an attacker goes by (worker name, sender, libp2p peer id), from the line
    :func:`farlink.robust.hostile.arm` logs in its own log."""
    from farlink.robust.hostile import HOSTILE_TAG

    names = set(attackers)
    for worker in attackers:
        path = run_dir / "logs" / f"{worker}.log"
        text = path.read_text(errors="replace") if path.is_file() else ""
        for line in text.splitlines():
            if HOSTILE_TAG in line and "(names: " in line:
                names |= {n.strip() for n in line.split("(names: ", 1)[1].rstrip(")").split(",")}
    return {n for n in names if n}


def named_where(run_dir: Path, attackers: set[str], honest: list[str]) -> list[str]:
    """Where the honest side named an attacker: an honest ledger's rejection of it, or a line
    of an honest worker's (or the Lighthouse's) log that turns it away."""
    import json

    names = attacker_names(run_dir, attackers)
    where = []
    for worker in honest:
        path = run_dir / "ledger" / f"{worker}.json"
        try:
            peers = json.loads(path.read_text()).get("peers", {}) if path.is_file() else {}
        except ValueError:
            peers = {}
        for peer, record in peers.items():
            if peer in names and record.get("updates_rejected"):
                where.append(f"ledger/{worker}.json: {peer} rejected {record['rejections']}")
    logs = [run_dir / "logs" / f"{w}.log" for w in honest] + [run_dir / "lighthouse.log"]
    for path in logs:
        text = path.read_text(errors="replace") if path.is_file() else ""
        for line in text.splitlines():
            low = line.lower()
            if any(w in low for w in REFUSAL_WORDS) and any(n in line for n in names):
                where.append(f"{path.name}: {line.strip()[:200]}")
                break
    return where


def plot_verdicts(path: Path, rows: list[dict]) -> Path:
    """Bars of honest held-out loss vs clean per attack (symlog), one per backend, each
    labelled with its verdict (a missing or non-finite loss is drawn at the top, hatched)."""
    from farlink.bench.report import pyplot, save_figure

    plt = pyplot()
    backends = sorted({r["backend"] for r in rows})
    attacks = [a for a in dict.fromkeys(r["attack"] for r in rows) if a != "none"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(attacks) * len(backends)), 4.5))
    width = 0.8 / max(1, len(backends))
    finite = [r["loss_vs_clean"] for r in rows
              if r.get("loss_vs_clean") is not None and math.isfinite(r["loss_vs_clean"])]
    top = max([0.1, *finite]) * 2  # where a missing (crashed, NaN) loss is drawn
    colors = {"refused": "tab:green", "bounded": "tab:blue", "FAILED": "tab:red",
              "n/a": "lightgray"}
    for b, backend in enumerate(backends):
        by_attack = {r["attack"]: r for r in rows if r["backend"] == backend}
        for i, attack in enumerate(attacks):
            row = by_attack.get(attack)
            if row is None:
                continue
            gap = row.get("loss_vs_clean")
            missing = gap is None or not math.isfinite(gap)
            height = 0.0 if row["verdict"] == "n/a" else (top if missing else gap)
            x = i + (b - (len(backends) - 1) / 2) * width
            ax.bar(x, height, width * 0.9, color=colors.get(row["verdict"], "gray"),
                   hatch="//" if missing and row["verdict"] != "n/a" else None)
            ax.text(x, max(height, 0), f"{backend}\n{row['verdict']}",
                    ha="center", va="bottom", fontsize=6, rotation=90)
    ax.axhline(BOUND, color="black", linestyle="--", linewidth=0.8, label=f"bound ({BOUND:.0%})")
    ax.set_xticks(range(len(attacks)), attacks, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("honest held-out loss vs clean (fraction)")
    ax.set_yscale("symlog", linthresh=BOUND)  # a 5% gap and a 100x one on one axis
    ax.set_ylim(min([0.0, *finite]) * 1.5 - 0.01, top * 8)
    ax.set_title("protocol attacks: green refused, blue bounded, red FAILED, gray n/a")
    ax.legend(fontsize=7)
    return save_figure(fig, path)
