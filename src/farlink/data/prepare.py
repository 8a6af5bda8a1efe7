"""From a source name to token arrays every island agrees on.

The held-out split is a fixed, evenly spread set of whole documents, so held-out loss measures
text no worker trained on and is comparable between runs and workers. Token arrays are cached as
.npy under a fingerprint of (documents, tokenizer, split), which workers can also compare to
prove they train on the same data.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from farlink.data.corpus import CorpusError, load_documents
from farlink.data.tokenizer import (
    corpus_fingerprint,
    eot_id,
    get_tokenizer,
    load_tokenizer,
)
from farlink.state.files import atomic_write


@dataclass(frozen=True)
class PreparedData:
    """Token ids of both splits (each document followed by end-of-text) and how they were made."""

    train: np.ndarray
    heldout: np.ndarray
    tokenizer: Tokenizer
    vocab_size: int  # the tokenizer's actual size, which may be below the requested one
    fingerprint: str  # sha256 of documents + tokenizer + split: equal means identical data


def heldout_indices(num_documents: int, fraction: float) -> list[int]:
    """Evenly spaced document indices (every 1/fraction-th); at least one train and one held-out."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {fraction}")
    if num_documents < 2:
        raise CorpusError(f"need at least 2 documents to hold one out, got {num_documents}")
    count = min(num_documents - 1, max(1, round(num_documents * fraction)))
    step = num_documents / count
    return [int((k + 0.5) * step) for k in range(count)]


def split_documents(documents: Sequence[str],
                    fraction: float) -> tuple[list[str], list[str]]:
    held = set(heldout_indices(len(documents), fraction))
    train = [d for i, d in enumerate(documents) if i not in held]
    heldout = [d for i, d in enumerate(documents) if i in held]
    return train, heldout


def encode_documents(tokenizer: Tokenizer, documents: Sequence[str]) -> np.ndarray:
    """Concatenated ids, each document followed by end-of-text; the narrowest dtype that fits."""
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.int32
    eot = eot_id(tokenizer)
    pieces = []
    for encoding in tokenizer.encode_batch(list(documents), add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids, dtype=dtype))
        pieces.append(np.asarray([eot], dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def _save_npy(path: Path, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    atomic_write(path, buffer.getvalue())


def prepare_data(source: str | os.PathLike[str], vocab_size: int, cache_dir: Path,
                 heldout_fraction: float = 0.05,
                 tokenizer: str | os.PathLike[str] | None = None) -> PreparedData:
    """Load ``source``, split it, train/load the tokenizer on the train split (or use the given
    ``tokenizer`` file/directory, whose own vocabulary then sets the size), encode both."""
    cache_dir = Path(cache_dir)
    given = load_tokenizer(tokenizer) if tokenizer is not None else None  # fails before reading
    documents = load_documents(source)
    train_docs, heldout_docs = split_documents(documents, heldout_fraction)
    tok = given if given is not None else get_tokenizer(train_docs, vocab_size, cache_dir)
    tokenizer_hash = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
    fingerprint = hashlib.sha256(
        f"{corpus_fingerprint(documents)}|{tokenizer_hash}|{heldout_fraction!r}".encode()
    ).hexdigest()
    paths = {split: cache_dir / f"tokens-{fingerprint[:20]}-{split}.npy"
             for split in ("train", "heldout")}
    arrays: dict[str, np.ndarray] = {}
    for split, docs in (("train", train_docs), ("heldout", heldout_docs)):
        path = paths[split]
        if path.is_file():
            arrays[split] = np.load(path, allow_pickle=False)
        else:
            arrays[split] = encode_documents(tok, docs)
            _save_npy(path, arrays[split])
    return PreparedData(train=arrays["train"], heldout=arrays["heldout"], tokenizer=tok,
                        vocab_size=tok.get_vocab_size(), fingerprint=fingerprint)

