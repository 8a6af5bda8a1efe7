"""A byte-level BPE tokenizer trained locally and cached by what it was trained on, or one the
user gives (``--tokenizer FILE|DIR``: a ``tokenizer.json`` or a Hugging Face tokenizer directory).

Islands cannot download a tokenizer (no network) and must agree on token ids exactly, so each
trains the same deterministic BPE on the same documents and the result is cached under a key
derived from the corpus fingerprint and vocabulary size: a second run, or a second worker on the
same machine, loads the JSON instead of retraining. Byte-level means any UTF-8 text round-trips.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from farlink.data.corpus import CorpusError
from farlink.state.files import atomic_write

EOT_TOKEN = "<|endoftext|>"
#: document separators tried in order: farlink's own, then those of common given tokenizers
#: (GPT-2/NeoX, Llama 3, Llama 2/Mistral/T5, Gemma, BERT)
END_OF_TEXT_TOKENS = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
_FORMAT = "farlink-bpe-v1"  # bump when the recipe changes so old caches are not reused
MIN_VOCAB = 256 + 1  # every byte plus the end-of-text token


def corpus_fingerprint(documents: Sequence[str]) -> str:
    """SHA-256 over the documents, length-prefixed so document boundaries count too."""
    digest = hashlib.sha256()
    for document in documents:
        data = document.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def tokenizer_cache_path(cache_dir: Path, fingerprint: str, vocab_size: int) -> Path:
    key = hashlib.sha256(f"{_FORMAT}|{fingerprint}|{vocab_size}".encode()).hexdigest()[:20]
    return Path(cache_dir) / f"tokenizer-{key}.json"


def _train(documents: Sequence[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def train_tokenizer(documents: Sequence[str], vocab_size: int,
                    cache_dir: Path | None = None) -> Tokenizer:
    """Train (or, with ``cache_dir``, load the cached) byte-level BPE for ``documents``.

    The returned vocabulary may be smaller than ``vocab_size`` on small corpora; use
    ``tokenizer.get_vocab_size()`` for the model.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB} (256 bytes + "
                         f"{EOT_TOKEN}), got {vocab_size}")
    if vocab_size > 2**31 - 1:
        raise ValueError(f"vocab_size {vocab_size} is too large")
    if not documents:
        raise ValueError("cannot train a tokenizer on no documents")
    if cache_dir is None:
        return _train(documents, vocab_size)
    path = tokenizer_cache_path(cache_dir, corpus_fingerprint(documents), vocab_size)
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = _train(documents, vocab_size)
    atomic_write(path, tokenizer.to_str().encode("utf-8"))
    return tokenizer


def get_tokenizer(documents: Sequence[str], vocab_size: int, cache_dir: Path) -> Tokenizer:
    """The cached tokenizer for ``documents``; trains and stores it on first use."""
    return train_tokenizer(documents, vocab_size, cache_dir)


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A given tokenizer: a ``tokenizer.json`` file, or a directory holding one (what
    ``save_pretrained`` writes for every fast Hugging Face tokenizer)."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        hint = ("it has no tokenizer.json; save a fast tokenizer there with "
                "AutoTokenizer.from_pretrained(...).save_pretrained(DIR)" if path.is_dir()
                else "give a tokenizer.json file or a Hugging Face tokenizer directory")
        raise CorpusError(f"tokenizer {str(path)!r} not found: {hint}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises a bare Exception for malformed JSON
        raise CorpusError(f"{file} is not a tokenizers JSON file: {exc}") from exc
    eot_id(tokenizer)  # fail now, not after the corpus is read, if it cannot separate documents
    return tokenizer


def eot_id(tokenizer: Tokenizer) -> int:
    """The id that ends each document: the first of :data:`END_OF_TEXT_TOKENS` it knows."""
    for token in END_OF_TEXT_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise CorpusError(f"tokenizer has none of the end-of-text tokens "
                      f"{', '.join(END_OF_TEXT_TOKENS)}; farlink separates documents with one "
                      "(add it as a special token)")


def eot_token(tokenizer: Tokenizer) -> str:
    token = tokenizer.id_to_token(eot_id(tokenizer))
    assert token is not None
    return token
