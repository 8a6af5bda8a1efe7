"""Hugging Face models in and out: real ``transformers`` models, real runs.

A real 2-worker run of farlink's GPT (its workers threads against torchft's real Lighthouse and
Gloo) is shared by the tests of export, generate and report; a ``LlamaForCausalLM`` from
``hf:DIR`` with a given tokenizer trains in a 2-worker run whose workers are threads too. A
``farlink train`` of worker processes and a Lighthouse process, run to its end through the CLI:
test_orphans.py::test_sigkilled_launcher_leaves_no_process_and_resume_finishes[torchft].
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from farlink.config import ConfigError, load_config
from farlink.data import eot_id, load_tokenizer, prepare_data
from farlink.data.corpus import CorpusError
from farlink.model import GPT, GPTConfig
from farlink.model.build import build_model, load_run_model
from farlink.model.hf import CausalLM, to_llama
from farlink.train.export import export_hf
from farlink.train.generate import sample

# torchft runs in this process (both runs' workers): after every test that forks (see conftest)
pytestmark = pytest.mark.torchft_threads

RUN_FLAGS = ["--workers", "2", "--steps", "20", "--inner-steps", "10", "--vocab-size", "512",
             "--seq-len", "64", "--batch-size", "4", "--eval-batches", "2", "--warmup-steps",
             "2", "--join-timeout", "10", "--heartbeat-timeout", "3",
             "--min-replicas", "2"]  # every round has both: a slow starter cannot train alone


def cli(*args: str):  # noqa: ANN201
    """The CLI in this process."""
    from farlink.cli import app

    return CliRunner().invoke(app, list(args))


def tiny_llama_config(vocab_size: int = 512) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf-runs")


@pytest.fixture(scope="module")
def gpt_run(workdir: Path, cache_dir: Path) -> Path:
    """farlink's GPT, 2 workers, DiLoCo, with ``RUN_FLAGS`` and its workers as threads; started
    with a run dir relative to ``workdir``."""
    from farlink.testing.runs import launch_in_threads

    here = Path.cwd()
    os.chdir(workdir)
    try:
        cfg = load_config(None, {**run_values(), "run_dir": "runs/gpt", "cache_dir": cache_dir})
        assert launch_in_threads(cfg).returncodes == [0, 0]
    finally:
        os.chdir(here)
    return workdir / "runs" / "gpt"


def run_values() -> dict:
    """``RUN_FLAGS`` as config values."""
    return dict(zip((f.lstrip("-").replace("-", "_") for f in RUN_FLAGS[::2]), RUN_FLAGS[1::2]))


def train_hf_run(tmp_path: Path, cache_dir: Path) -> tuple[Path, Path]:
    """A ``LlamaForCausalLM`` given as hf:DIR (config only), trained with a given tokenizer (the
    BPE that a run of farlink's GPT trains, written as that run writes it), with ``RUN_FLAGS``
    and its workers as threads; the run dir and the given tokenizer file."""
    from farlink.testing.runs import launch_in_threads

    tiny_llama_config().save_pretrained(tmp_path / "llama")
    flags = run_values()
    gpt = load_config(None, {**flags, "cache_dir": cache_dir})
    given = tmp_path / "tokenizer.json"
    given.write_text(prepare_data(gpt.corpus, gpt.vocab_size, cache_dir).tokenizer.to_str())
    cfg = load_config(None, {**flags, "model": f"hf:{tmp_path / 'llama'}", "tokenizer": str(given),
                             "run_dir": tmp_path / "runs" / "llama", "cache_dir": cache_dir})
    assert launch_in_threads(cfg).returncodes == [0, 0]
    return cfg.run_dir, given


# --- out: farlink's GPT is a Llama --------------------------------------------------------------

def test_gpt_maps_onto_llama_with_identical_logits() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, n_layer=2, n_head=4, d_model=64, d_ff=192,
                          seq_len=32)).eval()
    with torch.no_grad():  # move every weight (norms included) off its initial value
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    llama = to_llama(model)
    assert isinstance(llama, LlamaForCausalLM)
    x = torch.randint(0, 300, (3, 32))
    with torch.no_grad():
        ours, _ = model(x)
        theirs = llama(input_ids=x).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_export_of_a_trained_run_loads_with_auto_classes(gpt_run: Path, tmp_path: Path) -> None:
    run = json.loads((gpt_run / "model.json").read_text())
    assert run["architecture"] == "farlink-gpt" and run["config"]["vocab_size"] == 512
    out = tmp_path / "export"
    done = cli("export", str(gpt_run), "--hf", str(out))
    assert done.exit_code == 0, done.output
    hf_model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert isinstance(hf_model, LlamaForCausalLM)
    ids = hf_tokenizer("In the beginning God created the heaven and the earth.",
                       return_tensors="pt").input_ids
    ours = load_run_model(gpt_run)
    assert ids.tolist()[0] == load_tokenizer(gpt_run).encode(
        "In the beginning God created the heaven and the earth.").ids
    with torch.no_grad():
        delta = (ours(ids)[0] - hf_model(input_ids=ids).logits).abs().max().item()
    assert delta <= 1e-5
    assert hf_tokenizer.eos_token == "<|endoftext|>"
    # nothing the user owns is overwritten, and the message says what to do
    again = cli("export", str(gpt_run), "--hf", str(out))
    assert again.exit_code == 2 and "not an empty directory" in again.output
    assert "holds an exported model" in again.output and "--hf NEW_DIR" in again.output


KILLED_EXPORT = """
import os, signal, sys
import transformers
from farlink.train.export import export_hf

def killed(self, *args, **kwargs):  # the model's files are written, the tokenizer's are not
    os.kill(os.getpid(), signal.SIGKILL)

transformers.PreTrainedTokenizerFast.save_pretrained = killed
export_hf(sys.argv[1], sys.argv[2])
"""


def test_an_interrupted_export_leaves_nothing_half_written(
        gpt_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL after the first files, then Ctrl-C: the target is absent each time (never a
    config without weights or tokenizer), the rerun completes and loads, and the killed
    export's temporary directory is gone after it."""
    out = tmp_path / "export"
    killed = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(gpt_run), str(out)],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    [left] = tmp_path.iterdir()
    assert left.name.startswith(".export.tmp-")  # the killed export's; the next removes it

    done = cli("export", str(gpt_run), "--hf", str(out))
    assert done.exit_code == 0, done.output
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert isinstance(AutoModelForCausalLM.from_pretrained(str(out)), LlamaForCausalLM)
    assert AutoTokenizer.from_pretrained(str(out)).eos_token == "<|endoftext|>"

    import transformers

    def interrupted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise KeyboardInterrupt("Ctrl-C")

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_hf(gpt_run, tmp_path / "second")
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_export_into_a_half_written_directory_says_to_remove_it(gpt_run: Path,
                                                                 tmp_path: Path) -> None:
    """What an older, interrupted export left (a config without weights): refused with what
    it is and what to do, not touched."""
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    done = cli("export", str(gpt_run), "--hf", str(half))
    assert done.exit_code == 2 and "incomplete export" in done.output, done.output
    assert "rm -r" in done.output and [p.name for p in half.iterdir()] == ["config.json"]


