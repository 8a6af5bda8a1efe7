"""Training data: local sources, a locally trained BPE, and deterministic per-worker shards."""

from farlink.data.corpus import CorpusError, kjv_path, load_documents
from farlink.data.eval import evaluate, perplexity
from farlink.data.prepare import PreparedData, heldout_indices, prepare_data, split_documents
from farlink.data.sampler import ShardSampler, heldout_batches, shard_bounds
from farlink.data.tokenizer import (
    EOT_TOKEN,
    corpus_fingerprint,
    eot_id,
    get_tokenizer,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "EOT_TOKEN",
    "CorpusError",
    "PreparedData",
    "ShardSampler",
    "corpus_fingerprint",
    "eot_id",
    "evaluate",
    "get_tokenizer",
    "heldout_batches",
    "heldout_indices",
    "kjv_path",
    "load_documents",
    "load_tokenizer",
    "perplexity",
    "prepare_data",
    "shard_bounds",
    "split_documents",
    "train_tokenizer",
]
