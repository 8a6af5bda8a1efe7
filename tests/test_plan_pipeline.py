"""``farlink plan --pipeline-stages``: the pipeline cost model checked by hand."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from farlink.cli import app
from farlink.links import load_links
from farlink.plan import PlanInputError, load_hardware
from farlink.plan.pipeline import plan_pipeline


def test_pipeline_step_by_hand() -> None:
    gpu, link = load_hardware()["h100"], load_links()["home"]  # 50 Mbit/s, 60 ms one way
    n, d, tokens, micro = 1.2e9, 2048, 8192, 4
    p = plan_pipeline(n, d, stages=4, workers=8, gpu=gpu, link=link, batch_tokens=tokens,
                      micro_batches=micro, activation_codec="fp32", inner_steps=10**9)
    compute = 6 * (n / 4) * (tokens / micro) / (gpu.flops * 0.4)
    boundary = 0.060 + (tokens / micro) * d * 4 * 8 / 50e6
    ring = (2 * 1 / 2 * 4 * n / 4 * 8 / 50e6 + 0.120) / 10**9  # 2 peers per stage
    assert p.stage_compute_s == pytest.approx(compute)
    assert p.boundary_s == pytest.approx(boundary)
    fill = 4 * compute + 2 * 3 * boundary
    assert p.step_s == pytest.approx(fill + (micro - 1) * max(compute, boundary) + 4 * ring)
    assert p.pipelines == 2 and p.tokens_per_s == pytest.approx(2 * tokens / p.step_s)
    assert p.memory_gib_per_gpu == pytest.approx(16 * n / 4 / 2**30)
    int4 = plan_pipeline(n, d, 4, 8, gpu, link, tokens, micro, activation_codec="int4",
                         inner_steps=10**9)
    assert int4.activation_bytes_per_token < p.activation_bytes_per_token / 6
    assert int4.step_s < p.step_s
    with pytest.raises(PlanInputError, match="multiple of 4"):
        plan_pipeline(n, d, 4, 6, gpu, link, tokens, micro)


def test_plan_cli_pipeline_json_and_errors() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--model", "1b", "--workers", "8", "--profile", "home",
                                 "--algorithm", "diloco", "--pipeline-stages", "4", "--json"])
    assert result.exit_code == 0, result.output
    pipeline = json.loads(result.output)["pipeline"]
    assert pipeline["stages"] == 4 and pipeline["pipelines"] == 2 and pipeline["step_s"] > 0
    result = runner.invoke(app, ["plan", "--model", "3e9", "--workers", "8",
                                 "--pipeline-stages", "4"])
    assert result.exit_code == 2 and "needs the model's width" in result.output


def _matrix_file(tmp_path, fast_pairs, names=("a", "b", "c", "d")) -> str:
    """Home-grade links (5 Mbit/s, 200 ms RTT) everywhere but ``fast_pairs`` (1 Gbit/s, 1 ms)."""
    n = len(names)
    fast = {frozenset(p) for p in fast_pairs}
    bandwidth = [[None if i == j else (1000.0 if frozenset((i, j)) in fast else 5.0)
                  for j in range(n)] for i in range(n)]
    rtt = [[None if i == j else (1.0 if frozenset((i, j)) in fast else 200.0)
            for j in range(n)] for i in range(n)]
    path = tmp_path / "links.json"
    path.write_text(json.dumps({"peers": list(names), "bandwidth_mbit": bandwidth,
                                "rtt_ms": rtt}))
    return str(path)


def test_plan_places_stages_on_a_measured_matrix(tmp_path) -> None:
    """a-c and b-d are the only fast pairs: each must be one pipeline, and the placement's
    predicted step must beat the random placements' median."""
    path = _matrix_file(tmp_path, [(0, 2), (1, 3)])
    runner = CliRunner()
    args = ["plan", "--model", "tiny", "--workers", "4", "--profile", "home", "--algorithm",
            "diloco", "--pipeline-stages", "2", "--batch-tokens", "4096",
            "--link-matrix", path]
    result = runner.invoke(app, args + ["--json"])
    assert result.exit_code == 0, result.output
    placement = json.loads(result.output)["placement"]
    chosen = placement["chosen"]
    assert {frozenset(p) for p in chosen["pipelines"]} == {frozenset("ac"), frozenset("bd")}
    assert chosen["predicted_step_s"] < placement["random_median_step_s"] / 2
    assert chosen["slowest_link_s"] < 0.01  # a fast boundary: 0.5 ms + bytes at 1 Gbit/s
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "stage 0 on" in table.output and "the median random placement" in table.output
    mismatch = runner.invoke(app, args[:4] + ["6"] + args[5:])
    assert mismatch.exit_code == 2 and "pass --workers 4" in mismatch.output
    alone = runner.invoke(app, ["plan", "--model", "tiny", "--workers", "4",
                                "--link-matrix", path])
    assert alone.exit_code == 2 and "give --pipeline-stages" in alone.output


def test_link_matrix_file_forms_and_errors(tmp_path) -> None:
    from farlink.comm.linkprobe import LinkMatrix
    from farlink.plan.pipeline import load_link_matrix

    one_way = LinkMatrix.from_json({"bandwidth_mbit": [[None, 10], [20, None]],
                                    "latency_ms": [[None, 30], [30, None]]})
    assert one_way.rtt_ms == [[None, 60.0], [60.0, None]]
    assert LinkMatrix.from_json(one_way.to_json()) == one_way
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"bandwidth_mbit": [[None, 10]], "rtt_ms": [[None, 1]]}))
    with pytest.raises(PlanInputError, match="not 1 x 1"):
        load_link_matrix(bad)
    bad.write_text(json.dumps({"bandwidth_mbit": [[None, 0], [1, None]],
                               "rtt_ms": [[None, 1], [1, None]]}))
    with pytest.raises(PlanInputError, match=r"bandwidth_mbit\[0\]\[1\] = 0"):
        load_link_matrix(bad)
    with pytest.raises(PlanInputError, match="cannot read"):
        load_link_matrix(tmp_path / "missing.json")
