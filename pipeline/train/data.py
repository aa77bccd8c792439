"""Training data: memmapped token shards, cut into fixed windows, visited in a seeded order without replacement.

A sample is a window of ``seq_len + 1`` tokens starting at a multiple of ``seq_len`` inside one shard (inputs are
its first ``seq_len`` tokens, targets the last ``seq_len``). Each epoch visits every window once in the order of a
permutation seeded by (seed, epoch). The loader's state is a handful of counters over all ranks together, so a
resume continues exactly where the run stopped.

Document masking (``data.document_masking``): a batch also carries ``docs`` [B, T], the index of the document each
input token belongs to inside its window (0 for the document under way at the window's start, +1 at every document
that starts in it), for the model's block-causal mask and per-document positions. It is read from the shard's
``.idx`` file (the writer's record of where each document starts) wherever the dataset has one, and from the
tokenizer's end-of-text id (manifest ``eot_id``: a new document starts after each) only for a shard without one.
The index is preferred because it records documents, not a convention about special tokens: it stays right for a
tokenizer that opens documents with BOS, or one that can produce the EOS id inside a document, and reading it costs
4 bytes per document. The two agree on this pipeline's own datasets (the tokenizer appends EOS to every document and
never emits it inside one; tests/test_document_masking_pipeline.py checks that). The end-of-text token belongs to the
document it ends: predicting the next document's first token from it is the one target that crosses a boundary, as
without masking. ``docs`` is a pure function of the window, so the loader's state and resume are unchanged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator
from typing import NamedTuple

import numpy as np
import torch

from pipeline.model.layout import documents_from_eos
from pipeline.model.layout import documents_from_starts
from pipeline.tokenize.writer import bad_ids_text
from pipeline.tokenize.writer import read_manifest
from pipeline.tokenize.writer import scan_shard
from pipeline.tokenize.writer import shard_size_problem

LOADER_STATE_VERSION = 2


class Batch(NamedTuple):
    """One micro-batch: ``inputs`` and ``targets`` [B, T]; ``docs`` [B, T] the document index of each input token
    under document masking, else None."""

    inputs: torch.Tensor
    targets: torch.Tensor
    docs: torch.Tensor | None = None

    def to(self, device, non_blocking: bool = False) -> "Batch":
        return Batch(*(None if t is None else t.to(device, non_blocking=non_blocking) for t in self))

    def model_kwargs(self) -> dict:
        """``docs=`` for the model's forward, or nothing without document masking (the paper's call, unchanged)."""
        return {} if self.docs is None else {"docs": self.docs}


def batch_parts(batch, device=None) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(inputs, targets, the model's extra keyword arguments: ``docs=`` under document masking, else none) of a
    :class:`Batch` or of a plain (inputs, targets) pair, moved to ``device`` when given."""
    b = Batch(*batch)
    if device is not None:
        b = b.to(device)
    return b.inputs, b.targets, b.model_kwargs()


class TokenShards:
    """The shards of one split of a tokenized dataset, memory-mapped (nothing is read until used). A shard file of
    another size than its manifest says is mapped as it is: :func:`check_shards` reports it before training."""

    def __init__(self, dataset_dir: str | Path, split: str):
        self.dir = Path(dataset_dir)
        self.split = split
        self.manifest = read_manifest(self.dir)
        if split not in self.manifest["splits"]:
            raise KeyError(f"{self.dir}: no split {split!r} (have {sorted(self.manifest['splits'])})")
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")  # the writer's byte order on any machine
        self.n_vocab = self.manifest["tokenizer"]["n_vocab"]
        self.shards = self.manifest["splits"][split]["shards"]  # their manifest entries
        missing = [s["file"] for s in self.shards if not (self.dir / s["file"]).is_file()]
        if missing:
            raise FileNotFoundError(
                f"the {split} split of the dataset at {self.dir} misses {len(missing)} of its {len(self.shards)} "
                f"shard files ({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}): restore them or "
                f"re-tokenize (grt tokenize RECIPE --force); `grt data verify {self.dir}` lists every problem")
        self.arrays = [self._map(self.dir / s["file"]) for s in self.shards]
        self.tokens = sum(a.size for a in self.arrays)
        self.eot_id = self.manifest["tokenizer"]["eot_id"]
        self._starts: dict[int, np.ndarray | None] = {}  # shard -> its document starts (None: no .idx), read once

    def _map(self, path: Path) -> np.ndarray:
        n = path.stat().st_size // self.dtype.itemsize  # a trailing partial token is left out
        if n == 0:  # mmap refuses an empty file
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(n,))

    def window_index(self, seq_len: int) -> np.ndarray:
        """(shard, start) of every full window of ``seq_len + 1`` tokens."""
        parts = []
        for i, a in enumerate(self.arrays):
            n = max(a.size - 1, 0) // seq_len
            parts.append(np.stack([np.full(n, i), np.arange(n) * seq_len], axis=1))
        return np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)

    def window(self, shard: int, start: int, seq_len: int) -> np.ndarray:
        return np.asarray(self.arrays[shard][start:start + seq_len + 1], dtype=np.int64)

    def document_starts(self, shard: int) -> np.ndarray | None:
        """The offsets of the documents that start in ``shard``, from its ``.idx`` file; None when it has none."""
        if shard not in self._starts:
            path = self.dir / self.shards[shard].get("index_file", "")
            self._starts[shard] = (np.fromfile(path, dtype="<u4").astype(np.int64)
                                   if self.shards[shard].get("index_file") and path.is_file() else None)
        return self._starts[shard]

    def window_docs(self, shard: int, start: int, seq_len: int, window: np.ndarray) -> torch.Tensor:
        """[seq_len] the document index of the inputs of the window at ``start`` (see the module doc)."""
        starts = self.document_starts(shard)
        if starts is not None:
            return documents_from_starts(start, seq_len, starts)
        return documents_from_eos(torch.from_numpy(window[:seq_len]), self.eot_id)

    def id_limit(self, vocab_size: int | None) -> tuple[int, str]:
        """The bound every token id must stay under, and its words: the tokenizer's vocabulary, or the model's
        when that is smaller (a dataset that does not fit the model is refused before; this is the last guard)."""
        if vocab_size is not None and vocab_size < self.n_vocab:
            return vocab_size, "the model's vocabulary size (model.vocab_size)"
        return self.n_vocab, "the tokenizer's vocabulary size (n_vocab)"

    def bad_id_error(self, window: np.ndarray, shard: int, start: int, limit: int, words: str) -> ValueError:
        """The error for a window holding a token id >= ``limit``: where the first one is, and what finds all."""
        i = int(np.argmax(window >= limit))
        return ValueError(
            f"token id {int(window[i])} at token offset {start + i:,} of {self.dir / self.shards[shard]['file']} "
            f"is >= {words} {limit:,}: the dataset is damaged. `grt data verify {self.dir}` finds every such id; "
            f"re-tokenize it (grt tokenize RECIPE --force)")


