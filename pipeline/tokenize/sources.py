"""Document sources for the tokenize stage: each yields ``Document(text, origin)`` in a deterministic order.

Kinds: ``files`` (plain text = one document per file, ``.jsonl``, ``.jsonl.zst``, ``.jsonl.gz``; paths or globs) and
``stdlib`` (the running Python's standard-library sources: real text present on every machine, the demo corpus).
New kinds register in ``SOURCE_KINDS``.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import zstandard

from pipeline.config import SourceConfig


@dataclass
class Document:
    text: str
    origin: str  # file[:line], for messages


@dataclass
class SourceStats:
    documents: int = 0
    bytes: int = 0
    skipped: dict | None = None

    def skip(self, reason: str) -> None:
        self.skipped = self.skipped or {}
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _expand(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        matches = sorted(glob.glob(os.path.expanduser(p), recursive=True))
        if not matches:
            raise FileNotFoundError(f"data source path {p!r} matches no file (relative paths are taken from "
                                    f"{os.getcwd()}); fix data.sources[].paths")
        for m in matches:
            mp = Path(m)
            out.extend(sorted(q for q in mp.rglob("*") if q.is_file()) if mp.is_dir() else [mp])
    return out


def _open_text_lines(path: Path) -> Iterator[str]:
    name = path.name
    if name.endswith(".zst"):
        with open(path, "rb") as raw:
            reader = zstandard.ZstdDecompressor().stream_reader(raw)  # streamed, never fully in memory
            yield from io.TextIOWrapper(reader, encoding="utf-8", errors="replace")
    elif name.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            yield from f
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from f


def _jsonl_documents(path: Path, text_field: str, stats: SourceStats) -> Iterator[Document]:
    for lineno, line in enumerate(_open_text_lines(path), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            stats.skip("malformed_json")
            continue
        text = obj.get(text_field) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            stats.skip("missing_text_field")
            continue
        yield Document(text, f"{path}:{lineno}")


def _text_document(path: Path, stats: SourceStats) -> Iterator[Document]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        stats.skip("invalid_utf8")
        return
    yield Document(text, str(path))


def files_source(cfg: SourceConfig, stats: SourceStats) -> Iterator[Document]:
    for path in _expand(cfg.paths):
        if ".jsonl" in path.name or path.name.endswith(".json.gz"):
            yield from _jsonl_documents(path, cfg.text_field, stats)
        else:
            yield from _text_document(path, stats)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source(cfg: SourceConfig, stats: SourceStats) -> Iterator[Document]:
    """Every ``.py`` file of the standard library (site-packages excluded), sorted by path."""
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "__pycache__" not in p.parts)
    for path in files:
        yield from _text_document(path, stats)


SOURCE_KINDS: dict[str, Callable[[SourceConfig, SourceStats], Iterator[Document]]] = {
    "files": files_source,
    "stdlib": stdlib_source,
}


def iter_documents(cfg: SourceConfig, stats: SourceStats) -> Iterator[Document]:
    """Documents of one source, empty ones counted and dropped, stopping at ``max_bytes`` (whole documents)."""
    for doc in SOURCE_KINDS[cfg.kind](cfg, stats):
        if not doc.text.strip():
            stats.skip("empty")
            continue
        size = len(doc.text.encode("utf-8"))
        if cfg.max_bytes is not None and stats.bytes + size > cfg.max_bytes:
            return
        stats.documents += 1
        stats.bytes += size
        yield doc
