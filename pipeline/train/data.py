"""Training data: memmapped token shards, cut into fixed windows, visited in a seeded order without replacement.

A sample is a window of ``seq_len + 1`` tokens starting at a multiple of ``seq_len`` inside one shard (inputs are
its first ``seq_len`` tokens, targets the last ``seq_len``). Each epoch visits every window once in the order of a
permutation seeded by (seed, epoch). The loader's state is a handful of counters over all ranks together, so a
resume continues exactly where the run stopped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from pipeline.tokenize.writer import read_manifest

LOADER_STATE_VERSION = 2


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

    def window_at(self, index: np.ndarray, row: int, seq_len: int) -> np.ndarray:
        """Window number ``row`` of ``index`` (from :meth:`window_index`)."""
        return self.window(int(index[row, 0]), int(index[row, 1]), seq_len)


def _to_batch(windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.from_numpy(np.stack(windows))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class SequenceLoader:
    """Micro-batches of (inputs, targets) for one rank from one dataset or a weighted mixture of several.

    Global sample g (counted over all ranks) is drawn from dataset k chosen by smooth weighted round-robin, so
    each dataset's share of any run of samples is within one sample of its weight; within a dataset, windows are
    visited without replacement in a seeded order per epoch. Every rank computes the same global sequence and
    takes its own slice, so every window is used exactly once per epoch over all ranks.
    """

    def __init__(self, shards: TokenShards | list[TokenShards], seq_len: int, micro_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, weights: list[float] | None = None):
        self.datasets = shards if isinstance(shards, list) else [shards]
        self.weights = [float(w) for w in (weights or [1.0] * len(self.datasets))]
        if len(self.weights) != len(self.datasets):
            raise ValueError(f"{len(self.datasets)} datasets but {len(self.weights)} weights")
        self.seq_len, self.batch = seq_len, micro_batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.index = [d.window_index(seq_len) for d in self.datasets]
        self.n_samples = [len(i) for i in self.index]
        for d, n in zip(self.datasets, self.n_samples):
            if n < 1:
                raise ValueError(f"the dataset at {d.dir} has no window of {seq_len + 1} tokens; tokenize more text "
                                 f"or lower model.block_size")
        self.counts = [0] * len(self.datasets)  # samples consumed over all ranks, per dataset
        self.current = [0.0] * len(self.datasets)  # smooth weighted round-robin state
        self._perm_key, self._perm = None, None

    def _row(self, k: int, j: int) -> int:
        """Window number of the j-th sample drawn from dataset k."""
        n = self.n_samples[k]
        epoch = j // n
        if self._perm_key != (k, epoch):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 7919 + k)
            self._perm, self._perm_key = torch.randperm(n, generator=gen).numpy(), (k, epoch)
        return int(self._perm[j % n])

    def _pick(self) -> int:
        total = sum(self.weights)
        self.current = [c + w for c, w in zip(self.current, self.weights)]
        k = max(range(len(self.current)), key=lambda i: self.current[i])
        self.current[k] -= total
        return k

    def next_indices(self) -> list[tuple[int, int]]:
        """This rank's (dataset, window) pairs for the next micro-batch; advances the global state."""
        picks = []
        for g in range(self.batch * self.world_size):
            k = self._pick()
            picks.append((k, self.counts[k]))
            self.counts[k] += 1
        mine = picks[self.rank * self.batch:(self.rank + 1) * self.batch]
        return [(k, self._row(k, j)) for k, j in mine]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _to_batch([self.datasets[k].window_at(self.index[k], r, self.seq_len) for k, r in self.next_indices()])

    @property
    def epoch(self) -> float:
        return self.counts[0] / self.n_samples[0]

    def state_dict(self) -> dict:
        return {"version": LOADER_STATE_VERSION, "counts": list(self.counts),
                "current": list(self.current), "seed": self.seed, "n_samples": list(self.n_samples),
                "seq_len": self.seq_len, "weights": list(self.weights)}

    def load_state_dict(self, state: dict) -> None:
        problems = []
        if state.get("version") != LOADER_STATE_VERSION:
            problems.append(f"loader state version {state.get('version')} != {LOADER_STATE_VERSION}")
        for key in ("seed", "n_samples", "seq_len", "weights"):
            if state.get(key) != getattr(self, key):
                problems.append(f"{key}: checkpoint {state.get(key)} != now {getattr(self, key)}")
        if problems:
            raise ValueError("cannot resume the data loader: " + "; ".join(problems) +
                             ". The dataset, its mixture weights or the recipe's seed / block_size changed since the "
                             "checkpoint; restore them or start a new run (train.resume=never).")
        self.counts, self.current = list(state["counts"]), list(state["current"])


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
        yield _to_batch([shards.window_at(index, r, seq_len) for r in range(start, min(start + batch_size, n))])
