"""From a run's ``--model`` to the module its workers train, and from a run directory back.

``build_model`` is the one place the worker gets its model: farlink's GPT for a preset name, or
the ``transformers`` model of ``hf:DIR`` (see :mod:`farlink.model.hf`), both with the contract
``forward(idx, targets) -> (logits, loss)``. A run directory keeps what is needed to rebuild the
model without the original inputs (``model.json``: the architecture and its config) next to the
tokenizer (``tokenizer.json``) and the final weights (``model.safetensors``), which is what
``farlink export`` and ``farlink generate`` read.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from farlink.model.config import GPTConfig, preset_config
from farlink.model.gpt import GPT

if TYPE_CHECKING:
    from farlink.config import RunConfig

MODEL_FILE = "model.json"
WEIGHTS_FILE = "model.safetensors"
FARLINK_GPT = "farlink-gpt"
TRANSFORMERS = "transformers"


def build_model(cfg: RunConfig, vocab_size: int) -> nn.Module:
    """The model ``cfg`` trains, for a tokenizer of ``vocab_size`` ids; initialised from the
    global torch generator (or the directory's weights), so one seed gives every worker the same
    start."""
    directory = cfg.hf_model_dir
    if directory is None:
        return GPT(preset_config(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len))
    from farlink.model.hf import load_model

    return load_model(directory, vocab_size, cfg.seq_len)


def count_parameters(cfg: RunConfig, vocab_size: int) -> int:
    """Parameters of ``build_model(cfg, vocab_size)`` without allocating them."""
    directory = cfg.hf_model_dir
    if directory is None:
        return preset_config(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len).num_parameters()
    from farlink.model.hf import config_dict, from_config_dict

    with torch.device("meta"):
        return from_config_dict(config_dict(directory)).num_parameters()


def model_description(cfg: RunConfig, vocab_size: int) -> dict:
    """What ``model.json`` records: enough to rebuild the architecture anywhere."""
    directory = cfg.hf_model_dir
    if directory is None:
        shape = preset_config(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len)
        return {"architecture": FARLINK_GPT, "preset": cfg.model, "config": asdict(shape)}
    from farlink.model.hf import check_fits

    config = check_fits(directory, vocab_size, cfg.seq_len)
    return {"architecture": TRANSFORMERS, "source": str(directory),
            "config": json.loads(config.to_json_string(use_diff=False))}


def write_model_description(cfg: RunConfig, vocab_size: int) -> Path:
    path = cfg.run_dir / MODEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model_description(cfg, vocab_size), indent=1))
    return path


def model_from_description(description: dict) -> nn.Module:
    """A freshly initialised module of the architecture ``model.json`` describes."""
    kind = description.get("architecture")
    if kind == FARLINK_GPT:
        return GPT(GPTConfig(**description["config"]))
    if kind == TRANSFORMERS:
        from farlink.model.hf import from_config_dict

        return from_config_dict(description["config"])
    raise ValueError(f"unknown architecture {kind!r} in {MODEL_FILE}")


def load_run_model(run_dir: Path) -> nn.Module:
    """The model a run ended on (``model.safetensors``), rebuilt from its ``model.json``."""
    from safetensors.torch import load_model

    run_dir = Path(run_dir)
    description_path, weights = run_dir / MODEL_FILE, run_dir / WEIGHTS_FILE
    if not description_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {MODEL_FILE}; it is not a farlink run "
                                "directory, or its run was started by an older farlink")
    if not weights.is_file():
        raise FileNotFoundError(f"{run_dir} has no {WEIGHTS_FILE}: the run has not finished; "
                                f"continue it with `farlink train --resume --run-dir {run_dir}`")
    model = model_from_description(json.loads(description_path.read_text()))
    load_model(model, str(weights))  # strict: every tensor present and of the right shape
    return model.eval()
