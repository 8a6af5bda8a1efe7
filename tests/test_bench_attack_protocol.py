"""``farlink bench attack --protocol``: the verdict of each run, what it reads from a run dir, and
one protocol attack end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from farlink.bench.attack import (BOUND, attacker_names, named_where, nonfinite_files,
                                  plot_verdicts, run_protocol, verdict)
from farlink.robust.hostile import HOSTILE_TAG

SOUND = {"honest_ok": True, "consistent": True, "nonfinite_files": [], "heldout_loss": 6.6}


@pytest.mark.parametrize(("row", "expected"), [
    ({**SOUND, "attacker_named": ["ledger/w0.json"], "loss_vs_clean": 0.3}, "refused"),
    ({**SOUND, "attacker_named": [], "loss_vs_clean": BOUND / 2}, "bounded"),
    ({**SOUND, "attacker_named": [], "loss_vs_clean": -0.01}, "bounded"),
    ({**SOUND, "attacker_named": [], "loss_vs_clean": BOUND * 3}, "FAILED"),
    ({**SOUND, "consistent": False, "attacker_named": ["x"], "loss_vs_clean": 0.0}, "FAILED"),
    ({**SOUND, "nonfinite_files": ["final/w0.safetensors"], "attacker_named": ["x"],
      "loss_vs_clean": 0.0}, "FAILED"),
    ({**SOUND, "heldout_loss": float("nan"), "attacker_named": ["x"]}, "FAILED"),
    ({**SOUND, "heldout_loss": None, "attacker_named": ["x"]}, "FAILED"),
    ({**SOUND, "honest_ok": False, "attacker_named": ["x"], "loss_vs_clean": 0.0}, "FAILED"),
    ({"not_applicable": "not applicable on torchft: ..."}, "n/a"),
])
def test_verdicts(row: dict, expected: str) -> None:
    assert verdict(row) == expected


def test_the_plot_draws_rows_without_any_finite_loss(tmp_path: Path) -> None:
    rows = [{"attack": "none", "backend": "torchft", "verdict": "clean"},
            {"attack": "round_inflation:nan", "backend": "torchft", "verdict": "FAILED",
             "loss_vs_clean": None},
            {"attack": "slot_forging", "backend": "torchft", "verdict": "n/a"}]
    assert plot_verdicts(tmp_path / "p.png", rows).stat().st_size > 0


def test_a_run_dir_tells_nonfinite_files_and_where_the_attacker_was_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for sub in ("final", "checkpoints/w0", "checkpoints/w2", "logs", "ledger"):
        (run / sub).mkdir(parents=True)
    save_file({"w": torch.ones(3)}, str(run / "final" / "w0.safetensors"))
    save_file({"w": torch.tensor([1.0, float("nan")])}, str(run / "final" / "w1.safetensors"))
    save_file({"w": torch.tensor([float("inf")])}, str(run / "checkpoints/w0/state.safetensors"))
    save_file({"w": torch.tensor([float("nan")])}, str(run / "checkpoints/w2/state.safetensors"))
    save_file({"w": torch.tensor([float("nan")])}, str(run / "final" / "w2.safetensors"))
    assert nonfinite_files(run, {"w2"}) == ["checkpoints/w0/state.safetensors",
                                            "final/w1.safetensors"]

    (run / "logs" / "w2.log").write_text(
        f"WARNING {HOSTILE_TAG}: w2 runs slot_forging (names: w2, w2, 12D3KooWAbc)\n")
    assert attacker_names(run, {"w2"}) == {"w2", "12D3KooWAbc"}
    (run / "logs" / "w0.log").write_text("healed to round 3 from 12D3KooWAbc\n")
    assert named_where(run, {"w2"}, ["w0", "w1"]) == []  # a heal names it but refuses nothing
    (run / "logs" / "w1.log").write_text("round 3: excluded 12D3KooWAbc for 5 rounds\n")
    (run / "ledger" / "w0.json").write_text(json.dumps({"version": 1, "peers": {
        "w2": {"updates_rejected": 2, "rejections": {"norm": 2}},
        "w1": {"updates_rejected": 1, "rejections": {"stale": 1}}}}))
    where = named_where(run, {"w2"}, ["w0", "w1"])
    assert where == ["ledger/w0.json: w2 rejected {'norm': 2}",
                     "w1.log: round 3: excluded 12D3KooWAbc for 5 rounds"]


@pytest.mark.slow  # two short training runs of three workers, about a minute
def test_one_protocol_attack_end_to_end(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "bench"
    result = run_protocol(out, ["weight_inflation:1e39", "slot_forging"], ["torchft"], 3, 1,
                          6, 3, "mean", cache_dir=cache_dir)
    clean, attacked, skipped = result["rows"]
    assert clean["verdict"] == "clean" and clean["consistent"] and clean["honest_ok"]
    assert attacked["attack"] == "weight_inflation:1e39" and attacked["verdict"] in (
        "refused", "bounded", "FAILED")
    assert attacked["verdict"] == verdict(attacked)
    assert skipped["verdict"] == "n/a" and "Gloo" in skipped["not_applicable"]
    doc = json.loads((out / "attack_protocol.json").read_text())
    assert [r["verdict"] for r in doc["rows"]] == [r["verdict"] for r in result["rows"]]
    assert (out / "attack_protocol.png").stat().st_size > 0
