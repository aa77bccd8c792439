"""Document sources for the tokenize stage.

A source is read in the main process as a stream of *raw records* — a JSON line as bytes, a whole text file or one
paragraph of it as bytes, a parquet or Hugging Face row's text — each with a position ``(source, unit, record)``
that orders the whole input and lets a resumed run skip exactly what was done. Decoding and checking a record
(:func:`parse_record`) happens in the tokenizer workers.

Kinds: ``files`` (plain text, ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.json.gz``, ``.parquet``; paths or globs),
``hf`` (Hugging Face ``load_from_disk`` folders, or ``load_dataset`` names/folders in streaming mode) and ``stdlib``
(the running Python's standard library: the bundled default corpus).
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import zstandard

from pipeline.config import SourceConfig

# Reasons a record is skipped (counted in the manifest; `strict` turns them into failures).
SKIP_REASONS = ("invalid_utf8", "malformed_json", "missing_text_field", "empty", "binary")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")
_PARAGRAPH_BREAK = re.compile(rb"\r?\n(?:[ \t\f\v]*\r?\n)+")  # one or more blank (or whitespace-only) lines


@dataclass
class Unit:
    """One readable thing of a source: a file, or a whole HF dataset."""

    source: int
    index: int
    name: str  # path or dataset name, for messages
    fmt: str  # jsonl | text | parquet | hf
    size: int | None  # bytes on disk (progress/ETA), None if unknown


@dataclass
class Record:
    raw: bytes | str | None
    fmt: str  # json | text | str (already text; None = the field is missing)
    pos: tuple[int, int, int]  # (source, unit, record)
    nbytes: int  # raw bytes read, for progress


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _file_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if any(name.endswith(ext) for ext in (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")):
        return "jsonl"
    return "text"


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
    for f in out:
        if not os.access(f, os.R_OK):
            raise PermissionError(f"data source file {f} is not readable; fix its permissions or remove it from "
                                  f"data.sources[].paths")
    return out


def _is_saved_hf_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
                              or (path / "state.json").is_file())


def plan_units(index: int, cfg: SourceConfig) -> list[Unit]:
    """Resolve a source to its units, failing at once on a missing or unreadable input."""
    if cfg.kind == "stdlib":
        root = stdlib_root()
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "__pycache__" not in p.parts)
        return [Unit(index, i, str(f), "text", f.stat().st_size) for i, f in enumerate(files)]
    if cfg.kind == "hf":
        return [Unit(index, 0, cfg.name, "hf", None)]
    return [Unit(index, i, str(f), _file_format(f), f.stat().st_size) for i, f in enumerate(_expand(cfg.paths))]


class _CountingReader(io.RawIOBase):
    """Wraps a binary file to report how many (compressed) bytes have been consumed."""

    def __init__(self, f):
        self.f, self.consumed = f, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.consumed += n or 0
        return n


def _binary_lines(path: str, raw: _CountingReader) -> Iterator[bytes]:
    name = path.lower()
    if name.endswith(".zst"):
        stream = zstandard.ZstdDecompressor().stream_reader(raw, read_size=1 << 20)  # streamed, never all in memory
        yield from io.BufferedReader(stream, buffer_size=1 << 20)
    elif name.endswith(".gz"):
        with gzip.GzipFile(fileobj=raw) as g:
            yield from io.BufferedReader(g, buffer_size=1 << 20)
    else:
        yield from io.BufferedReader(raw, buffer_size=1 << 20)


def read_unit(unit: Unit, cfg: SourceConfig, skip_through: int = -1) -> Iterator[Record]:
    """The records of one unit in order; records numbered <= ``skip_through`` are read past, not returned."""
    pos = (unit.source, unit.index)
    if unit.fmt in ("jsonl", "text"):
        with open(unit.name, "rb") as f:
            if unit.fmt == "text":
                data = f.read()
                parts = [data] if cfg.text_mode == "file" else _PARAGRAPH_BREAK.split(data)
                for r, part in enumerate(parts):
                    if r > skip_through:
                        yield Record(part, "text", (*pos, r), len(data) if r == 0 else 0)
                return
            raw = _CountingReader(f)
            last = 0
            for r, line in enumerate(_binary_lines(unit.name, raw)):
                consumed, last = raw.consumed - last, raw.consumed
                if r <= skip_through:
                    continue
                if not line.strip():  # a blank line holds no document: nothing to count or lose
                    yield Record(None, "blank", (*pos, r), consumed)
                    continue
                yield Record(line, "json", (*pos, r), consumed)
    elif unit.fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.name)
        if cfg.text_field not in pf.schema_arrow.names:
            raise KeyError(f"{unit.name}: no column {cfg.text_field!r} (columns: {pf.schema_arrow.names}); set "
                           f"data.sources[].text_field")
        r = 0
        per_row = (unit.size or 0) / max(1, pf.metadata.num_rows)
        for batch in pf.iter_batches(columns=[cfg.text_field], batch_size=4096):
            for value in batch.column(0).to_pylist():
                if r > skip_through:
                    yield Record(value if isinstance(value, str) else None, "str", (*pos, r), int(per_row))
                r += 1
    elif unit.fmt == "hf":
        for r, row in enumerate(_hf_rows(cfg)):
            if r > skip_through:
                value = row.get(cfg.text_field) if isinstance(row, dict) else None
                yield Record(value if isinstance(value, str) else None, "str", (*pos, r),
                             len(value.encode("utf-8", "replace")) if isinstance(value, str) else 0)
    else:  # pragma: no cover - plan_units only makes the formats above
        raise ValueError(f"unknown unit format {unit.fmt}")


def _hf_rows(cfg: SourceConfig):
    """Rows of a Hugging Face dataset: ``load_from_disk`` for saved folders, else ``load_dataset`` (streaming by
    default: the same call that streams a hub name such as ``HuggingFaceFW/fineweb``)."""
    import datasets

    path = Path(os.path.expanduser(cfg.name))
    if _is_saved_hf_dataset(path):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise KeyError(f"{cfg.name}: no split {cfg.split!r} (have {list(ds)}); set data.sources[].split")
            ds = ds[cfg.split]
        return iter(ds)
    return iter(datasets.load_dataset(cfg.name, cfg.subset, split=cfg.split, streaming=cfg.streaming))


def parse_record(raw: bytes | str | None, fmt: str, text_field: str) -> tuple[str | None, str | None]:
    """(text, None) for a usable document, (None, reason) otherwise; reasons are :data:`SKIP_REASONS`."""
    if fmt == "str":
        if raw is None:
            return None, "missing_text_field"
        text = raw
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None, "invalid_utf8"
        if fmt == "json":
            try:
                obj = json.loads(text)
            except ValueError:
                return None, "malformed_json"
            if not isinstance(obj, dict):
                return None, "malformed_json"
            text = obj.get(text_field)
            if not isinstance(text, str):
                return None, "missing_text_field"
    if not text.strip():
        return None, "empty"
    if "\x00" in text or len(_CONTROL.findall(text[:4096])) > 0.05 * min(len(text), 4096):
        return None, "binary"
    return text, None
