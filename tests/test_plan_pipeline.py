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
