"""Training data: memmapped token shards, cut into fixed windows, visited in a seeded order without replacement.

A sample is a window of ``seq_len + 1`` tokens starting at a multiple of ``seq_len`` inside one shard (inputs are
its first ``seq_len`` tokens, targets the last ``seq_len``). Each epoch visits every window once in the order of a
permutation seeded by (seed, epoch). The loader's whole state is one global cursor (samples consumed by all ranks
together), so a resume continues exactly where the run stopped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from pipeline.tokenize.writer import read_manifest

LOADER_STATE_VERSION = 1


class TokenShards:
    """The shards of one split of a tokenized dataset, memory-mapped (nothing is read until used)."""

    def __init__(self, dataset_dir: str | Path, split: str):
        self.dir = Path(dataset_dir)
        self.manifest = read_manifest(self.dir)
        if split not in self.manifest["splits"]:
            raise KeyError(f"{self.dir}: no split {split!r} (have {sorted(self.manifest['splits'])})")
        dtype = np.dtype(self.manifest["dtype"])
        self.arrays = [np.memmap(self.dir / s["file"], dtype=dtype, mode="r")
                       for s in self.manifest["splits"][split]["shards"]]
        self.tokens = sum(a.size for a in self.arrays)

    def window_index(self, seq_len: int) -> np.ndarray:
        """(shard, start) of every full window of ``seq_len + 1`` tokens."""
        parts = []
        for i, a in enumerate(self.arrays):
            n = (a.size - 1) // seq_len
            parts.append(np.stack([np.full(n, i), np.arange(n) * seq_len], axis=1))
        return np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)

    def window(self, shard: int, start: int, seq_len: int) -> np.ndarray:
        return np.asarray(self.arrays[shard][start:start + seq_len + 1], dtype=np.int64)


def _batch(shards: TokenShards, index: np.ndarray, rows: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.from_numpy(np.stack([shards.window(int(index[r, 0]), int(index[r, 1]), seq_len) for r in rows]))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class SequenceLoader:
    """Micro-batches of (inputs, targets) for one rank; every window exactly once per epoch over all ranks."""

    def __init__(self, shards: TokenShards, seq_len: int, micro_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        self.shards, self.seq_len, self.batch = shards, seq_len, micro_batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.index = shards.window_index(seq_len)
        self.n_samples = len(self.index)
        if self.n_samples < micro_batch_size * world_size:
            raise ValueError(f"the dataset at {shards.dir} has {self.n_samples} windows of {seq_len + 1} tokens, "
                             f"fewer than one global micro-batch ({micro_batch_size} x {world_size} ranks); "
                             f"tokenize more text or lower train.micro_batch_size / model.block_size")
        self.cursor = 0  # samples consumed over all ranks
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n_samples, generator=gen).numpy(), epoch
        return self._perm

    def _rows(self, start: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for i in range(count):
            g = start + i
            out[i] = self._permutation(g // self.n_samples)[g % self.n_samples]
        return out

    @property
    def epoch(self) -> float:
        return self.cursor / self.n_samples

    def next_indices(self) -> np.ndarray:
        """This rank's window numbers for the next micro-batch (advances the global cursor)."""
        rows = self._rows(self.cursor + self.rank * self.batch, self.batch)
        self.cursor += self.batch * self.world_size
        return rows

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(self.shards, self.index, self.next_indices(), self.seq_len)

    def state_dict(self) -> dict:
        return {"version": LOADER_STATE_VERSION, "cursor": self.cursor, "seed": self.seed,
                "n_samples": self.n_samples, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        problems = []
        if state.get("version") != LOADER_STATE_VERSION:
            problems.append(f"loader state version {state.get('version')} != {LOADER_STATE_VERSION}")
        for key in ("seed", "n_samples", "seq_len"):
            if state.get(key) != getattr(self, key):
                problems.append(f"{key}: checkpoint {state.get(key)} != now {getattr(self, key)}")
        if problems:
            raise ValueError("cannot resume the data loader: " + "; ".join(problems) +
                             ". The dataset or the recipe's seed / block_size changed since the checkpoint; restore "
                             "them or start a new run (train.resume=never).")
        self.cursor = int(state["cursor"])


def validation_batches(shards: TokenShards, seq_len: int, batch_size: int, max_tokens: int | None = None,
                       max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The validation windows in file order (the same for every run), up to a token or batch budget."""
    index = shards.window_index(seq_len)
    n = len(index)
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq_len))
    if n == 0:
        raise ValueError(f"the validation split at {shards.dir} is shorter than one window of {seq_len + 1} tokens; "
                         f"raise data.val_fraction or lower model.block_size")
    for b, start in enumerate(range(0, n, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        yield _batch(shards, index, np.arange(start, min(start + batch_size, n)), seq_len)
