"""``bench wan``'s planner check on runs the planner cannot price: the run keeps its measured
rounds and is marked "not planned" instead of failing the benchmark."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from farlink.bench.wan import validate_planner, variants
from farlink.links import get_profile

H, WORKERS = 5, 2


def write_round_logs(run_dir: Path, rounds: int) -> None:
    """Worker logs as the loop writes them: cumulative compute and blocked seconds per step,
    0.1 s of compute per step and 0.5 s blocked per round."""
    metrics = run_dir / "metrics"
    metrics.mkdir(parents=True)
    for w in range(WORKERS):
        lines = []
        for step in range(1, rounds * H + 1):
            synced = step // H
            lines.append({"kind": "sync" if step % H == 0 else "step", "step": step,
                          "compute_s": 0.1 * step, "comm_s": 0.5 * synced,
                          "quorum_s": 0.1 * synced, "network_s": 0.3 * synced,
                          "rounds_s": 0.5 * synced, "bytes_sent": 1000 * synced})
        (metrics / f"w{w}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def row(label: str, algorithm: str, codec: str = "none") -> dict:
    return {"label": label, "algorithm": algorithm, "codec": codec, "inner_steps": H,
            "workers": WORKERS, "fragments": 1, "overlap_steps": None}


def test_sparseloco_is_a_wan_variant() -> None:
    assert ("sparseloco-H50", {"algorithm": "sparseloco"}) in variants(50, 4)


def test_streaming_overlap_defaults_to_half_the_gap_between_fragment_syncs() -> None:
    def overlap(*args: int | None) -> int:
        return next(o for label, o in variants(*args) if label.startswith("streaming"))[
            "overlap_steps"]

    assert overlap(50, 4) == 5  # 50 // 8 - 1
    assert overlap(50, 4, 10) == 10
    assert overlap(4, 4) == 1


def test_a_method_the_planner_cannot_price_is_measured_and_marked_not_planned(
        tmp_path: Path) -> None:
    # hierarchical DiLoCo's two tiers have no model in the planner (SparseLoCo now has one)
    for label in ("tiered", "diloco"):
        write_round_logs(tmp_path / label, rounds=4)
    rows = [row("tiered", "hierarchical_diloco"), row("diloco", "diloco")]
    result = validate_planner(rows, get_profile("intercontinental"), tmp_path)
    tiered_measured, diloco_measured = result["measured"]
    assert tiered_measured["round_seconds"] == pytest.approx(H * 0.1 + 0.5)
    assert tiered_measured["utilization"] == pytest.approx(0.5 / 1.0)
    assert "hierarchical_diloco" in result["predicted"][0]["not_planned"]
    assert "round_seconds" not in result["predicted"][0]
    # the one it can price is still predicted and compared
    assert result["predicted"][1]["round_seconds"] > 0
    assert result["errors"]["metrics"]["round_seconds"]["n"] == 1
    assert diloco_measured["round_seconds"] == pytest.approx(1.0)
    # the comparison names each run by its label (its report and plot once showed 0, 1, ...)
    assert [r["name"] for r in result["errors"]["runs"]] == ["tiered", "diloco"]


def test_demo_and_sparseloco_are_priced_with_the_codec_their_run_sent_with(
        tmp_path: Path) -> None:
    """The planner check once priced DeMo's and SparseLoCo's payloads as ``NAME:64:32`` whatever
    the run sent: DeMo at 41x its size, SparseLoCo at 50% density instead of 1.56%. Each run's
    row carries its algorithm's wire spec (the run's chunk and k), and that is what is priced."""
    from farlink.config import RunConfig
    from farlink.plan import predict_round
    from farlink.sync import algorithm_class

    link = get_profile("intercontinental")
    specs = {a: algorithm_class(a).wire_spec(RunConfig(algorithm=a)) for a in ("demo", "sparseloco")}
    assert specs == {"demo": "dct_topk:64:32", "sparseloco": "sparseloco:4096:64"}
    assert algorithm_class("sparseloco").wire_spec(RunConfig(
        algorithm="sparseloco", sparseloco_chunk=1024, sparseloco_topk=8)) == "sparseloco:1024:8"
    for label in specs:
        write_round_logs(tmp_path / label, rounds=4)
    rows = [row(a, a) | {"wire_spec": specs[a]} for a in specs]
    result = validate_planner(rows, get_profile("intercontinental"), tmp_path)
    from farlink.model import preset_config

    n_params = preset_config("tiny").num_parameters()
    for r, predicted, measured in zip(rows, result["predicted"], result["measured"]):
        expected = predict_round(
            r["algorithm"], WORKERS, measured["step_seconds"], link.bandwidth_bps,
            link.latency_s, jitter_s=link.jitter_s, loss=link.loss, n_params=n_params,
            inner_steps=H, codec=specs[r["algorithm"]],
            straggler_sigma=measured["straggler_sigma"], local_seconds=measured["local_seconds"])
        assert predicted["comm_seconds"] == pytest.approx(expected.comm_seconds)
    # the old price: 32 of every 64 values
    wrong = predict_round("demo", WORKERS, 0.1, link.bandwidth_bps, link.latency_s,
                          n_params=n_params, codec="dct_topk:64:32")
    assert wrong.bytes_sent_per_round < 0.1 * WORKERS * n_params


def test_the_outer_step_off_the_critical_path_is_a_variant_and_planned_as_one(
        tmp_path: Path) -> None:
    """``--outer-overlap eager`` adds DiLoCo int4+ef with its outer step one round late, and the
    planner check prices that run with the round hidden behind the next phase, not as a
    blocking round."""
    labels = dict(variants(50, 4, outer_overlap="eager"))
    assert labels["diloco-H50-int4-eager"] == {"algorithm": "diloco", "codec": "int4+ef",
                                               "outer_overlap": "eager"}
    assert not any("eager" in label for label, _ in variants(50, 4))
    for label in ("eager", "blocking"):
        write_round_logs(tmp_path / label, rounds=4)
    rows = [row("eager", "diloco", "int4+ef") | {"outer_overlap": "eager"},
            row("blocking", "diloco", "int4+ef")]
    eager, blocking = validate_planner(rows, get_profile("intercontinental"), tmp_path)[
        "predicted"]
    assert eager["utilization"] > blocking["utilization"]


def test_a_round_sent_in_the_background_is_counted_between_sync_records(tmp_path: Path) -> None:
    """With the outer step off the critical path a round's bytes go out during the next phase's
    steps: the sync record adds nothing to the step before it (the peak read 0)."""
    from farlink.bench.wan import peak_round_bytes

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    records = [{"kind": "step", "bytes_sent": 0}, {"kind": "sync", "bytes_sent": 0},
               {"kind": "step", "bytes_sent": 600}, {"kind": "step", "bytes_sent": 1000},
               {"kind": "sync", "bytes_sent": 1000}, {"kind": "step", "bytes_sent": 2000},
               {"kind": "sync", "bytes_sent": 2000}]
    (metrics / "w0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert peak_round_bytes(tmp_path) == 0  # as a blocking round's record is read
    assert peak_round_bytes(tmp_path, in_background=True) == 1000


def test_a_reused_run_reports_the_load_it_was_measured_under(tmp_path: Path) -> None:
    """``--reuse`` reads a finished run back; the load average it reports is the one recorded
    when the run trained (the machine is shared), not the load while it is read back."""
    from farlink.bench.wan import run_load

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    trained = run_load(run_dir, started=0.0, load_start=[7.0, 6.0, 5.0])
    assert trained["start"] == [7.0, 6.0, 5.0] and len(trained["end"]) == 3
    reused = run_load(run_dir, started=time.time() + 60, load_start=[1.0, 1.0, 1.0])
    assert reused == trained
