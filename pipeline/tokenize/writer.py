"""Token shards, their document indexes, and the manifest that describes them.

A shard ``{split}_{i:06d}.bin`` is raw little-endian ``uint16`` (``uint32`` for vocabularies over 65,536) holding
exactly ``shard_tokens`` tokens (the last of a split may hold fewer); ``{split}_{i:06d}.idx`` is ``uint32`` offsets of
the documents that start in it. Both are written under a temporary name and renamed when complete, so a partial
shard is never visible under its final name.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
FORMAT_VERSION = 2


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Appends documents' tokens to fixed-size shards of one split."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype):
        self.out_dir, self.split, self.shard_tokens, self.dtype = out_dir, split, shard_tokens, np.dtype(dtype)
        self.shards: list[dict] = []
        self.documents = 0
        self._buf = np.empty(shard_tokens, dtype=self.dtype)
        self._fill = 0
        self._starts: list[int] = []  # offsets of documents starting in the open shard

    def add_document(self, tokens: np.ndarray) -> bool:
        """Append one document; True when at least one shard was completed by it."""
        completed = False
        self.documents += 1
        self._starts.append(self._fill)
        while tokens.size:
            n = min(self.shard_tokens - self._fill, tokens.size)
            self._buf[self._fill:self._fill + n] = tokens[:n]
            self._fill += n
            tokens = tokens[n:]
            if self._fill == self.shard_tokens:
                self._flush()
                completed = True
        return completed

    def _flush(self) -> None:
        if not self._fill:
            return
        # a view, not a copy: the open shard's buffer is written and hashed in place
        data = memoryview(self._buf[:self._fill].astype(self.dtype.newbyteorder("<"), copy=False)).cast("B")
        index = np.asarray(self._starts, dtype="<u4").tobytes()
        name = f"{self.split}_{len(self.shards):06d}"
        atomic_write(self.out_dir / f"{name}.idx", index)
        atomic_write(self.out_dir / f"{name}.bin", data)
        self.shards.append({"file": f"{name}.bin", "tokens": self._fill, "documents": len(self._starts),
                            "sha256": hashlib.sha256(data).hexdigest(), "index_file": f"{name}.idx",
                            "index_sha256": hashlib.sha256(index).hexdigest()})
        self._fill, self._starts = 0, []

    def close(self) -> dict:
        self._flush()
        return {"tokens": sum(s["tokens"] for s in self.shards), "documents": self.documents, "shards": self.shards}

    # ------------------------------------------------------------------------ resume: the open shard's contents
    def snapshot(self, folder: Path, tag: int) -> dict:
        """Save the open shard as ``{split}.partial.{tag}``; the returned dict goes into the job's state file."""
        name = f"{self.split}.partial.{tag}"
        atomic_write(folder / name, memoryview(self._buf[:self._fill]).cast("B"))
        return {"shards": self.shards, "documents": self.documents, "fill": self._fill, "starts": self._starts,
                "partial": name}

    def restore(self, folder: Path, state: dict) -> None:
        self.shards, self.documents = state["shards"], state["documents"]
        self._fill, self._starts = state["fill"], list(state["starts"])
        data = np.frombuffer((folder / state["partial"]).read_bytes(), dtype=self.dtype)
        if data.size != self._fill:
            raise ValueError(f"{folder}: the saved open shard of {self.split} has {data.size} tokens, expected "
                             f"{self._fill}; delete {folder} to start the tokenization over")
        self._buf[:self._fill] = data


def write_manifest(out_dir: Path, manifest: dict) -> None:
    atomic_write(out_dir / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


def read_manifest(dataset_dir: str | Path) -> dict:
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no tokenized dataset at {dataset_dir} ({MANIFEST} missing): run "
                                f"`grt tokenize RECIPE` first, or point data.dataset_dir at a tokenized dataset")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {manifest.get('format_version')} is not {FORMAT_VERSION}; "
                         f"re-tokenize it with `grt tokenize RECIPE --force`")
    return manifest


def verify_dataset(dataset_dir: str | Path, checksums: bool = True) -> list[str]:
    """Recheck every shard and index against the manifest; returns the problems (empty: all good). ``checksums=False``
    skips the sha256 of each file (sizes and indexes are still checked): a quick look at a very large dataset."""
    d = Path(dataset_dir)
    m = read_manifest(d)
    itemsize = np.dtype(m["dtype"]).itemsize
    problems = []
    for split, info in m["splits"].items():
        total_tokens = total_docs = 0
        for sh in info["shards"]:
            for key, sha_key in (("file", "sha256"), ("index_file", "index_sha256")):
                f = d / sh[key]
                if not f.is_file():
                    problems.append(f"{split}: {sh[key]} is missing")
                    continue
                if not checksums:
                    continue
                h = hashlib.sha256()
                with open(f, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 24), b""):
                        h.update(block)
                if h.hexdigest() != sh[sha_key]:
                    problems.append(f"{split}: {sh[key]} sha256 {h.hexdigest()[:16]} != manifest {sh[sha_key][:16]}")
            f = d / sh["file"]
            if f.is_file() and f.stat().st_size != sh["tokens"] * itemsize:
                problems.append(f"{split}: {sh['file']} holds {f.stat().st_size // itemsize} tokens, manifest says "
                                f"{sh['tokens']}")
            idx = d / sh["index_file"]
            if idx.is_file():
                starts = np.fromfile(idx, dtype="<u4")
                if starts.size != sh["documents"] or (starts.size and (np.any(np.diff(starts.astype(np.int64)) <= 0)
                                                                       or starts[-1] >= sh["tokens"])):
                    problems.append(f"{split}: {sh['index_file']} is not {sh['documents']} increasing offsets "
                                    f"below {sh['tokens']}")
            total_tokens += sh["tokens"]
            total_docs += sh["documents"]
        if total_tokens != info["tokens"]:
            problems.append(f"{split}: shards hold {total_tokens} tokens, manifest total says {info['tokens']}")
        if total_docs != info["documents"]:
            problems.append(f"{split}: shard indexes list {total_docs} documents, manifest says {info['documents']}")
    return problems