def _checked_batch(windows: list[np.ndarray], where: list[tuple[TokenShards, int, int]],
                   limits: list[tuple[int, str]] | None, docs_len: int | None = None) -> Batch:
    """Stack windows into a :class:`Batch`; with ``limits`` (one per window), first make sure every id is below
    its window's limit: an id out of range would reach the embedding as `index out of range in self`. With
    ``docs_len`` (seq_len, under document masking) the batch carries each window's ``docs``."""
    data = np.stack(windows)
    if limits is not None:
        over = np.flatnonzero(data.max(axis=1) >= np.array([lim for lim, _ in limits]))
        if over.size:
            r = int(over[0])
            shards, shard, start = where[r]
            raise shards.bad_id_error(data[r], shard, start, *limits[r])
    t = torch.from_numpy(data)
    docs = None if docs_len is None else torch.stack([shards.window_docs(shard, start, docs_len, w)
                                                      for (shards, shard, start), w in zip(where, windows)])
    return Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), docs)


# ------------------------------------------------------------------------------ checks before step 1
MAX_LISTED = 5  # shards named in one message; `grt data verify` lists them all


def check_shards(shards: TokenShards, vocab_size: int | None = None, verify: str = "size",
                 share: tuple[int, int] = (0, 1)) -> list[str]:
    """Every shard of the split against its manifest entry: its size (a stat per file: cheap) and, with ``verify``
    "full", its sha256 and every token id below :meth:`TokenShards.id_limit` (reads the whole split once; with
    ``share=(rank, world)`` only every world-th shard from rank: the ranks of a job split the reading).
    Returns one problem per damaged split, naming each shard with both numbers and the fix; empty when all is good."""
    if verify not in ("size", "full"):
        raise ValueError(f"verify={verify!r}: expected 'size' or 'full' (data.verify)")
    limit, words = shards.id_limit(vocab_size)
    facts = []
    rank, world = share
    for i, s in enumerate(shards.shards):
        path, itemsize = shards.dir / s["file"], shards.dtype.itemsize
        wrong_size = shard_size_problem(s["file"], path.stat().st_size, s["tokens"], itemsize)
        if wrong_size:
            facts.append(wrong_size)
            continue  # its sha256 cannot match: one fact per shard
        if verify == "full" and i % world == rank:
            scan = scan_shard(path, shards.manifest["dtype"], limit)
            if scan["bad_ids"]:
                facts.append(bad_ids_text(s["file"], scan, limit, words))
            if scan["sha256"] != s["sha256"]:
                facts.append(f"{s['file']} has sha256 {scan['sha256'][:16]}..., the manifest says "
                             f"{s['sha256'][:16]}...")
    if not facts:
        return []
    more = f" (and {len(facts) - MAX_LISTED} more)" if len(facts) > MAX_LISTED else ""
    return [f"the {shards.split} split of the dataset at {shards.dir} does not match its manifest: "
            f"{'; '.join(facts[:MAX_LISTED])}{more}. `grt data verify {shards.dir}` lists every problem; restore the "
            f"files or re-tokenize (grt tokenize RECIPE --force)"]


