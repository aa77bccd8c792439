"""Exact deduplication: a set of 64-bit content hashes that stays compact at hundreds of millions of documents
(a sorted numpy array of 8-byte keys plus a small Python set of recent ones, merged when the set grows)."""
from __future__ import annotations

import numpy as np

MERGE_AT = 1 << 20


class HashSet64:
    def __init__(self):
        self._frozen = np.empty(0, dtype=np.uint64)
        self._recent: set[int] = set()
        self._new: list[int] = []  # added since the last `take_new` (persisted for resume)

    def __len__(self) -> int:
        return self._frozen.size + len(self._recent)

    def __contains__(self, h: int) -> bool:
        if h in self._recent:
            return True
        i = np.searchsorted(self._frozen, np.uint64(h))
        return bool(i < self._frozen.size and self._frozen[i] == h)

    def add_if_new(self, h: int) -> bool:
        if h in self:
            return False
        self._recent.add(h)
        self._new.append(h)
        if len(self._recent) >= MERGE_AT:
            self._merge()
        return True

    def _merge(self) -> None:
        self._frozen = np.union1d(self._frozen, np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent)))
        self._recent = set()

    def take_new(self) -> np.ndarray:
        out = np.asarray(self._new, dtype=np.uint64)
        self._new = []
        return out

    def load(self, hashes: np.ndarray) -> None:
        self._frozen = np.union1d(self._frozen, hashes.astype(np.uint64))
