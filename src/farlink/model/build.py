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
import torch
from torch import nn

from farlink.model.config import GPTConfig, preset_config
from farlink.model.gpt import GPT

HF_MODEL_PREFIX = "hf:"
MODEL_FILE = "model.json"
WEIGHTS_FILE = "model.safetensors"
FARLINK_GPT = "farlink-gpt"
TRANSFORMERS = "transformers"


def hf_model_dir(model: str) -> Path | None:
    """The transformers model directory of ``hf:DIR``, or None for a preset name."""
    return Path(model[len(HF_MODEL_PREFIX):]) if model.startswith(HF_MODEL_PREFIX) else None


def build_model(model: str, vocab_size: int, seq_len: int) -> nn.Module:
    """The module of ``model`` (a preset name or ``hf:DIR``) for a tokenizer of ``vocab_size``
    ids and sequences of ``seq_len``; initialised from the global torch generator (or the
    directory's weights), so one seed gives every worker the same start."""
    directory = hf_model_dir(model)
    if directory is None:
        return GPT(preset_config(model, vocab_size=vocab_size, seq_len=seq_len))
    from farlink.model.hf import load_model

    return load_model(directory, vocab_size, seq_len)


def count_parameters(model: str, vocab_size: int, seq_len: int) -> int:
    """Parameters of ``build_model(model, vocab_size, seq_len)`` without allocating them."""
    directory = hf_model_dir(model)
    if directory is None:
        return preset_config(model, vocab_size=vocab_size, seq_len=seq_len).num_parameters()
    from farlink.model.hf import config_dict, from_config_dict

    with torch.device("meta"):
        return from_config_dict(config_dict(directory)).num_parameters()


def model_description(model: str, vocab_size: int, seq_len: int) -> dict:
    """What ``model.json`` records: enough to rebuild the architecture anywhere."""
    directory = hf_model_dir(model)
    if directory is None:
        shape = preset_config(model, vocab_size=vocab_size, seq_len=seq_len)
        return {"architecture": FARLINK_GPT, "preset": model, "config": asdict(shape)}
    from farlink.model.hf import check_fits

    config = check_fits(directory, vocab_size, seq_len)
    return {"architecture": TRANSFORMERS, "source": str(directory),
            "config": json.loads(config.to_json_string(use_diff=False))}


def write_model_description(run_dir: Path, model: str, vocab_size: int, seq_len: int) -> Path:
    path = Path(run_dir) / MODEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model_description(model, vocab_size, seq_len), indent=1))
    return path


def module_description(model: nn.Module) -> dict:
    """What ``model.json`` would record, read off a built module: how another process (a
    rollout worker) builds an empty module of the same architecture for weights it fetches."""
    if isinstance(model, GPT):
        return {"architecture": FARLINK_GPT, "config": asdict(model.config)}
    from farlink.model.hf import CausalLM

    if isinstance(model, CausalLM):
        return {"architecture": TRANSFORMERS,
                "config": json.loads(model.hf.config.to_json_string(use_diff=False))}
    raise ValueError(f"cannot describe a {type(model).__name__}: farlink's GPT or a "
                     "transformers causal LM (hf:DIR) only")


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
