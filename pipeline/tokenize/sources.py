"""Document sources for the tokenize stage.

A source is read in the main process as a stream of *raw records* — a JSON line as bytes, a whole text file or one
paragraph of it as bytes, a parquet or Hugging Face row's text — each with a position ``(source, unit, record)``
that orders the whole input and lets a resumed run skip exactly what was done. Decoding and checking a record
(:func:`parse_record`) happens in the tokenizer workers.

Kinds: ``files`` (plain text, ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.json.gz``, ``.parquet``; paths or globs),
``hf`` (Hugging Face ``load_from_disk`` folders, or ``load_dataset`` names/folders in streaming mode) and ``stdlib``
(the running Python's standard library: the bundled default corpus).

A file that cannot be read to its end — a compressed stream that stops inside a zstd frame or gzip member, corrupted
compressed data, a parquet file cut short — is a :class:`DamagedInputError` naming the file and the byte offset, in
non-strict mode too: a damaged file is not a bad record, and reading it to the cut would drop the rest silently.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import sysconfig
import zlib
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
    fields: tuple[str, ...] = ()  # an HF row without the text field: the fields it has, for the error message


class DamagedInputError(ValueError):
    """An input file that cannot be read to its end (a compressed stream cut short or corrupted, a broken parquet
    file): unlike a bad record, this fails the job in non-strict mode too."""


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


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every zstd frame of a file, in order. zstandard's ``stream_reader`` returns what it
    has and stops silently when the input ends inside a frame; this reader makes that an error."""

    CHUNK = 1 << 16  # compressed bytes fed at a time: bounds memory, and how closely a damaged spot is located

    def __init__(self, raw: _CountingReader, size: int):
        self.raw, self.size = raw, size
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = None  # decompressor of the frame being read; None between frames
        self._input = b""  # compressed bytes not yet fed
        self._out, self._at = b"", 0  # decompressed bytes not yet returned, and how many of them were
        self._fed = (0, 0)  # the compressed byte range of the last chunk read, for messages

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._at == len(self._out):
            if not self._input:
                start = self.raw.consumed
                self._input = self.raw.read(self.CHUNK)
                if not self._input:
                    if self._frame is not None:
                        raise _StreamDamage(f"the zstd stream ends inside a frame at compressed byte "
                                            f"{self.raw.consumed:,} (the file is truncated)")
                    return 0
                self._fed = (start, self.raw.consumed)
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            try:
                self._out, self._at = self._frame.decompress(self._input), 0
            except zstandard.ZstdError as e:
                raise _StreamDamage(f"zstd data error ({e}) in compressed bytes {self._fed[0]:,}-{self._fed[1]:,} "
                                    f"of {self.size:,}") from None
            if self._frame.eof:  # the rest of the chunk is the next frame's
                self._input, self._frame = self._frame.unused_data, None
            else:
                self._input = b""
        n = min(len(b), len(self._out) - self._at)
        b[:n] = self._out[self._at:self._at + n]
        self._at += n
        return n


class _StreamDamage(Exception):
    """Raised inside a compressed reader; :func:`read_unit` adds the file and the line."""


def _binary_lines(path: str, raw: _CountingReader, size: int) -> Iterator[bytes]:
    name = path.lower()
    if name.endswith(".zst"):
        yield from io.BufferedReader(_ZstdFrames(raw, size), buffer_size=1 << 20)  # streamed, never all in memory
    elif name.endswith(".gz"):
        try:
            with gzip.GzipFile(fileobj=raw) as g:
                yield from io.BufferedReader(g, buffer_size=1 << 20)
        except EOFError:
            raise _StreamDamage(f"the gzip stream ends inside a member at compressed byte {raw.consumed:,} (the file "
                                f"is truncated)") from None
        except (gzip.BadGzipFile, zlib.error) as e:
            raise _StreamDamage(f"gzip data error ({e}) after {raw.consumed:,} of {size:,} compressed bytes "
                                f"read") from None
    else:
        yield from io.BufferedReader(raw, buffer_size=1 << 20)


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


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
            last = lines = 0
            try:
                for r, line in enumerate(_binary_lines(unit.name, raw, os.fstat(f.fileno()).st_size)):
                    consumed, last, lines = raw.consumed - last, raw.consumed, r + 1
                    if r <= skip_through:
                        continue
                    if not line.strip():  # a blank line holds no document: nothing to count or lose
                        yield Record(None, "blank", (*pos, r), consumed)
                        continue
                    if not line.endswith(b"\n") and not _is_json(line):  # the last line, cut: a file cut short
                        raise DamagedInputError(
                            f"{unit.name} is damaged: its last line (line {r + 1:,}, {len(line):,} bytes) is cut off "
                            f"mid-record (no newline, not valid JSON): the file is truncated; {r:,} lines were read "
                            f"before it")
                    yield Record(line, "json", (*pos, r), consumed)
            except _StreamDamage as e:
                raise DamagedInputError(f"{unit.name} is damaged: {e}"
                                        + (f"; {lines:,} lines were read before it" if lines else "")) from None
    elif unit.fmt == "parquet":
        yield from _parquet_records(unit, cfg, skip_through)
    elif unit.fmt == "hf":
        for r, row in enumerate(_hf_rows(cfg)):
            if r > skip_through:
                value = row.get(cfg.text_field) if isinstance(row, dict) else None
                if isinstance(value, str):
                    yield Record(value, "str", (*pos, r), len(value.encode("utf-8", "replace")))
                else:
                    yield Record(None, "str", (*pos, r), 0, tuple(row) if isinstance(row, dict) else ())
    else:  # pragma: no cover - plan_units only makes the formats above
        raise ValueError(f"unknown unit format {unit.fmt}")


def _parquet_records(unit: Unit, cfg: SourceConfig, skip_through: int) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    r = 0
    try:
        pf = pq.ParquetFile(unit.name)
        if cfg.text_field not in pf.schema_arrow.names:
            raise KeyError(f"{unit.name}: no column {cfg.text_field!r} (columns: {pf.schema_arrow.names}); set "
                           f"data.sources[].text_field")
        per_row = (unit.size or 0) / max(1, pf.metadata.num_rows)
        for batch in pf.iter_batches(columns=[cfg.text_field], batch_size=4096):
            for value in batch.column(0).to_pylist():
                if r > skip_through:
                    yield Record(value if isinstance(value, str) else None, "str", (unit.source, unit.index, r),
                                 int(per_row))
                r += 1
    except pa.ArrowException as e:  # a file cut short, or not parquet at all
        raise DamagedInputError(f"{unit.name} is damaged: pyarrow cannot read it ({e})"
                                + (f"; {r:,} rows were read before it" if r else "")) from None


def record_fields(raw: bytes | None, fmt: str) -> list[str]:
    """The fields of a JSON-object record (for the message on a text field that records lack); [] otherwise."""
    if fmt != "json":
        return []
    try:
        obj = json.loads(raw)
    except ValueError:
        return []
    return list(obj) if isinstance(obj, dict) else []


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
