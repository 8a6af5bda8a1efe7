"""``bench frontier`` at a toy size: every method trained for real (in-process workers), bytes
per token as the other benches count them, the sweep recorded and used, the Pareto front by hand,
and ``--reuse`` reading finished runs back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farlink.bench.frontier import (
    Family,
    Method,
    ablations,
    edge_extensions,
    equal_tokens,
    families,
    grid,
    methods,
    pareto_front,
    run,
    targets,
)
from farlink.bench.inprocess import train_in_process
from farlink.comm.base import ring_allreduce_bytes
from farlink.model import preset_config

STEPS, SWEEP_STEPS, H, WORKERS, BATCH, SEQ = 4, 2, 2, 2, 2, 16


def toy_families() -> list[Family]:
    """The default families with one lr point each, except DDP's two (a choice to check, and
    an edge to extend: with two points the best is always on one). The small-batch DDP row
    steps on 1 sequence per worker, half the toy batch: twice the steps, the same tokens."""
    out = []
    for fam in families(H, small_batch=BATCH // 2):
        points = fam.grid[:2] if fam.name == "ddp" else fam.grid[:1]
        out.append(Family(fam.name, fam.base, points))
    return out


def toy_base(cache_dir: Path, model: str = "nano") -> dict:
    """The toy runs' settings: a few steps of tiny batches on a 300-token vocabulary."""
    return {"model": model, "workers": WORKERS, "steps": STEPS, "batch_size": BATCH,
            "seq_len": SEQ, "warmup_steps": 1, "eval_batches": 2, "vocab_size": 300,
            "cache_dir": cache_dir}


def recording(calls: list[str]):  # noqa: ANN201
    """The bench's in-process trainer, noting each run's label in ``calls``."""
    def train(label: str, values: dict, eval_points: int) -> dict:
        calls.append(label)
        return train_in_process(label, values, eval_points=eval_points)
    return train


def test_pareto_front_on_hand_made_points() -> None:
    points = [(100.0, 3.0),   # cheapest loss: on the front
              (10.0, 3.5),    # on the front
              (10.0, 3.6),    # same bytes as the one above, worse loss: dominated
              (50.0, 3.5),    # more bytes, same loss as (10, 3.5): dominated
              (1.0, 4.0),     # cheapest: on the front
              (200.0, 3.0),   # same loss as (100, 3.0), more bytes: dominated
              (5.0, 5.0)]     # dominated by (1, 4)
    assert pareto_front(points) == [True, True, False, False, True, False, False]
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [True, True]  # ties dominate neither


def test_targets_on_hand_made_rows() -> None:
    def row(label: str, bpt: float, loss: float) -> dict:
        return {"label": label, "bytes_per_token": bpt, "final_heldout_loss": loss,
                "bytes_per_token_reduction_vs_ddp": 8000 / bpt, "loss_vs_ddp": loss / 4.0 - 1}

    rows = [row("ddp", 8000, 4.0), row("diloco-fp32", 800, 4.1), row("diloco-int8", 200, 4.1),
            row("sparseloco-k64", 8, 4.05), row("sparseloco-k32", 4, 4.3)]
    got = targets(rows)
    first = got["reduction_within_2pct_of_ddp"]
    assert first["met"] and first["best_within_tolerance"]["label"] == "sparseloco-k64"
    assert first["most_reduction"]["label"] == "sparseloco-k32"
    second = got["sparseloco_vs_diloco"]
    assert second["met"]
    assert [(c["label"], c["met"]) for c in second["candidates"]] == [
        ("sparseloco-k64", True), ("sparseloco-k32", False)]  # k32: loss above DiLoCo's
    # a second DDP row is a baseline, not a candidate, however close to DDP it lands
    with_small = [*rows, row("ddp-small-batch", 16000, 3.9)]
    assert targets(with_small)["reduction_within_2pct_of_ddp"] == first
    rows[3] = row("sparseloco-k64", 30, 4.05)  # 6.7x fewer than int8: short of 10x
    assert not targets(rows)["sparseloco_vs_diloco"]["met"]
    assert not targets(rows)["reduction_within_2pct_of_ddp"]["met"]  # 267x