def window_problems(shards: TokenShards, seq_len: int, more_text: str) -> list[str]:
    """Why the split has no window of ``seq_len + 1`` tokens (empty when it has one); ``more_text`` says where more
    text would come from. Windows never cross shards, so ``shard_tokens`` can be the limit rather than the text."""
    if any(a.size > seq_len for a in shards.arrays):  # one shard holding a window is enough
        return []
    where = f"the {shards.split} split of the dataset at {shards.dir}"
    shard_tokens = shards.manifest["shard_tokens"]
    if shard_tokens < seq_len + 1:
        return [f"{where} has no window of {seq_len + 1:,} tokens (model.block_size+1): data.shard_tokens="
                f"{shard_tokens:,} < model.block_size+1={seq_len + 1:,} and windows never cross shards; raise "
                f"data.shard_tokens and re-tokenize (grt tokenize RECIPE --force), or lower model.block_size"]
    return [f"{where} holds {shards.tokens:,} tokens, fewer than one window of {seq_len + 1:,} "
            f"(model.block_size+1); {more_text}, or lower model.block_size"]


def validation_hint(has_validation_sources: bool, val_fraction: float | None) -> str:
    """How to get a longer validation split: the knob that made it."""
    if has_validation_sources:
        return "add text to data.validation_sources and re-tokenize"
    return "raise data.val_fraction" + (f" (now {val_fraction:g})" if val_fraction is not None else "") + \
        " and re-tokenize"


def check_windows(train: list[TokenShards], val: TokenShards | None, seq_len: int, *,
                  has_validation_sources: bool, val_fraction: float) -> list[str]:
    """Every problem with the windows training will cut, before step 1: each training dataset and the validation
    split need at least one window of ``seq_len + 1`` tokens. ``has_validation_sources`` and ``val_fraction`` are
    the recipe's data settings, so that the hint names the knob that made the validation split."""
    problems = []
    for d in train:
        problems += window_problems(d, seq_len, "tokenize more text into it")
    if val is not None:
        problems += window_problems(val, seq_len, validation_hint(has_validation_sources, val_fraction))
    return problems


class SequenceLoader:
    """Micro-batches of (inputs, targets) for one rank from one dataset or a weighted mixture of several.

    Global sample g (counted over all ranks) is drawn from dataset k chosen by smooth weighted round-robin, so
    each dataset's share of any run of samples is within one sample of its weight; within a dataset, windows are
    visited without replacement in a seeded order per epoch. Every rank computes the same global sequence and
    takes its own slice, so every window is used exactly once per epoch over all ranks.
    """

    def __init__(self, shards: TokenShards | list[TokenShards], seq_len: int, micro_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, weights: list[float] | None = None,
                 vocab_size: int | None = None, pin_memory: bool = False, document_masking: bool = False):
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
                raise ValueError(window_problems(d, seq_len, "tokenize more text into it")[0])
        # every window's largest id is checked against this (None: unchecked) before it leaves the loader
        self.limits = None if vocab_size is None else [d.id_limit(vocab_size) for d in self.datasets]
        # page-locked batches (for a CUDA device): only from pinned memory is a non_blocking copy asynchronous; from
        # pageable memory the driver may first wait for the work queued on the stream, so the host cannot run ahead
        self.pin_memory = pin_memory
        self.document_masking = document_masking  # batches carry docs (a function of the window: no state)
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

    def next_batch(self) -> Batch:
        picks = self.next_indices()
        where = [(self.datasets[k], int(self.index[k][r, 0]), int(self.index[k][r, 1])) for k, r in picks]
        batch = _checked_batch([d.window(shard, start, self.seq_len) for d, shard, start in where], where,
                               None if self.limits is None else [self.limits[k] for k, _ in picks],
                               self.seq_len if self.document_masking else None)
        return Batch(*(None if t is None else t.pin_memory() for t in batch)) if self.pin_memory else batch

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
                       max_batches: int | None = None,
                       vocab_size: int | None = None, document_masking: bool = False) -> Iterator[Batch]:
    """The validation windows in file order (the same for every run), up to a token or batch budget; with
    ``vocab_size``, every id is checked to be in range (as in :class:`SequenceLoader`); with ``document_masking``
    each batch carries its ``docs``."""
    index = shards.window_index(seq_len)
    n = len(index)
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq_len))
    if n == 0:
        made = shards.manifest.get("data_config") or {}  # the settings that made the split, when recorded
        fraction = made.get("val_fraction")
        hint = validation_hint(bool(made.get("validation_sources")),
                               fraction if isinstance(fraction, (int, float)) else None)
        raise ValueError(window_problems(shards, seq_len, hint)[0])
    limit = None if vocab_size is None else shards.id_limit(vocab_size)
    for b, start in enumerate(range(0, n, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        where = [(shards, int(index[r, 0]), int(index[r, 1])) for r in range(start, min(start + batch_size, n))]
        yield _checked_batch([shards.window(shard, st, seq_len) for _, shard, st in where], where,
                             None if limit is None else [limit] * len(where), seq_len if document_masking else None)
