"""``farlink bench attack``: clean vs attacked runs, plain mean vs each robust rule.

Attacks are emulated (the attacker's worker rewrites its own pseudo-gradient before encoding:
sign flip, x100, Gaussian noise, free rider). Every run uses the gathered exchange path (int8
codec, run secret) so each peer's update is seen and judged individually. The norm screen is
turned off here so the aggregation rules, not the screen, are what is compared.
"""

from __future__ import annotations

from pathlib import Path

from farlink.bench.report import plot_panels, write_json
from farlink.bench.runner import run_variant

RULES = ["mean", "median", "trimmed_mean", "centered_clip", "norm_bounded"]


def run(out: Path, attacks: list[str], setups: list[tuple[int, int]], steps: int,
        inner_steps: int, rules: list[str], reuse: bool = False) -> dict:
    rows = []
    for workers, bad in setups:
        base = {"workers": workers, "steps": steps, "inner_steps": inner_steps,
                "codec": "int8", "auth": "secret", "secret": "bench", "screen_ratio": 0,
                "eval_batches": 8}
        attackers = ",".join(str(workers - 1 - i) for i in range(bad))
        clean = run_variant(f"{workers}w-clean", base, out, reuse=reuse)
        clean["attack"], clean["aggregator"], clean["malicious"] = "none", "mean", 0
        rows.append(clean)
        for attack in attacks:
            for rule in rules:
                label = f"{workers}w-{bad}bad-{attack.replace(':', '')}-{rule}"
                row = run_variant(label, base, out, reuse=reuse, attack=attack,
                                  attackers=attackers, aggregator=rule)
                row["attack"], row["aggregator"], row["malicious"] = attack, rule, bad
                rows.append(row)
        for r in rows:
            if r["workers"] == workers and r["final_heldout_loss"] and clean["final_heldout_loss"]:
                r["loss_vs_clean"] = r["final_heldout_loss"] / clean["final_heldout_loss"] - 1
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    cleans = {r["workers"]: r for r in rows if r["attack"] == "none"}
    for r in rows:
        if r["attack"] == "none":
            continue
        title = f"{r['malicious']} of {r['workers']}: {r['attack']}"
        panel = panels.setdefault(title, {"clean": _curve(cleans[r["workers"]])})
        panel[r["aggregator"]] = _curve(r)
    write_json(out / "attack.json", "attack", [{k: v for k, v in r.items() if k != "per_worker"}
                                              for r in rows],
               {"emulation": "attackers rewrite their own update before encoding"})
    plot_panels(out / "attack_loss_vs_tokens.png", panels, "tokens (evaluating worker)",
                "held-out loss (log)", columns=max(1, len(attacks)), logy=True)
    return {"rows": rows}


def _curve(row: dict) -> list[tuple[float, float]]:
    return [(e["tokens"], e["loss"]) for e in row["evals"]]
