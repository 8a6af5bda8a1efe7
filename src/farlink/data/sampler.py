"""Deterministic, resumable batches for one worker's disjoint shard of the train tokens.

Each worker owns a contiguous 1/num_shards slice, so no two workers train on the same tokens
and the union of shards is the whole corpus. Window order within a shard is a permutation seeded
by (seed, shard, epoch): reproducible anywhere without communication, and a worker that restarts
from ``state_dict()`` sees exactly the batches it would have seen, so no committed work is redone
and none is skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from farlink.data.corpus import CorpusError


def shard_bounds(num_tokens: int, shard: int, num_shards: int) -> tuple[int, int]:
    """[start, end) of ``shard``'s contiguous slice; slices are disjoint and cover everything."""
    if num_shards <= 0:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
    return shard * num_tokens // num_shards, (shard + 1) * num_tokens // num_shards


def _windows_to_tensors(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.from_numpy(windows.astype(np.int64))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class ShardSampler:
    """Batches of (inputs, targets) drawn from windows of ``seq_len + 1`` tokens of one shard."""

    def __init__(self, tokens: np.ndarray, shard: int, num_shards: int, seq_len: int,
                 batch_size: int, seed: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len}, "
                             f"{batch_size}")
        self.shard = shard
        self.num_shards = num_shards
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.start, self.end = shard_bounds(len(tokens), shard, num_shards)
        self._tokens = tokens[self.start:self.end]
        # Windows overlap by one token: window i covers [i*T, i*T + T], targets shift by one.
        self.num_windows = max(0, (len(self._tokens) - 1) // seq_len)
        if self.num_windows < batch_size:
            raise CorpusError(
                f"shard {shard}/{num_shards} has {len(self._tokens)} tokens, enough for "
                f"{self.num_windows} windows of {seq_len + 1}, fewer than one batch of "
                f"{batch_size}; use fewer shards, a shorter seq_len, a smaller batch or more text")
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_windows // self.batch_size

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.shard, self.num_shards, epoch])
        return rng.permutation(self.num_windows)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next [batch_size, seq_len] inputs and targets; a partial tail starts a new epoch."""
        if self.position + self.batch_size > self.num_windows:
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        starts = self._order[self.position:self.position + self.batch_size] * self.seq_len
        self.position += self.batch_size
        offsets = np.arange(self.seq_len + 1)
        return _windows_to_tensors(self._tokens[starts[:, None] + offsets[None, :]])

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position, plus the settings a resume must match."""
        return {"epoch": self.epoch, "position": self.position, "shard": self.shard,
                "num_shards": self.num_shards, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "seed": self.seed,
                "num_windows": self.num_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off; refuses a state from a different configuration."""
        for key in ("shard", "num_shards", "seq_len", "batch_size", "seed", "num_windows"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has "
                                 f"{getattr(self, key)!r}; it belongs to another configuration")
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"sampler state needs integer 'epoch' and 'position': {state}") \
                from exc
        if epoch < 0 or not 0 <= position <= self.num_windows:
            raise ValueError(f"sampler state out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)


    def advance_to(self, state: dict[str, Any]) -> bool:
        """Continue from ``state`` (another sampler's :meth:`state_dict` on this shard) if it is
        further along than this one; True if it moved. Never moves back: a taken-over shard
        resumes where its furthest committed holder stood."""
        theirs = (int(state["epoch"]), int(state["position"]))
        if theirs <= (self.epoch, self.position):
            return False
        self.load_state_dict(state)
        return True


def heldout_batches(tokens: np.ndarray, seq_len: int, batch_size: int,
                    max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive windows from the start of ``tokens``: the same list on every worker.

    The last batch may be smaller than ``batch_size`` when the held-out text runs out.
    """
    if seq_len <= 0 or batch_size <= 0 or max_batches <= 0:
        raise ValueError("seq_len, batch_size and max_batches must be positive")
    num_windows = min(max(0, (len(tokens) - 1) // seq_len), batch_size * max_batches)
    if num_windows == 0:
        raise CorpusError(f"held-out text has {len(tokens)} tokens, fewer than one window of "
                          f"{seq_len + 1}")
    offsets = np.arange(seq_len + 1)
    batches = []
    for first in range(0, num_windows, batch_size):
        starts = np.arange(first, min(first + batch_size, num_windows)) * seq_len
        batches.append(_windows_to_tensors(tokens[starts[:, None] + offsets[None, :]]))
    return batches