def test_greedy_generation_matches_transformers_generate(gpt_run: Path, tmp_path: Path) -> None:
    out = export_hf(gpt_run, tmp_path / "export")
    hf_model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = load_tokenizer(gpt_run)
    prompt = tokenizer.encode("And God said").ids
    ours = sample(load_run_model(gpt_run), prompt, max_new_tokens=20, temperature=0,
                  stop_id=eot_id(tokenizer))
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               pad_token_id=eot_id(tokenizer))[0].tolist()
    assert ours == theirs and len(ours) > len(prompt)


def test_generate_cli_is_seeded_and_continues_the_prompt(gpt_run: Path) -> None:
    args = ["generate", str(gpt_run), "--prompt", "And God said", "--max-new-tokens", "30",
            "--temperature", "1.0", "--top-k", "50", "--num-samples", "3"]
    first = cli(*args, "--seed", "7")
    assert first.exit_code == 0, first.output
    samples = first.output.split("---------------\n")
    assert len(samples) == 3
    assert all(t.startswith("And God said") and len(t) > len("And God said\n") for t in samples)
    assert len(set(samples)) > 1  # sampled, not greedy
    assert cli(*args, "--seed", "7").output == first.output  # seeded: reproducible


def test_sample_top_k_one_is_greedy() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, d_ff=32, seq_len=8))
    greedy = sample(model, [1, 2], 12, temperature=0)  # longer than seq_len: context is cropped
    top1 = sample(model, [1, 2], 12, temperature=1.5, top_k=1,
                  generator=torch.Generator().manual_seed(3))
    assert greedy == top1 and len(greedy) == 14


