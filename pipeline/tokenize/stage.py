"""`grt tokenize`: sources -> data.tokenizer -> fixed-size token shards (train / val) + document indexes + manifest.

The main process reads records in a fixed order and hands batches to N tokenizer processes; results are taken back
in submission order, so deduplication, the split and the shard contents are the same for any number of workers.
At most ``2N + 2`` batches are in flight, which bounds memory whatever the input size. Each time a shard is
completed, the job's state (input position, counters, the open shards, new dedup hashes) is saved under
``DATASET/.progress``; a killed job started again continues from there and writes byte-identical output.

A job holds the dataset folder's lock (``DATASET/.lock``, :mod:`pipeline.runtime.locking`) from before it reads or
deletes anything there until the manifest is written: a second job on the same folder fails at once naming the holder.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections import deque
from concurrent.futures import Future
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from pipeline.config import DataConfig
from pipeline.config import RecipeError
from pipeline.config import SourceConfig
from pipeline.config import config_hash
from pipeline.runtime import storage
from pipeline.runtime.locking import FALLBACK_FILE
from pipeline.runtime.locking import LOCK_FILE
from pipeline.runtime.locking import FolderLock
from pipeline.runtime.locking import FolderLockedError
from pipeline.tokenize.dedup import HashSet64
from pipeline.tokenize.sources import SKIP_REASONS
from pipeline.tokenize.sources import DamagedInputError
from pipeline.tokenize.sources import Record
from pipeline.tokenize.sources import Unit
from pipeline.tokenize.sources import plan_units
from pipeline.tokenize.sources import read_unit
from pipeline.tokenize.tokenizers import FILES
from pipeline.tokenize.tokenizers import keep_copy
from pipeline.tokenize.tokenizers import load_tokenizer
from pipeline.tokenize.worker import BLANK
from pipeline.tokenize.worker import DOC
from pipeline.tokenize.worker import BatchResult
from pipeline.tokenize.worker import init_worker
from pipeline.tokenize.worker import process_batch
from pipeline.tokenize.writer import FORMAT_VERSION
from pipeline.tokenize.writer import MANIFEST
from pipeline.tokenize.writer import ShardWriter
from pipeline.tokenize.writer import atomic_write
from pipeline.tokenize.writer import manifest_problems
from pipeline.tokenize.writer import write_manifest

BATCH_BYTES = 1 << 20  # raw bytes per batch handed to a worker
BATCH_RECORDS = 4096
MAX_LOCATIONS = 5  # first locations kept per skip reason
PROGRESS = ".progress"
STATE_VERSION = 3  # 3: every count record by record (2 saved the fields of records without the text field per batch)
MISSING = SKIP_REASONS.index("missing_text_field") + 1  # the worker's kind of a record without the text field
WARN_MISSING_AFTER = 1000  # records without the text field, and no document yet, before a source is warned about
MAX_FIELDS = 50  # distinct fields counted per source on records without the text field
UP_TO_DATE_WAIT_S = 5.0  # how long a job that finds the dataset up to date waits for another job's lock
# Testing hook: the job stops itself (SIGSTOP) as it is about to save state snapshot N (the shard that completed it
# is on disk under its final name, the state still says N - 1), for a test to SIGKILL it at that exact point.
FAULT_STOP_ENV = "GRT_FAULT_TOKENIZE_STOP_AT_SNAPSHOT"


def record_results(records: list[Record], res: BatchResult) -> Iterator[tuple]:
    """Each record of a batch with what the worker made of it: ``(record, kind, (hash, tokens, bytes, token array),
    fields)``; the document part is zeros and None but for a document, ``fields`` (the record's field names) empty
    but for a record without the text field (an HF row's fields come with the record)."""
    d = offset = m = 0  # indexes of the batch's documents, their tokens, its records without the text field
    for rec, kind in zip(records, res.kinds.tolist()):
        doc, fields = (0, 0, 0, None), ()
        if kind == DOC:
            ntok = int(res.ntokens[d])
            doc = (int(res.hashes[d]), ntok, int(res.nbytes[d]), res.tokens[offset:offset + ntok])
            d += 1
            offset += ntok
        elif kind == MISSING:
            fields = rec.fields or res.missing_fields[m]
            m += 1
        yield rec, kind, doc, fields


class BadRecordError(ValueError):
    """A bad input record under `strict`."""


def content_config(cfg: DataConfig) -> dict:
    """The part of the data config that decides the dataset's bytes (not where it goes, how many workers make it,
    whether bad records fail the job, training-time mixing, checks or document masking): recorded in the manifest
    and fingerprinted."""
    d = dataclasses.asdict(cfg)
    for key in ("dataset_dir", "workers", "strict", "mixture", "verify", "document_masking"):
        d.pop(key)
    if d["tiktoken_pattern"] is None:  # unset: recipes from before the key keep their fingerprint
        d.pop("tiktoken_pattern")
    return d


def data_fingerprint(cfg: DataConfig) -> str:
    d = content_config(cfg)
    if cfg.tokenizer != "gpt2":  # the file's content, not only its path, decides the tokens
        d["tokenizer_sha256"] = load_tokenizer(cfg.tokenizer, cfg.tiktoken_pattern).vocab_hash
    return config_hash(d)


def is_validation(content_hash: int, fraction: float) -> bool:
    """A document goes to validation when its content hash falls under ``fraction``: deterministic, independent of
    order and worker count, and equal documents always land in the same split."""
    return content_hash < fraction * 2**64


class _InProcess:
    """The executor for one worker: runs each batch in this process when it is submitted."""

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Job:
    """One tokenization, resumable."""

    def __init__(self, cfg: DataConfig, strict: bool, workers: int, quiet: bool):
        self.cfg, self.strict, self.workers, self.quiet = cfg, strict, workers, quiet
        self.out = Path(cfg.dataset_dir)
        self.progress_dir = self.out / PROGRESS
        self.fingerprint = data_fingerprint(cfg)
        self.tok = load_tokenizer(cfg.tokenizer, cfg.tiktoken_pattern)  # fails fast on a missing or broken file
        self.ident = self.tok.identity()
        # the workers read the dataset's own copy (made when the job starts), the file the manifest's hash names
        self.tok_spec = "gpt2" if self.tok.kind == "gpt2" else str((self.out / FILES[self.tok.kind]).resolve())
        self.dtype = np.dtype(np.uint16 if self.ident["n_vocab"] <= 2**16 else np.uint32)
        self.sources: list[SourceConfig] = list(cfg.sources) + list(cfg.validation_sources)
        self.units: list[list[Unit]] = [plan_units(i, s) for i, s in enumerate(self.sources)]  # fails fast
        self.writers = {s: ShardWriter(self.out, s, cfg.shard_tokens, self.dtype) for s in ("train", "val")}
        self.dedup = HashSet64()
        self.stats = [{"kind": s.kind, "paths": s.paths, "name": s.name, "documents": 0, "bytes": 0, "tokens": 0,
                       "duplicates": 0, "skipped": {r: 0 for r in SKIP_REASONS},
                       "first_skipped": {r: [] for r in SKIP_REASONS},
                       "fields_of_records_without_text_field": {}} for s in self.sources]
        self.capped: set[int] = set()
        self.warned: set[int] = set()  # sources warned about a text field their records lack
        self.position = (-1, -1, -1)  # last record handled
        self.bytes_read = 0
        self.snapshots = 0
        self.only: set[tuple[int, int]] | None = None  # the (source, unit)s read; None: all (tasks.py reads a slice)

    def source_key(self, source: int) -> str:
        """The recipe key of a source: ``data.sources[i]`` or ``data.validation_sources[j]``."""
        n = len(self.cfg.sources)
        return f"data.sources[{source}]" if source < n else f"data.validation_sources[{source - n}]"

    # ------------------------------------------------------------------------------------------- state
    def _split_of(self, source: int, h: int) -> str:
        if source >= len(self.cfg.sources):
            return "val"
        if self.cfg.validation_sources:
            return "train"
        return "val" if is_validation(h, self.cfg.val_fraction) else "train"

    def save_state(self) -> None:
        if self.snapshots + 1 == int(os.environ.get(FAULT_STOP_ENV) or 0):
            os.kill(os.getpid(), signal.SIGSTOP)
        self.snapshots += 1
        new = self.dedup.take_new()
        atomic_write(self.progress_dir / f"dedup_{self.snapshots:06d}.npy", new.astype("<u8").tobytes())
        state = {"version": STATE_VERSION, "fingerprint": self.fingerprint, "position": list(self.position),
                 "bytes_read": self.bytes_read, "stats": self.stats, "capped": sorted(self.capped),
                 "snapshots": self.snapshots,
                 "writers": {s: w.snapshot(self.progress_dir, self.snapshots) for s, w in self.writers.items()}}
        # Files of a snapshot carry its number and are written before the state file that names them; the
        # previous snapshot's open shards are removed only once the new state is in place.
        atomic_write(self.progress_dir / "state.json", json.dumps(state).encode())
        for old in self.progress_dir.glob(f"*.partial.{self.snapshots - 1}"):
            old.unlink()

    def load_state(self) -> bool:
        path = self.progress_dir / "state.json"
        if not path.is_file():
            return False
        state = json.loads(path.read_text())
        if state.get("version") != STATE_VERSION or state.get("fingerprint") != self.fingerprint:
            return False
        self.position = tuple(state["position"])
        self.bytes_read, self.stats = state["bytes_read"], state["stats"]
        self.capped, self.snapshots = set(state["capped"]), state["snapshots"]
        for s, w in self.writers.items():
            w.restore(self.progress_dir, state["writers"][s])
        for i in range(1, self.snapshots + 1):
            self.dedup.load(np.fromfile(self.progress_dir / f"dedup_{i:06d}.npy", dtype="<u8"))
        return True

    # ------------------------------------------------------------------------------------------ reading
    def batches(self) -> Iterator[list[Record]]:
        batch, size = [], 0
        s0, u0, r0 = self.position
        for unit in (u for us in self.units for u in us):
            if (unit.source, unit.index) < (s0, u0) or unit.source in self.capped:
                continue
            if self.only is not None and (unit.source, unit.index) not in self.only:
                continue
            skip = r0 if (unit.source, unit.index) == (s0, u0) else -1
            if batch and batch[-1].pos[0] != unit.source:  # one source per batch (one text field)
                yield batch
                batch, size = [], 0
            try:
                for rec in read_unit(unit, self.sources[unit.source], skip):
                    if unit.source in self.capped:
                        break
                    batch.append(rec)
                    size += rec.nbytes
                    if size >= BATCH_BYTES or len(batch) >= BATCH_RECORDS:
                        yield batch
                        batch, size = [], 0
            except DamagedInputError as e:
                raise DamagedInputError(f"{e}. A damaged file is not a bad record, so this fails without --strict "
                                        f"too: replace it with an intact copy, or remove it from "
                                        f"{self.source_key(unit.source)}.paths") from None
        if batch:
            yield batch

    # ------------------------------------------------------------------------------------------ handling
    def handle(self, records: list[Record], res: BatchResult, bar) -> None:
        batch_bytes = sum(r.nbytes for r in records)
        # Every count here, bytes_read included, grows record by record: a state saved mid-batch (a shard completed)
        # holds each count up to the same record as its position, and a resumed job counts the rest exactly once.
        for rec, kind, (h, ntok, nbytes, tokens), fields in record_results(records, res):
            src = rec.pos[0]
            self.bytes_read += rec.nbytes
            if src in self.capped:
                continue
            self.position = rec.pos
            st = self.stats[src]
            if kind == BLANK:
                continue
            if kind != DOC:
                reason = SKIP_REASONS[kind - 1]
                where = self.location(rec)
                if self.strict:
                    raise self.bad_record(rec, kind, fields)
                st["skipped"][reason] += 1
                if kind == MISSING and fields:
                    self.count_fields(src, Counter(fields))
                if len(st["first_skipped"][reason]) < MAX_LOCATIONS:
                    st["first_skipped"][reason].append(where)
                continue
            cap = self.sources[src].max_bytes
            if cap is not None and st["bytes"] + nbytes > cap:
                self.capped.add(src)
                continue
            if self.cfg.dedup and not self.dedup.add_if_new(h):
                st["duplicates"] += 1
                continue
            st["documents"] += 1
            st["bytes"] += nbytes
            st["tokens"] += ntok
            if self.writers[self._split_of(src, h)].add_document(tokens):
                self.save_state()
        self.warn_missing_field(records[0].pos[0])
        bar.update(batch_bytes)
        bar.set_postfix_str(f"{sum(s['documents'] for s in self.stats):,} docs, "
                            f"{sum(s['tokens'] for s in self.stats) / max(1e-9, time.time() - self.t0):,.0f} tok/s",
                            refresh=False)

    def bad_record(self, rec: Record, kind: int, fields: tuple[str, ...]) -> BadRecordError:
        """The strict mode's error for a skipped record of this kind."""
        src = rec.pos[0]
        what = SKIP_REASONS[kind - 1].replace('_', ' ')
        if kind == MISSING:
            field = self.sources[src].text_field
            what = f"field {field!r} is not a string" if field in fields else f"no field {field!r}"
            what += (f" (fields it has: {', '.join(fields)})" if fields else "") + \
                f"; {self.source_key(src)}.text_field names the field that holds the text"
        return BadRecordError(f"{self.location(rec)}: {what} (strict mode; drop data.strict / --strict to count and "
                              f"skip such records instead)")

    def count_fields(self, src: int, fields: Counter) -> None:
        counts = self.stats[src]["fields_of_records_without_text_field"]
        for f, n in fields.items():
            if f in counts or len(counts) < MAX_FIELDS:
                counts[f] = counts.get(f, 0) + n

    def missing_field_words(self, src: int) -> str:
        """'N records had no field 'X' (fields they have: a, b)' for a source."""
        st, field = self.stats[src], self.sources[src].text_field
        return _missing_field_words(st["skipped"]["missing_text_field"], field,
                                    st["fields_of_records_without_text_field"])

    def warn_missing_field(self, src: int) -> None:
        """Say early when a source's records lack its text field, rather than only at the end of a long read."""
        st = self.stats[src]
        if (self.quiet or src in self.warned or st["documents"]
                or st["skipped"]["missing_text_field"] < WARN_MISSING_AFTER):
            return
        self.warned.add(src)
        tqdm.write(f"warning: {self.source_key(src)}: {self.missing_field_words(src)} and none had it so far; "
                   f"check {self.source_key(src)}.text_field", file=sys.stderr)

    def location(self, rec: Record) -> str:
        unit = self.units[rec.pos[0]][rec.pos[1]]
        name, fmt = unit.name, unit.fmt
        if fmt == "jsonl":
            return f"{name}:{rec.pos[2] + 1}"
        if fmt == "text" and self.sources[rec.pos[0]].text_mode == "file":
            return name
        what = {"text": "paragraph", "parquet": "row", "hf": "row"}[fmt]
        return f"{name} {what} {rec.pos[2] + 1}"

    # ------------------------------------------------------------------------------------------ running
    def run(self) -> dict:
        self.t0 = time.time()
        total = sum(u.size or 0 for us in self.units for u in us) or None
        bar = tqdm(total=total, initial=self.bytes_read if total else 0, unit="B", unit_scale=True,
                   desc="tokenize: input read", disable=self.quiet, mininterval=1.0, smoothing=0.1)
        # fork: workers start at once and never re-import the caller's __main__ (spawn would)
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        # the workers let go of the dataset lock inherited by fork, and die with this process
        keep_copy(self.tok, self.out)
        pool = (ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=init_worker, initargs=(os.getpid(),))
                if self.workers > 1 else _InProcess())
        try:
            with pool:
                inflight: deque = deque()
                for batch in self.batches():
                    recs = [(r.raw, r.fmt) for r in batch]
                    text_field = self.sources[batch[0].pos[0]].text_field  # batches() keeps one source per batch
                    inflight.append((batch, pool.submit(process_batch, recs, text_field, self.dtype.name,
                                                            self.tok_spec, self.tok.pattern)))
                    if len(inflight) >= 2 * self.workers + 2:
                        b, fut = inflight.popleft()
                        self.handle(b, fut.result(), bar)
                while inflight:
                    b, fut = inflight.popleft()
                    self.handle(b, fut.result(), bar)
        finally:
            bar.close()
        return self.finish()

    def finish(self) -> dict:
        unread = [f"{self.source_key(i)}.text_field={self.sources[i].text_field!r}: {self.missing_field_words(i)} "
                  f"and no record had it; set {self.source_key(i)}.text_field to the field that holds the text"
                  for i, st in enumerate(self.stats) if not st["documents"] and st["skipped"]["missing_text_field"]]
        if unread:
            raise RecipeError(unread, "data sources")
        splits = {s: w.close() for s, w in self.writers.items()}
        empty = [s for s in ("train", "val") if splits[s]["tokens"] == 0]
        if empty:
            raise ValueError(self.empty_split_words(empty))
        manifest = {
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "tokenizer": self.ident,
            "dtype": self.dtype.name,
            "shard_tokens": self.cfg.shard_tokens,
            "splits": splits,
            "sources": self.stats,
            "totals": {"documents": sum(s["documents"] for s in self.stats),
                       "tokens": sum(s["tokens"] for s in self.stats),
                       "bytes": sum(s["bytes"] for s in self.stats),
                       "duplicates": sum(s["duplicates"] for s in self.stats),
                       "skipped": {r: sum(s["skipped"][r] for s in self.stats) for r in SKIP_REASONS}},
            "data_config": content_config(self.cfg),
        }
        write_manifest(self.out, manifest)
        shutil.rmtree(self.progress_dir, ignore_errors=True)
        return manifest

    def empty_split_words(self, empty: list[str]) -> str:
        what = f"the {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} empty"
        if self.cfg.validation_sources:  # the split is by source: val_fraction plays no part
            n = len(self.cfg.sources)
            groups = {"train": ("data.sources", self.stats[:n]), "val": ("data.validation_sources", self.stats[n:])}
            gave = "; ".join(f"{key} kept no document ({_dropped(stats)})" for key, stats in map(groups.get, empty))
            return f"{what}: {gave}; add documents to {' and '.join(groups[s][0] for s in empty)}"
        kept = sum(s["documents"] for s in self.stats)
        if not kept:
            return f"{what}: no document was kept ({_dropped(self.stats)}); fix data.sources or their settings"
        return (f"{what} ({kept:,} documents kept in all): add documents, or change data.val_fraction="
                f"{self.cfg.val_fraction}, or give a separate validation set in data.validation_sources")


def _missing_field_words(n: int, field: str, fields: dict[str, int]) -> str:
    not_text = fields.get(field, 0)  # records that have the field, but not as a string
    others = sorted((kv for kv in fields.items() if kv[0] != field), key=lambda kv: (-kv[1], kv[0]))
    return (f"{n:,} records had no field {field!r}"
            + (f" ({not_text:,} of them had it, but not as a string)" if not_text else "")
            + (f" (fields they have: {', '.join(f for f, _ in others[:12])})" if others else ""))


def _dropped(stats: list[dict]) -> str:
    """What became of the records of sources that kept no document."""
    skipped, duplicates = Counter(), sum(st["duplicates"] for st in stats)
    for st in stats:
        skipped.update(st["skipped"])
    parts = [f"{n:,} {r.replace('_', ' ')}" for r, n in skipped.items() if n]
    parts += [f"{duplicates:,} duplicates"] if duplicates else []
    return f"records dropped: {', '.join(parts)}" if parts else "no record was read"


def wait_for_dataset(cfg: DataConfig, poll_s: float = 2.0) -> dict:
    """Wait until ``cfg.dataset_dir`` holds the finished dataset of this config (another process tokenizes it: rank 0
    of `grt run` under torchrun, whose failure ends the whole job). An s3:// dataset is looked for in the store."""
    if storage.is_remote(cfg.dataset_dir):
        from pipeline.tokenize.upload import wait_for_remote

        if cfg.tokenizer == "gpt2" or Path(cfg.tokenizer).expanduser().is_file():
            fingerprint = data_fingerprint(cfg)
            return wait_for_remote(str(cfg.dataset_dir), lambda m: fingerprint, poll_s)
        # a node without the recipe's tokenizer file (no shared disk; rank 0 tokenized with it): this config with
        # the tokenizer the dataset was made with, whose copy in the dataset training then reads
        content = content_config(cfg)
        return wait_for_remote(str(cfg.dataset_dir), lambda m: config_hash(
            {**content, "tokenizer_sha256": m["tokenizer"]["vocab_hash"]}), poll_s)
    out, fingerprint = Path(cfg.dataset_dir), data_fingerprint(cfg)
    while True:
        try:
            manifest = _finished(out, fingerprint)[0]
        except (ValueError, OSError):  # a manifest being replaced, or another config's: rank 0 decides
            manifest = None
        if manifest is not None:
            return manifest
        time.sleep(poll_s)


def _finished(out: Path, fingerprint: str) -> tuple[dict | None, bool]:
    """(the manifest, False) when ``out`` holds a dataset made from this config; (None, True) when it holds one of an
    older format, to be rebuilt; (None, False) when it holds none. Another config's dataset is an error."""
    path = out / MANIFEST
    if not path.is_file():
        return None, False
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is not a manifest (not a JSON object): pass --force to rebuild the dataset in {out}")
    if manifest.get("format_version") != FORMAT_VERSION:
        return None, True
    if manifest.get("fingerprint") != fingerprint:
        raise FileExistsError(f"{out} holds a dataset made from a different data config (fingerprint "
                              f"{manifest.get('fingerprint')} != {fingerprint}); choose another "
                              f"data.dataset_dir or pass --force to overwrite it")
    if manifest_problems(manifest):  # this config's, but damaged: rebuilt
        return None, True
    return manifest, False


def _lock_dataset(out: Path, wait_s: float) -> FolderLock:
    """The dataset folder's lock; ``wait_s`` > 0 waits that long for a holder that may be only checking it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return FolderLock(out, "dataset folder", fix=", or point data.dataset_dir at another folder").acquire()
        except FolderLockedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def _clear(out: Path) -> None:
    """Empty the dataset folder for a rebuild, all but the lock this job holds."""
    for p in out.iterdir():
        if p.name in (LOCK_FILE, FALLBACK_FILE):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def tokenize(cfg: DataConfig, force: bool = False, quiet: bool = False, strict: bool | None = None,
             workers: int | None = None) -> dict:
    """Tokenize ``cfg.sources`` into ``cfg.dataset_dir``; reuse a finished dataset made from the same config and
    resume an interrupted one. Holds the dataset folder's lock while it reads or writes there."""
    if storage.is_remote(cfg.dataset_dir):  # s3://: staged on the local disk, then uploaded (manifest last)
        from pipeline.tokenize.upload import tokenize_remote

        return tokenize_remote(cfg, tokenize, data_fingerprint(cfg), force=force, quiet=quiet, strict=strict,
                               workers=workers)
    out = Path(cfg.dataset_dir)
    fingerprint = data_fingerprint(cfg)
    strict = cfg.strict if strict is None else strict
    workers = workers or cfg.workers or os.cpu_count() or 1
    try:  # a look without the lock decides only what is prepared before taking it; the answer is taken under it
        look = "build" if force or _finished(out, fingerprint)[0] is None else "reuse"
    except (ValueError, OSError):
        look = "refuse"  # another config's dataset, or a broken manifest: said under the lock
    # the sources are resolved before the folder is locked (and so created): a missing input leaves no trace
    job = _Job(cfg, strict, workers, quiet) if look == "build" else None
    # jobs that only find the dataset up to date (several `grt run` sharing it) wait out each other's brief hold
    lock = _lock_dataset(out, UP_TO_DATE_WAIT_S if look == "reuse" else 0.0)
    try:
        if not force:
            manifest, force = _finished(out, fingerprint)
            if manifest is not None:
                if not quiet:
                    print(f"tokenize: {out} is up to date ({manifest['splits']['train']['tokens']:,} train tokens); "
                          f"--force to rebuild")
                return manifest
            if force and not quiet:
                print(f"tokenize: {out}'s manifest is of an older format (not {FORMAT_VERSION}) or incomplete; "
                      f"rebuilding the dataset", file=sys.stderr)
        job = job or _Job(cfg, strict, workers, quiet)  # the dataset was removed since the look
        if force:
            _clear(out)
        (out / MANIFEST).unlink(missing_ok=True)
        resumed = job.load_state()
        if not resumed:  # a fresh start: nothing of an older attempt may leak in
            shutil.rmtree(job.progress_dir, ignore_errors=True)
            for f in out.glob("*_[0-9][0-9][0-9][0-9][0-9][0-9].*"):
                f.unlink()
        job.progress_dir.mkdir(exist_ok=True)
        if resumed and not quiet:
            print(f"tokenize: resuming {out} after {job.bytes_read / 1e6:,.1f} MB of input "
                  f"({sum(len(w.shards) for w in job.writers.values())} shards done)", file=sys.stderr)
        t0 = time.time()
        try:
            manifest = job.run()
        except BadRecordError:
            shutil.rmtree(job.progress_dir, ignore_errors=True)
            raise
    finally:
        lock.release()
    if not quiet:
        report(manifest, out, time.time() - t0, workers)
    return manifest


def report(m: dict, out: Path, seconds: float, workers: int) -> None:
    t = m["totals"]
    print(f"tokenize: {t['bytes'] / 1e6:,.1f} MB of text, {t['documents']:,} documents -> "
          f"{m['splits']['train']['tokens']:,} train + {m['splits']['val']['tokens']:,} val tokens in "
          f"{seconds:.1f} s ({t['bytes'] / 1e6 / max(seconds, 1e-9):.1f} MB/s, {workers} workers) -> {out}")
    if t["duplicates"]:
        print(f"  duplicates dropped: {t['duplicates']:,}")
    for reason, n in t["skipped"].items():
        if n:
            where = [loc for s in m["sources"] for loc in s["first_skipped"][reason]][:MAX_LOCATIONS]
            have = Counter()
            for s in m["sources"] if reason == "missing_text_field" else []:
                have.update(s["fields_of_records_without_text_field"])
            fields = f" (fields they have: {', '.join(f for f, _ in have.most_common(12))})" if have else ""
            print(f"  skipped {n:,} {reason.replace('_', ' ')}{fields}: first at {', '.join(where)}")

