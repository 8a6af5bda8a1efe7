"""``farlink export RUN_DIR --hf OUT``: a run's model as a Hugging Face model directory.

``OUT`` loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)``, so a model trained across islands goes straight into the
tools people already use (evaluation harnesses, inference servers, fine-tuning). farlink's own
GPT is written as a ``LlamaForCausalLM`` (see :func:`farlink.model.hf.to_llama`); a run of
``--model hf:DIR`` writes its own architecture back. The tokenizer is the one the run trained on.
"""

from __future__ import annotations

from pathlib import Path

from farlink.data.tokenizer import eot_token, load_tokenizer
from farlink.model.build import load_run_model
from farlink.model.gpt import GPT
from farlink.model.hf import CausalLM, to_llama, transformers

TOKENIZER_FILE = "tokenizer.json"


def run_tokenizer_path(run_dir: Path) -> Path:
    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {TOKENIZER_FILE}; it is not a farlink run "
                                "directory, or its run was started by an older farlink")
    return path


def export_hf(run_dir: Path, out: Path) -> Path:
    """Write the run's final model and tokenizer to ``out`` (a new or empty directory)."""
    tf = transformers("farlink export --hf")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; export into a new "
                              "one (nothing there is overwritten)")
    tokenizer = load_tokenizer(run_tokenizer_path(run_dir))
    eos = eot_token(tokenizer)
    model = load_run_model(run_dir)
    if isinstance(model, GPT):
        hf_model = to_llama(model, eos_token_id=tokenizer.token_to_id(eos))
    elif isinstance(model, CausalLM):
        hf_model = model.hf
    else:  # pragma: no cover - load_run_model builds only the two
        raise TypeError(f"cannot export a {type(model).__name__}")
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(str(out))
    tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=eos,
                               model_max_length=hf_model.config.max_position_embeddings,
                               ).save_pretrained(str(out))
    return out
