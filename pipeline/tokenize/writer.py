"""Token shards and the manifest that describes them."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class ShardWriter:
    """Appends token arrays to fixed-size ``{split}_{i:06d}.bin`` files (raw little-endian ``dtype``)."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype):
        self.out_dir, self.split, self.shard_tokens, self.dtype = out_dir, split, shard_tokens, np.dtype(dtype)
        self.shards: list[dict] = []
        self._buf: list[np.ndarray] = []
        self._buf_tokens = 0
        self._buf_docs = 0
        self.documents = 0

    def add_document(self, tokens: list[int]) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self.documents += 1
        self._buf_docs += 1
        while arr.size:
            room = self.shard_tokens - self._buf_tokens
            self._buf.append(arr[:room])
            self._buf_tokens += min(room, arr.size)
            arr = arr[room:]
            if self._buf_tokens == self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        if not self._buf_tokens:
            return
        data = np.concatenate(self._buf).astype(self.dtype, copy=False)
        name = f"{self.split}_{len(self.shards):06d}.bin"
        tmp = self.out_dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out_dir / name)
        self.shards.append({"file": name, "tokens": int(data.size), "documents": self._buf_docs,
                            "sha256": hashlib.sha256(data.tobytes()).hexdigest()})
        self._buf, self._buf_tokens, self._buf_docs = [], 0, 0

    def close(self) -> dict:
        self._flush()
        return {"tokens": sum(s["tokens"] for s in self.shards), "documents": self.documents, "shards": self.shards}


def write_manifest(out_dir: Path, manifest: dict) -> None:
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out_dir / MANIFEST)


def read_manifest(dataset_dir: str | Path) -> dict:
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no tokenized dataset at {dataset_dir} ({MANIFEST} missing): run "
                                f"`grt tokenize RECIPE` first, or point data.dataset_dir at a tokenized dataset")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {manifest.get('format_version')} is not {FORMAT_VERSION}; "
                         f"re-tokenize with this version of grt-pipeline")
    return manifest
