"""``farlink bench gpu`` off a GPU: its FLOPs formula and peak table by hand, and a clear refusal
(no numbers) on a machine without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from farlink.bench.gpu import flops_per_token, peak_flops
from farlink.model import preset_config


def test_flops_per_token_is_six_n_plus_the_attention_term() -> None:
    shape = preset_config("125m")
    n = shape.num_parameters()
    assert 123e6 < n < 125e6  # GPT-2 small with the padded vocabulary, tied embedding once
    # 6 N + 12 L d T with L = 12, d = 768, T = 1024
    assert flops_per_token(n, 12, 768, 1024) == 6 * n + 12 * 12 * 768 * 1024
    assert flops_per_token(10, 1, 2, 3) == 60 + 72


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989e12),
                                       ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
                                       ("NVIDIA GH200 480GB", 989e12),
                                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L4", 121e12),
                                       ("NVIDIA L40S", 362e12), ("Tesla T4", None)])
def test_peak_bf16_by_device_name(name: str, peak: float | None) -> None:
    assert peak_flops(name) == peak


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_the_command_refuses_and_writes_nothing(tmp_path: Path) -> None:
    """The CLI's own refusal, its app run in this process (typer's runner)."""
    from typer.testing import CliRunner

    from farlink.cli import app

    out = tmp_path / "gpu"
    result = CliRunner().invoke(app, ["bench", "gpu", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "sees none on this machine" in result.output
    assert not out.exists()


# the same refusal from a fresh `farlink` process (its stderr and exit status): the in-process
# test above stands in for it in the default suite
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_refuses_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "-c", "from farlink.cli import main; main()",
                           "bench", "gpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "sees none on this machine" in proc.stderr
    assert not out.exists()
