"""``farlink export RUN_DIR --hf OUT``: a run's model as a Hugging Face model directory.

``OUT`` loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)``, so a model trained across islands goes straight into the
tools people already use (evaluation harnesses, inference servers, fine-tuning). farlink's own
GPT is written as a ``LlamaForCausalLM`` (see :func:`farlink.model.hf.to_llama`); a run of
``--model hf:DIR`` writes its own architecture back. The tokenizer is the one the run trained on.

The files are written into a temporary directory next to ``OUT`` (``.OUT.tmp-PID``), synced,
and renamed to ``OUT`` when complete, so an export interrupted at any instant (Ctrl-C, SIGKILL,
a full disk) leaves no ``OUT`` at all, never one that ``from_pretrained`` cannot load and a rerun
would refuse; the temporary directory of a killed export is removed by the next one.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
from pathlib import Path

from farlink.data.tokenizer import eot_token, load_tokenizer
from farlink.model.build import load_run_model
from farlink.model.gpt import GPT
from farlink.model.hf import CausalLM, to_llama, transformers
from farlink.state.checkpoint import remove_stale_temps
from farlink.state.files import TEMP_PREFIX

TOKENIZER_FILE = "tokenizer.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def run_tokenizer_path(run_dir: Path) -> Path:
    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {TOKENIZER_FILE}; it is not a farlink run "
                                "directory, or its run was started by an older farlink")
    return path


def check_target(out: Path) -> None:
    """Refuse an ``out`` that is not new or empty, saying what it holds and what to do
    (nothing there is ever overwritten)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} is a file; give --hf a new directory")
    if not any(out.iterdir()):
        return
    if not (out / "config.json").is_file():
        raise FileExistsError(f"{out} is not an empty directory (nothing there is overwritten); "
                              "export into a new one with --hf NEW_DIR")
    if any((out / name).is_file() for name in WEIGHT_FILES) and (out / TOKENIZER_FILE).is_file():
        raise FileExistsError(f"{out} is not an empty directory: it holds an exported model "
                              f"already, nothing was changed. Load it with from_pretrained, or "
                              f"export again into a new directory (--hf NEW_DIR) or after "
                              f"removing this one (rm -r {out})")
    raise FileExistsError(f"{out} is not an empty directory: it holds an incomplete export (a "
                          "config without its weights or tokenizer, left by an interrupted "
                          f"export) that from_pretrained cannot load. Remove it (rm -r {out}) "
                          "and export again, or export into a new directory (--hf NEW_DIR)")


def export_hf(run_dir: Path, out: Path) -> Path:
    """Write the run's final model and tokenizer to ``out`` (a new or empty directory), whole
    or not at all."""
    tf = transformers("farlink export --hf")
    out = Path(out)
    check_target(out)
    tokenizer = load_tokenizer(run_tokenizer_path(run_dir))
    eos = eot_token(tokenizer)
    model = load_run_model(run_dir)
    if isinstance(model, GPT):
        hf_model = to_llama(model, eos_token_id=tokenizer.token_to_id(eos))
    elif isinstance(model, CausalLM):
        hf_model = model.hf
    else:  # pragma: no cover - load_run_model builds only the two
        raise TypeError(f"cannot export a {type(model).__name__}")
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}{TEMP_PREFIX}"
    remove_stale_temps(out.parent, glob.escape(prefix) + "*")  # a killed export's leftovers
    tmp = out.with_name(f"{prefix}{os.getpid()}")
    try:
        tmp.mkdir()
        hf_model.save_pretrained(str(tmp))
        tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=eos,
                                   model_max_length=hf_model.config.max_position_embeddings,
                                   ).save_pretrained(str(tmp))
        _sync_files(tmp)
        try:
            os.rename(tmp, out)  # replaces an empty directory, never a non-empty one
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                check_target(out)  # written meanwhile by someone else: say what it holds
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _sync_files(directory: Path) -> None:
    """Flush every file of ``directory`` to disk before it is published under its name."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
