"""Tests for data loading, tokenizer caching, the held-out split, shard sampling and evaluation."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import farlink.data.tokenizer as tokenizer_module
from farlink.data import (
    EOT_TOKEN,
    CorpusError,
    ShardSampler,
    eot_id,
    evaluate,
    get_tokenizer,
    heldout_batches,
    heldout_indices,
    load_documents,
    prepare_data,
    shard_bounds,
    split_documents,
)
from farlink.model import GPT, GPTConfig

torch.set_num_threads(1)

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi",
         "chi", "psi", "omega"]


def make_documents(n: int, words: int = 60) -> list[str]:
    rng = np.random.default_rng(7)
    return [f"Document {i}. " + " ".join(rng.choice(WORDS, size=words)) + "." for i in range(n)]


# --- sources -------------------------------------------------------------------------------


def test_single_text_file_splits_on_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("First paragraph\nstill first.\n\n  \nSecond one.\n\n\nThird.\n")
    assert load_documents(str(path)) == ["First paragraph\nstill first.", "Second one.", "Third."]


def test_directory_gives_one_document_per_file_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Bee\n\nbody")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("sea")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / "empty.txt").write_text("   \n")
    (tmp_path / "ignored.py").write_text("print('no')")
    assert load_documents(tmp_path) == ["ay", "# Bee\n\nbody", "sea"]


def test_hf_jsonl_file_and_named_column(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    rows = [{"text": f"row {i}", "other": f"o{i}"} for i in range(5)] + [{"text": ""}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_documents(f"hf:{path}") == [f"row {i}" for i in range(5)]
    assert load_documents(f"hf:{path}#other")[:2] == ["o0", "o1"]
    with pytest.raises(CorpusError, match="no column 'missing'.*text"):
        load_documents(f"hf:{path}#missing")
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"


def test_hf_csv_directory(tmp_path: Path) -> None:
    (tmp_path / "part1.csv").write_text("text,n\nhello there,1\nsecond row,2\n")
    (tmp_path / "part2.csv").write_text("text,n\nthird row,3\n")
    assert load_documents(f"hf:{tmp_path}") == ["hello there", "second row", "third row"]


def test_hf_save_to_disk_directory(tmp_path: Path) -> None:
    import datasets

    target = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["one doc", "two doc"], "id": [1, 2]}).save_to_disk(
        str(target))
    assert load_documents(f"hf:{target}") == ["one doc", "two doc"]
    with pytest.raises(CorpusError, match="row 0 of column 'id' is int"):
        load_documents(f"hf:{target}#id")
    split_target = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t"]}),
                          "test": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(
        str(split_target))
    assert load_documents(f"hf:{split_target}") == ["t"]


@pytest.mark.parametrize("source", ["nowhere/at/all.txt", "hf:nowhere/at/all"])
def test_missing_path_names_the_path(tmp_path: Path, source: str) -> None:
    missing = source.replace("nowhere", str(tmp_path / "nowhere"))
    with pytest.raises(CorpusError, match="nowhere/at/all.*(does not exist|never downloads)"):
        load_documents(missing)


def test_empty_inputs_are_rejected_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=f"{tmp_path}.*no .txt/.md files"):
        load_documents(tmp_path)
    (tmp_path / "blank.txt").write_text("\n\n \n")
    with pytest.raises(CorpusError, match="blank.txt is empty"):
        load_documents(tmp_path / "blank.txt")
    with pytest.raises(CorpusError, match=f"all 1 text files in {tmp_path} are empty"):
        load_documents(tmp_path)
    other = tmp_path / "data.json"
    other.write_text("{}")
    with pytest.raises(CorpusError, match="hf:"):
        load_documents(other)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    with pytest.raises(CorpusError, match="latin1.txt is not UTF-8"):
        load_documents(bad)


def test_kjv_corpus_loads_by_chapter() -> None:
    documents = load_documents("kjv")
    assert len(documents) == 1189
    assert documents[0].startswith("In the beginning God created the heaven and the earth.")
    assert sum(d.count("\n") + 1 for d in documents) == 31103  # verses, one per line
    assert documents[-1].endswith("The grace of our Lord Jesus Christ be with you all. Amen.")


# --- tokenizer -----------------------------------------------------------------------------


def test_tokenizer_round_trip_and_end_of_text(tmp_path: Path) -> None:
    tokenizer = get_tokenizer(make_documents(40), 400, tmp_path)
    for text in ["alpha beta gamma.", "Unseen words: Zyx-42 {ok}\n\ttabs  and  spaces!", ""]:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert tokenizer.token_to_id(EOT_TOKEN) == eot_id(tokenizer)
    assert 257 <= tokenizer.get_vocab_size() <= 400
    with pytest.raises(ValueError, match="at least 257"):
        get_tokenizer(["x"], 100, tmp_path)


def test_tokenizer_cache_hit_does_not_retrain(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    documents = make_documents(30)
    first = get_tokenizer(documents, 350, tmp_path)
    files = list(tmp_path.glob("tokenizer-*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns

    def refuse(*_: object) -> None:
        raise AssertionError("retrained although a cached tokenizer exists")

    monkeypatch.setattr(tokenizer_module, "_train", refuse)
    second = get_tokenizer(documents, 350, tmp_path)
    assert second.to_str() == first.to_str()
    assert files[0].stat().st_mtime_ns == mtime
    with pytest.raises(AssertionError, match="retrained"):  # other vocab: a new cache key
        get_tokenizer(documents, 360, tmp_path)


def test_tokenizer_training_is_identical_across_processes(tmp_path: Path) -> None:
    """Islands train their own tokenizer; ids only agree if training is deterministic."""
    corpus = tmp_path / "docs.json"
    corpus.write_text(json.dumps(make_documents(60)))
    script = ("import json,sys,hashlib; from farlink.data import train_tokenizer; "
              "t=train_tokenizer(json.load(open(sys.argv[1])), 420); "
              "print(hashlib.sha256(t.to_str().encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", script, str(corpus)], check=True,
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip()
               for seed in (1, 2)}
    assert len(digests) == 1


# --- prepared data -------------------------------------------------------------------------


def test_heldout_documents_are_disjoint_and_spread() -> None:
    assert heldout_indices(100, 0.05) == [10, 30, 50, 70, 90]
    assert heldout_indices(3, 0.05) == [1]
    documents = make_documents(200)
    train, heldout = split_documents(documents, 0.05)
    assert len(heldout) == 10 and len(train) == 190
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(documents)
    with pytest.raises(CorpusError, match="at least 2 documents"):
        split_documents(["only"], 0.05)


def test_prepare_data_splits_caches_and_fingerprints(tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    src.mkdir()
    documents = make_documents(40)
    for i, doc in enumerate(documents):
        (src / f"{i:03d}.txt").write_text(doc)
    cache = tmp_path / "cache"
    data = prepare_data(str(src), 400, cache, heldout_fraction=0.1)
    assert data.train.dtype == np.uint16 and data.vocab_size == data.tokenizer.get_vocab_size()
    eot = eot_id(data.tokenizer)
    assert int((data.train == eot).sum()) == 36 and int((data.heldout == eot).sum()) == 4
    heldout_text = data.tokenizer.decode(data.heldout.tolist(), skip_special_tokens=False)
    train_text = data.tokenizer.decode(data.train.tolist(), skip_special_tokens=False)
    for i in heldout_indices(40, 0.1):
        assert f"Document {i}." in heldout_text and f"Document {i}." not in train_text
    npy = sorted(cache.glob("tokens-*.npy"))
    assert len(npy) == 2
    mtimes = [p.stat().st_mtime_ns for p in npy]
    again = prepare_data(str(src), 400, cache, heldout_fraction=0.1)
    assert again.fingerprint == data.fingerprint
    np.testing.assert_array_equal(again.train, data.train)
    assert [p.stat().st_mtime_ns for p in npy] == mtimes  # loaded, not re-encoded
    (src / "000.txt").write_text("changed text")
    assert prepare_data(str(src), 400, cache, heldout_fraction=0.1).fingerprint != \
        data.fingerprint


# --- sampling ------------------------------------------------------------------------------


def test_shards_are_disjoint_and_cover_everything() -> None:
    tokens = np.arange(10_007, dtype=np.int32)
    bounds = [shard_bounds(len(tokens), s, 3) for s in range(3)]
    assert bounds[0][0] == 0 and bounds[-1][1] == len(tokens)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    seen = []
    for shard in range(3):
        sampler = ShardSampler(tokens, shard, 3, seq_len=16, batch_size=4, seed=0)
        values: set[int] = set()
        for _ in range(sampler.batches_per_epoch):
            x, y = sampler.next_batch()
            assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
            torch.testing.assert_close(x[:, 1:], y[:, :-1])
            values.update(x.flatten().tolist())
            values.update(y.flatten().tolist())
        start, end = bounds[shard]
        assert min(values) >= start and max(values) < end
        seen.append(values)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2])


def test_sampler_determinism_and_epoch_rollover() -> None:
    tokens = np.random.default_rng(0).integers(0, 500, size=5000).astype(np.uint16)
    a = ShardSampler(tokens, 0, 2, seq_len=8, batch_size=5, seed=42)
    b = ShardSampler(tokens, 0, 2, seq_len=8, batch_size=5, seed=42)
    c = ShardSampler(tokens, 0, 2, seq_len=8, batch_size=5, seed=43)
    other = ShardSampler(tokens, 1, 2, seq_len=8, batch_size=5, seed=42)
    xa, xb, xc, xo = (s.next_batch()[0] for s in (a, b, c, other))
    assert torch.equal(xa, xb)
    assert not torch.equal(xa, xc) and not torch.equal(xa, xo)
    epoch0 = [a.next_batch()[0] for _ in range(a.batches_per_epoch - 1)]
    epoch1_first = a.next_batch()[0]
    assert a.state_dict()["epoch"] == 1
    assert not torch.equal(epoch1_first, xa)  # new permutation in the new epoch
    assert len(epoch0) == a.batches_per_epoch - 1


def test_state_dict_resume_reproduces_next_batches() -> None:
    tokens = np.random.default_rng(1).integers(0, 500, size=3000).astype(np.uint16)
    original = ShardSampler(tokens, 1, 3, seq_len=10, batch_size=6, seed=5)
    for _ in range(23):  # crosses an epoch boundary (16 batches per epoch)
        original.next_batch()
    state = json.loads(json.dumps(original.state_dict()))
    resumed = ShardSampler(tokens, 1, 3, seq_len=10, batch_size=6, seed=5)
    resumed.load_state_dict(state)
    for _ in range(20):
        for x, y in zip(original.next_batch(), resumed.next_batch(), strict=True):
            assert torch.equal(x, y)
    wrong = ShardSampler(tokens, 2, 3, seq_len=10, batch_size=6, seed=5)
    with pytest.raises(ValueError, match="shard=1"):
        wrong.load_state_dict(state)


def test_sampler_rejects_a_shard_too_small_for_one_batch() -> None:
    tokens = np.zeros(100, dtype=np.uint16)
    with pytest.raises(CorpusError, match="shard 3/4 has 25 tokens.*fewer than one batch"):
        ShardSampler(tokens, 3, 4, seq_len=8, batch_size=4, seed=0)
    with pytest.raises(ValueError, match="shard must be in"):
        ShardSampler(tokens, 4, 4, seq_len=8, batch_size=1, seed=0)


def test_heldout_batches_are_deterministic_and_bounded() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    batches = heldout_batches(tokens, seq_len=20, batch_size=8, max_batches=3)
    assert len(batches) == 3 and all(x.shape == (8, 20) for x, _ in batches)
    assert batches[0][0][0, 0].item() == 0 and batches[0][1][0, -1].item() == 20
    again = heldout_batches(tokens, seq_len=20, batch_size=8, max_batches=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    short = heldout_batches(tokens[:101], seq_len=20, batch_size=8, max_batches=3)
    assert [x.shape[0] for x, _ in short] == [5]
    with pytest.raises(CorpusError, match="fewer than one window"):
        heldout_batches(tokens[:10], seq_len=20, batch_size=8, max_batches=3)


def test_evaluate_matches_manual_token_weighted_loss() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, d_ff=32, seq_len=12)
    model = GPT(config).train()
    tokens = np.random.default_rng(0).integers(0, 64, size=400).astype(np.uint16)
    batches = heldout_batches(tokens, seq_len=12, batch_size=10, max_batches=4)
    assert [x.shape[0] for x, _ in batches] == [10, 10, 10, 3]
    loss = evaluate(model, batches)
    assert model.training  # mode restored
    with torch.no_grad():
        model.eval()
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        expected = model(x, y)[1]
    assert expected is not None
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert abs(loss - math.log(64)) < 0.2
