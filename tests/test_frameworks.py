"""farlink.Optimizer inside the frameworks people train with: Hugging Face Trainer (with a
resume from its checkpoint that lands on the model of the run that never stopped), Accelerate
and PyTorch Lightning, each as its example runs it: two replica processes on a real torchft
Lighthouse, a tiny Llama built from a config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import farlink

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("hf_trainer.py", "accelerate_loop.py", "lightning_module.py")


def run_example(name: str, workdir: Path, *args: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--workdir",
                           str(workdir), *args], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replicas agree: True" in proc.stdout
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2
    return results


def learned(results: list[dict]) -> bool:
    return all(r["heldout_after"] < r["heldout_before"] / 2
               and r["losses"][-1] < r["losses"][0] / 2 for r in results)


@pytest.mark.slow
def test_hf_trainer_resumed_from_its_checkpoint_lands_on_the_uninterrupted_model(
        tmp_path: Path) -> None:
    """Trainer(optimizers=(farlink optimizer, scheduler)); one run of 20 steps, and one stopped
    after step 15 (mid-round: rounds fall every 10) and resumed with resume_from_checkpoint in
    new processes: both end on one fingerprint, the same, with the same logged losses."""
    pytest.importorskip("accelerate")
    whole = run_example("hf_trainer.py", tmp_path / "whole", "--steps", "20")
    stopped = run_example("hf_trainer.py", tmp_path / "stopped", "--steps", "20",
                          "--stop-at", "15")
    assert {r["step"] for r in stopped} == {15} and {r["outer_steps"] for r in stopped} == {1}
    resumed = run_example("hf_trainer.py", tmp_path / "stopped", "--steps", "20", "--resume")
    assert {r["step"] for r in whole} == {r["step"] for r in resumed} == {20}
    assert {r["outer_steps"] for r in resumed} == {2}
    assert {r["fingerprint"] for r in whole} == {r["fingerprint"] for r in resumed}
    assert [r["losses"] for r in whole] == [r["losses"] for r in resumed]
    assert learned(whole)


@pytest.mark.slow
def test_accelerate_prepare_trains_two_replicas_to_one_model(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    results = run_example("accelerate_loop.py", tmp_path, "--steps", "30")
    assert {r["outer_steps"] for r in results} == {3} and learned(results)


@pytest.mark.slow
def test_lightning_configure_optimizers_trains_two_replicas_to_one_model(
        tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    results = run_example("lightning_module.py", tmp_path, "--steps", "30")
    assert {r["outer_steps"] for r in results} == {3} and learned(results)


def test_framework_examples_add_at_most_ten_lines() -> None:
    for name in EXAMPLES:
        text = (ROOT / "examples" / name).read_text()
        added = [line for line in text.splitlines() if line.rstrip().endswith("# farlink")]
        assert 0 < len(added) <= 10, (name, len(added))


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def lightning_fit(max_steps: int, root: Path, ckpt_path: Path | None = None):  # noqa: ANN201
    """One replica (in-process backend) of DiLoCo H=4 in Lightning, 6 steps an epoch, a
    checkpoint after every epoch (Lightning's ModelCheckpoint); the module, the trainer and the
    farlink optimizer."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Regressor()

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            # the batch of this global step: Lightning re-feeds a plain DataLoader's first
            # batch when it resumes at an epoch's end, which is its data, not the optimizer
            gen = torch.Generator().manual_seed(self.global_step)
            x = torch.randn(8, 4, generator=gen)
            return nn.functional.mse_loss(self.net(x), x.sum(-1))

        def configure_optimizers(self) -> dict:
            inner = torch.optim.AdamW(self.parameters(), lr=0.02)
            opt = farlink.Optimizer(self, inner, algorithm="diloco", inner_steps=4,
                                    backend="inprocess")
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s / 4))
            return {"optimizer": opt,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(48)),
                                         batch_size=8)
    module = Module()
    every_epoch = L.pytorch.callbacks.ModelCheckpoint(root, every_n_epochs=1, save_top_k=-1,
                                                      save_on_train_epoch_end=True)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                        default_root_dir=root, callbacks=[every_epoch],
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, trainer, trainer.optimizers[0]


def test_lightning_checkpoint_resumes_farlink_exactly(tmp_path: Path) -> None:
    """Lightning's own checkpoint after the first epoch (6 steps: mid-round, rounds every 4),
    resumed by fit(ckpt_path=...) in a new Trainer, continues exactly: the committed state and
    the model after 12 steps are those of the fit that never stopped."""
    pytest.importorskip("lightning")
    _, whole, sync = lightning_fit(12, tmp_path / "whole")
    expected = sync.fingerprint(), [p.detach().clone() for p in whole.lightning_module.parameters()]
    sync.close()
    checkpoint = tmp_path / "whole" / "epoch=0-step=6.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]["farlink"]
    assert int(saved["tensors"]["counter.inner_steps"]) == 6
    module, _, sync = lightning_fit(12, tmp_path / "again", checkpoint)
    assert sync.outer_step == 3 and sync.fingerprint() == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), expected[1]))
    sync.close()