def test_frontier_toy_run_has_every_method_exact_bytes_and_the_sweep(
        tmp_path: Path, cache_dir: Path) -> None:
    calls: list[str] = []
    train = recording(calls)
    base = toy_base(cache_dir)
    result = run(tmp_path, base, SWEEP_STEPS, H, family_list=toy_families(), train=train,
                 max_extensions=1)
    doc = json.loads((tmp_path / "frontier.json").read_text())
    assert (tmp_path / "frontier.png").stat().st_size > 0

    assert [r["label"] for r in doc["rows"]] == [m.label for m in methods()]
    assert {r["config"]["algorithm"] for r in doc["rows"]} == {
        "ddp", "diloco", "streaming_diloco", "sparseloco", "demo"}
    by_label = {r["label"]: r for r in doc["rows"]}
    small = by_label["ddp-small-batch"]["config"]
    assert (small["batch_size"], small["steps"], small["warmup_steps"]) == (BATCH // 2, 2 * STEPS, 2)
    tokens = STEPS * BATCH * SEQ
    for r in doc["rows"]:  # the same tokens for all, bytes per token as bench probe counts them
        assert r["tokens_per_worker"] == tokens
        assert r["bytes_per_token"] == r["bytes_per_worker"] / tokens
    ddp = by_label["ddp"]
    # DDP all-reduces the gradients plus the token weight in fp32 every step
    assert ddp["bytes_per_worker"] == STEPS * ring_allreduce_bytes(4 * (ddp["params"] + 1), WORKERS)
    assert by_label["diloco-fp32"]["bytes_per_token_reduction_vs_ddp"] == pytest.approx(H, rel=0.01)
    assert (by_label["sparseloco-k32"]["bytes_per_token"]
            < by_label["sparseloco-k64"]["bytes_per_token"])
    assert by_label["sparseloco-k32"]["config"]["sparseloco_topk"] == 32

    # the sweep: every point recorded with its loss, the best used by every method of the family
    sweep = doc["sweep"]
    assert set(sweep) == {"ddp", "ddp-small-batch", "diloco", "sparseloco",
                          "sparseloco-authors", "demo"}
    authors, muon = by_label["sparseloco-authors-k64"], by_label["diloco-muon"]
    assert authors["config"]["sparseloco_variant"] == "authors"
    assert authors["lrs_from_sweep"] == sweep["sparseloco-authors"]["best"]
    assert muon["config"]["inner"] == "muon" and muon["lrs_from_sweep"] == sweep["diloco"]["best"]
    assert by_label["sparseloco-muon-k64"]["config"]["inner"] == "muon"
    assert by_label["diloco-eager"]["config"]["outer_overlap"] == "eager"
    assert by_label["diloco-delayed"]["lrs_from_sweep"] == sweep["diloco"]["best"]
    points = sweep["ddp"]["points"]
    # two points: the better is on an edge, so one more step outwards was tried (one round)
    first_best = min(points[:2], key=lambda p: p["final_heldout_loss"])["lr"]
    outward = 1e-3 * 1e-3 / 3e-3 if first_best == 1e-3 else 3e-3 * 3e-3 / 1e-3
    assert [p["lr"] for p in points] == [1e-3, 3e-3, pytest.approx(outward, rel=1e-3)]
    assert [p["lr"] for p in sweep["ddp"]["extended"]] == [points[2]["lr"]]
    assert sweep["ddp"]["extended"][0]["because_best_was_on_edge"] == {"lr": first_best}
    best = min(points, key=lambda p: p["final_heldout_loss"])
    assert sweep["ddp"]["best"] == {"lr": best["lr"]} and ddp["config"]["lr"] == best["lr"]
    assert sweep["ddp"]["steps"] == SWEEP_STEPS
    assert sweep["ddp-small-batch"]["steps"] == 2 * SWEEP_STEPS
    assert sweep["diloco"]["extended"] == [] and sweep["diloco"]["edge_left_untried"] == []
    for label in ("diloco-int8", "streaming-diloco-int4"):
        assert by_label[label]["lrs_from_sweep"] == sweep["diloco"]["best"]
        assert by_label[label]["config"]["outer_lr"] == sweep["diloco"]["best"]["outer_lr"]
    assert [r["pareto"] for r in doc["rows"]] == pareto_front(
        [(r["bytes_per_token"], r["final_heldout_loss"]) for r in doc["rows"]])
    assert set(doc["targets"]) == {"reduction_within_2pct_of_ddp", "sparseloco_vs_diloco"}
    assert result["rows"][0]["label"] == "ddp"

    # --reuse: nothing is trained again, the table is the same
    trained = len(calls)
    assert trained == 8 + len(methods())  # ddp 3 (one extension), 5 other families 1 each
    again = run(tmp_path, base, SWEEP_STEPS, H, family_list=toy_families(), reuse=True,
                train=train, plot=False, max_extensions=1)
    assert len(calls) == trained
    assert [r["final_heldout_loss"] for r in again["rows"]] == [
        r["final_heldout_loss"] for r in doc["rows"]]
    # ablations afterwards: only they are trained, at the family's swept lrs, off the frontier
    with_ablations = run(tmp_path, base, SWEEP_STEPS, H, family_list=toy_families(), reuse=True,
                         train=train, plot=False, ablation_list=ablations(H), max_extensions=1)
    assert calls[trained:] == [m.label for m in ablations(H)] == [
        "diloco-fp32-H1", "diloco-fp32-H4", "local-sgd-averaging", "one-worker"]
    extra = {r["label"]: r for r in with_ablations["ablations"]}
    assert extra["diloco-fp32-H1"]["config"]["inner_steps"] == 1
    assert extra["diloco-fp32-H4"]["config"]["inner_steps"] == 4
    assert extra["local-sgd-averaging"]["config"]["algorithm"] == "local_sgd"
    assert extra["one-worker"]["bytes_per_worker"] == 0
    assert extra["one-worker"]["config"]["lr"] == sweep["ddp"]["best"]["lr"]
    assert all("loss_vs_ddp" in r for r in extra.values())
    assert [r["label"] for r in with_ablations["rows"]] == [m.label for m in methods()]
    trained = len(calls)
    # a changed budget is trained again (its old file does not match)
    run(tmp_path, {**base, "steps": STEPS + 1}, SWEEP_STEPS, H, family_list=toy_families(),
        only=["ddp"], reuse=True, train=train, plot=False, max_extensions=1)
    assert calls[trained:] == ["ddp"]


def test_edge_extensions_step_outwards_only_from_an_edge() -> None:
    tried = [{"lr": a, "outer_lr": b} for a in (3e-3, 1e-2) for b in (0.1, 0.3, 0.5, 0.7)]
    assert edge_extensions(tried, {"lr": 1e-2, "outer_lr": 0.3}) == [
        {"lr": 0.0333, "outer_lr": 0.3}]  # inner lr on its upper edge, outer lr inside
    assert edge_extensions(tried, {"lr": 3e-3, "outer_lr": 0.1}) == [
        {"lr": 0.0009, "outer_lr": 0.1}, {"lr": 3e-3, "outer_lr": 0.0333}]
    assert edge_extensions(tried, {"lr": 1e-2, "outer_lr": 0.7}) == [
        {"lr": 0.0333, "outer_lr": 0.7}, {"lr": 1e-2, "outer_lr": 0.98}]
    one_axis = [{"demo_lr": 3e-3}]
    assert edge_extensions(one_axis, {"demo_lr": 3e-3}) == []  # a single value has no edge
    inside = [{"lr": 1e-3}, {"lr": 3e-3}, {"lr": 1e-2}]
    assert edge_extensions(inside, {"lr": 3e-3}) == []


def test_equal_tokens_scales_steps_and_warmup_by_the_batch() -> None:
    values = {"batch_size": 2, "steps": 400, "warmup_steps": 20}
    assert equal_tokens(values, 8) == {"batch_size": 2, "steps": 1600, "warmup_steps": 80}
    assert equal_tokens({**values, "batch_size": 8}, 8)["steps"] == 400
    with pytest.raises(ValueError, match="pick a divisor"):
        equal_tokens({**values, "batch_size": 3}, 8)


def test_a_report_records_the_load_its_timings_were_taken_under(tmp_path: Path) -> None:
    from farlink.bench.report import write_json

    doc = json.loads(write_json(tmp_path / "x.json", "x", []).read_text())
    load = doc["machine"]["load_average_1_5_15_min"]
    assert len(load) == 3 and all(isinstance(v, float) and v >= 0 for v in load)
    assert doc["machine"]["cpus"] >= 1


def test_seeds_and_time_to_loss_on_a_toy_run(tmp_path: Path, cache_dir: Path) -> None:
    """Two seeds per final run: the row's loss is their mean, with each seed's loss, their
    range and the mean curve; a seed's run differs from seed 0's (other init and data order).
    Time-to-loss per profile: the measured compute per step and curve, the planner's link."""
    from farlink.bench.time_to_loss import steps_to_loss

    base = toy_base(cache_dir)
    fams = [Family(f.name, f.base, f.grid[:1]) for f in toy_families()
            if f.name in ("ddp", "diloco")]
    run(tmp_path, base, SWEEP_STEPS, H, family_list=fams,
        only=["ddp", "diloco-fp32", "diloco-eager"], seeds=2,
        profiles=("datacenter", "home"), max_extensions=0)
    doc = json.loads((tmp_path / "frontier.json").read_text())
    assert (tmp_path / "frontier-time-to-loss.png").stat().st_size > 0
    for r in doc["rows"]:
        losses = r["heldout_loss_seeds"]
        assert len(losses) == 2 and r["seeds"] == [0, 1]
        assert r["final_heldout_loss"] == pytest.approx(sum(losses) / 2)
        assert r["heldout_loss_range"] == [min(losses), max(losses)]
        assert len(set(losses)) == 2  # the seeds are different runs
        last = r["evals"][-1]
        assert last["loss"] == pytest.approx(sum(last["loss_seeds"]) / 2)
        if "outer_overlap" not in r["config"]:  # (a delayed step's last round lands after it)
            assert last["loss_seeds"] == losses
        assert r["compute_s_per_step"] > 0 and r["compute_s_per_step_runs"] == 2
    seed1 = json.loads((tmp_path / "frontier" / "final" / "ddp-seed1.json").read_text())
    assert seed1["config"]["seed"] == 1
    ttl = doc["time_to_loss"]
    assert ttl["targets"]["ddp_final"] == doc["rows"][0]["final_heldout_loss"]
    home = {e["label"]: e for e in ttl["profiles"]["home"]["rows"]}
    dc = {e["label"]: e for e in ttl["profiles"]["datacenter"]["rows"]}
    for rows in (home, dc):
        ddp = rows["ddp"]  # DDP reaches its own final loss at its last evaluation at the latest
        assert ddp["time_to_target_s"]["ddp_final"] <= STEPS * ddp["seconds_per_step"] + 1e-9
        assert ddp["seconds_per_step"] >= ddp["compute_s_per_step"] == ttl["compute_s_per_step"]
    # a slower link costs DDP (a round every step) more per step than DiLoCo (one every H)
    assert (home["ddp"]["seconds_per_step"] - dc["ddp"]["seconds_per_step"]
            > home["diloco-fp32"]["seconds_per_step"] - dc["diloco-fp32"]["seconds_per_step"])
    # the delayed step hides the exchange behind the next round's compute
    assert (home["diloco-eager"]["exposed_comm_seconds_planned"]
            < home["diloco-fp32"]["exposed_comm_seconds_planned"])
    curve = [{"step": 2, "loss": 5.0}, {"step": 4, "loss": 4.0}]
    assert steps_to_loss(curve, 4.5) == 3.0 and steps_to_loss(curve, 5.5) == 2.0
    assert steps_to_loss(curve, 3.9) is None


def test_longer_h_rows_send_fewer_bytes_per_token_at_the_swept_lrs(
        tmp_path: Path, cache_dir: Path) -> None:
    """``methods(longer_h=...)``: SparseLoCo and DiLoCo int4, Muon inside, at twice the bench's
    H: half the rounds at the same tokens, so half the bytes per token (SparseLoCo sends the
    same number of entries every round), at the lrs its family swept at the bench's H."""
    base = toy_base(cache_dir)
    fams = [f for f in toy_families() if f.name == "sparseloco"]
    default = [m.label for m in methods()]
    after = default.index("sparseloco-muon-k64") + 1  # beside the rows of Muon inside at H
    longer = methods(longer_h=(2 * H,))
    assert [m.label for m in longer] == [
        *default[:after], "sparseloco-muon-k64-H4", "diloco-muon-int4-H4", *default[after:]]
    assert {m.label: (m.family, m.overrides) for m in longer}["diloco-muon-int4-H4"] == (
        "diloco", {"inner": "muon", "codec": "int4+ef", "inner_steps": 2 * H})
    result = run(tmp_path, base, SWEEP_STEPS, H, family_list=fams, method_list=longer,
                 plot=False, max_extensions=0,
                 only=["sparseloco-muon-k64", "sparseloco-muon-k64-H4"])
    short, long = result["rows"]
    assert long["config"]["inner_steps"] == 2 * H and long["config"]["inner"] == "muon"
    assert short["config"]["inner_steps"] == H
    swept = result["sweep"]["sparseloco"]["best"]
    assert long["lrs_from_sweep"] == short["lrs_from_sweep"] == swept
    assert long["tokens_per_worker"] == short["tokens_per_worker"]
    assert long["bytes_per_token"] == pytest.approx(short["bytes_per_token"] / 2, rel=0.02)


def _toy_row(label: str, overrides: dict, curve: list[tuple[int, float]]) -> dict:
    config = {"model": "nano", "workers": 4, "steps": curve[-1][0], "batch_size": 8,
              "seq_len": 64, "warmup_steps": 2, "eval_batches": 2, **overrides}
    return {"label": label, "params": 368960, "config": config,
            "evals": [{"step": s, "loss": loss} for s, loss in curve],
            "final_heldout_loss": curve[-1][1]}


def test_time_to_loss_priced_at_larger_sizes_from_a_toy_frontier(tmp_path: Path) -> None:
    """Priced at 125m and 1b from measured curves: on a fast link the method that needs the
    fewest steps wins, on a slow one the method that sends the fewest bytes; a method that never
    reaches a target has no time for it; bytes and compute grow with the size."""
    from farlink.bench.time_to_loss import rows_of, write_priced

    ddp = _toy_row("ddp", {"algorithm": "ddp"}, [(10, 4.2), (20, 4.0), (30, 3.9)])
    diloco = _toy_row("diloco-fp32", {"algorithm": "diloco", "inner_steps": 10},
                      [(10, 4.6), (20, 4.1), (30, 3.5)])  # reaches 3.9 at step 23.3
    sparse = _toy_row("sparseloco-k64", {"algorithm": "sparseloco", "inner_steps": 10,
                                         "sparseloco_topk": 64},
                      [(10, 4.7), (20, 4.3), (30, 4.1), (60, 3.85)])  # 3.9 at step 54
    first = tmp_path / "a.json"
    second = tmp_path / "b.json"
    first.write_text(json.dumps({"rows": [ddp, diloco]}))
    # a label both files hold is taken from the first: this copy of DDP would win everything
    second.write_text(json.dumps({"rows": [{**ddp, "final_heldout_loss": 0.0}, sparse]}))
    assert [r["final_heldout_loss"] for r in rows_of(
        [json.loads(first.read_text()), json.loads(second.read_text())])] == [3.9, 3.5, 3.85]
    results = write_priced(tmp_path, "ttl", [first, second], ["125m", "1b"],
                           ("datacenter", "home"))
    for size in ("125m", "1b"):
        assert (tmp_path / f"ttl-{size}.png").stat().st_size > 0
        saved = json.loads((tmp_path / f"ttl-{size}.json").read_text())
        assert saved["priced_at"]["model"] == size and "not a measurement" in saved["assumes"]
        result = results[size]
        assert result["targets"]["ddp_final"] == 3.9
        for profile, winner in (("datacenter", "diloco-fp32"), ("home", "sparseloco-k64")):
            body = result["profiles"][profile]
            assert body["winner"]["ddp_final"] == winner
            rows = {e["label"]: e for e in body["rows"]}
            assert rows["diloco-fp32"]["steps_to_target"]["ddp_final"] == pytest.approx(70 / 3)
            assert rows["sparseloco-k64"]["steps_to_target"]["ddp_final"] == pytest.approx(54)
            best = "best_local_final (diloco-fp32)"
            assert body["winner"][best] == "diloco-fp32"
            assert rows["ddp"]["time_to_target_s"][best] is None  # never got to 3.5
            assert rows["sparseloco-k64"]["time_to_target_s"][best] is None
            assert (rows["sparseloco-k64"]["bytes_per_round_planned"] * 50
                    < rows["diloco-fp32"]["bytes_per_round_planned"])
    small, large = results["125m"], results["1b"]
    assert large["priced_at"]["n_params"] > 5 * small["priced_at"]["n_params"]
    assert large["compute_s_per_step"] > 5 * small["compute_s_per_step"]
    for a, b in zip(small["profiles"]["home"]["rows"], large["profiles"]["home"]["rows"]):
        assert b["bytes_per_round_planned"] > 5 * a["bytes_per_round_planned"]
        assert b["seconds_per_step"] > a["seconds_per_step"]


def test_given_lrs_train_at_another_preset_without_a_sweep(
        tmp_path: Path, cache_dir: Path) -> None:
    """``sweep_steps=0`` (lrs carried over from another size's sweep): nothing is swept, each
    family runs at the one point it names, recorded as not swept; the run's ``model`` preset is
    the model every row trains (``small``'s parameter count); a family naming several points is
    refused before anything trains."""
    calls: list[str] = []
    train = recording(calls)
    base = toy_base(cache_dir, model="small")
    fams = [Family("ddp", {"algorithm": "ddp"}, grid(lr=[3e-3])),
            Family("diloco", {"algorithm": "diloco", "inner_steps": H},
                   grid(lr=[1e-2], outer_lr=[0.3]))]
    rows = [Method("ddp", "ddp"), Method("diloco-fp32", "diloco")]
    result = run(tmp_path, base, 0, H, family_list=fams, method_list=rows, train=train,
                 plot=False)
    assert calls == ["ddp", "diloco-fp32"]  # no sweep run
    sweep = result["sweep"]["diloco"]
    assert sweep["best"] == {"lr": 1e-2, "outer_lr": 0.3}
    assert sweep["points"] == [] and sweep["steps"] == 0 and "not_swept" in sweep
    ddp, diloco = result["rows"]
    assert ddp["config"]["lr"] == 3e-3 and ddp["lrs_from_sweep"] == {"lr": 3e-3}
    assert (diloco["config"]["lr"], diloco["config"]["outer_lr"]) == (1e-2, 0.3)
    small = preset_config("small", vocab_size=300, seq_len=SEQ).num_parameters()
    assert small > 10 * preset_config("nano", vocab_size=300, seq_len=SEQ).num_parameters()
    assert ddp["params"] == diloco["params"] == small
    assert diloco["bytes_per_token_reduction_vs_ddp"] == pytest.approx(H, rel=0.01)

    two_points = [Family("ddp", {"algorithm": "ddp"}, grid(lr=[1e-3, 3e-3]))]
    with pytest.raises(ValueError, match="ddp list several"):
        run(tmp_path / "refused", base, 0, H, family_list=two_points,
            method_list=[Method("ddp", "ddp")], train=train, plot=False)
    assert calls == ["ddp", "diloco-fp32"]