# --- in: hf:DIR and --tokenizer -----------------------------------------------------------------

def test_hf_model_trains_in_workers(tmp_path: Path, cache_dir: Path) -> None:
    """An hf:DIR model through the launcher's path (workers as threads)."""
    hf_run, given = train_hf_run(tmp_path, cache_dir)
    summary = json.loads((hf_run / "summary.json").read_text())
    assert summary["returncodes"] == [0, 0]
    assert summary["final_replicas"]["consistent"]
    syncs = [json.loads(line) for line in (hf_run / "metrics" / "w1.jsonl").open()
             if '"kind": "sync"' in line]
    assert [(r["world_size"], r["committed"]) for r in syncs] == [(2, True), (2, True)]
    finals = [load_file(str(p)) for p in sorted((hf_run / "final").glob("w*.safetensors"))]
    assert len(finals) == 2 and any(k.startswith("hf.model.layers.") for k in finals[0])
    assert all((finals[0][k] == finals[1][k]).all() for k in finals[0])  # identical replicas
    first = next(json.loads(line) for line in (hf_run / "metrics" / "w0.jsonl").open()
                 if '"kind": "step"' in line or '"kind": "sync"' in line)
    assert summary["final_heldout_loss"] < first["loss"] - 0.3
    # the given tokenizer is the run's (kept in the run dir), and the model is a Llama
    assert (hf_run / "tokenizer.json").read_text() == given.read_text()
    described = json.loads((hf_run / "model.json").read_text())
    assert described["architecture"] == "transformers"
    assert described["config"]["model_type"] == "llama"
    # exported back as the same architecture, with the same logits
    out = export_hf(hf_run, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ours = load_run_model(hf_run)
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        assert (ours(ids)[0] - reloaded(input_ids=ids).logits).abs().max().item() <= 1e-5
    assert cli("generate", str(hf_run), "--prompt", "The LORD", "--max-new-tokens", "5"
               ).output.startswith("The LORD")


def test_causal_lm_loss_is_the_hf_loss_on_the_unshifted_window() -> None:
    """The sampler's (x, y) is already shifted; HF shifts ``labels`` itself. Both must score
    the same T predictions."""
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(tiny_llama_config(97)).eval()
    window = torch.randint(0, 97, (3, 17))
    x, y = window[:, :-1], window[:, 1:]
    with torch.no_grad():
        _, ours = CausalLM(hf_model)(x, y)
        theirs = hf_model(input_ids=window, labels=window).loss
    assert abs(float(ours) - float(theirs)) < 1e-6


def test_hf_dir_weights_are_loaded_for_continued_pretraining(tmp_path: Path) -> None:
    torch.manual_seed(123)
    trained = LlamaForCausalLM(tiny_llama_config())
    trained.save_pretrained(tmp_path / "with-weights")
    tiny_llama_config().save_pretrained(tmp_path / "config-only")
    base = {"seq_len": 64, "run_dir": tmp_path / "run"}
    torch.manual_seed(0)
    loaded = build_model(f"hf:{tmp_path / 'with-weights'}", 512, base["seq_len"])
    fresh = build_model(f"hf:{tmp_path / 'config-only'}", 512, base["seq_len"])
    assert isinstance(loaded, CausalLM)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(loaded.hf.state_dict()[name], tensor), name
    assert not torch.equal(fresh.hf.model.embed_tokens.weight, trained.model.embed_tokens.weight)
    with pytest.raises(ConfigError, match="embeds only 512"):
        build_model(f"hf:{tmp_path / 'config-only'}", 600, base["seq_len"])


def test_hf_dir_and_tokenizer_are_checked_before_a_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(None, {"model": f"hf:{tmp_path}"})
    with pytest.raises(ConfigError, match="tokenizer .* does not exist"):
        load_config(None, {"tokenizer": str(tmp_path / "missing.json")})
    with pytest.raises(ConfigError, match="10b"):
        load_config(None, {"model": "huge"})
    model_dir = tmp_path / "llama"
    tiny_llama_config().save_pretrained(model_dir)
    assert load_config(None, {"model": f"hf:{model_dir}"}).given_tokenizer is None  # train a BPE
    (model_dir / "tokenizer.json").write_text("{}")
    assert load_config(None, {"model": f"hf:{model_dir}"}).given_tokenizer == model_dir
    other = tmp_path / "other.json"
    other.write_text("{}")
    assert load_config(None, {"model": f"hf:{model_dir}",
                              "tokenizer": str(other)}).given_tokenizer == other


def test_given_tokenizer_file_or_directory_replaces_the_bpe(tmp_path: Path,
                                                            gpt_run: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Verse {i}: and the earth was without form." for i in
                                  range(40)))
    hf_dir = tmp_path / "hf-tokenizer"
    AutoTokenizer.from_pretrained(str(export_hf(gpt_run, tmp_path / "export"))) \
        .save_pretrained(str(hf_dir))
    given = load_tokenizer(gpt_run / "tokenizer.json")
    for source in (gpt_run / "tokenizer.json", hf_dir):
        data = prepare_data(str(corpus), 300, tmp_path / "cache", tokenizer=source)
        assert data.vocab_size == given.get_vocab_size() == 512  # the given one, not 300
        expected = given.encode("Verse 0: and the earth was without form.").ids
        assert data.train[:len(expected)].tolist() == expected
    bare = tmp_path / "no-eot.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(bare))
    with pytest.raises(CorpusError, match="end-of-text"):
        prepare_data(str(corpus), 300, tmp_path / "cache", tokenizer=bare)


# --- report reads the directory it is given ------------------------------------------------------

def test_report_from_another_directory_reads_the_given_run(
        gpt_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run was started with the relative run dir runs/gpt; reporting it from elsewhere
    must read that run, not ./runs/gpt (absent here, or another run's)."""
    summary = json.loads((gpt_run / "summary.json").read_text())
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "runs" / "gpt").mkdir(parents=True)  # a decoy at the same relative path
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("COLUMNS", "200")
    done = cli("report", str(gpt_run))
    assert done.exit_code == 0, done.output
    tokens = summary["per_worker"]["w0"]["tokens"]
    assert re.search(rf"w0\s+│\s+{tokens:,}\s+│", done.output) and "w1" in done.output
    assert f"held-out loss {summary['final_heldout_loss']}" in done.output
    # without the plots extra the table still prints, and the missing PNG names the extra
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    done = cli("report", str(gpt_run))
    assert done.exit_code == 0 and re.search(rf"w0\s+│\s+{tokens:,}\s+│", done.output)
    assert "no plot" in done.output and "pip install 'farlink[plots]'" in done.output
