"""`grt tokenize`: sources -> GPT-2 BPE -> fixed-size token shards (train / val) + document indexes + manifest.json.

The main process reads records in a fixed order and hands batches to N tokenizer processes; results are taken back
in submission order, so deduplication, the split and the shard contents are the same for any number of workers.
At most ``2N + 2`` batches are in flight, which bounds memory whatever the input size. Each time a shard is
completed, the job's state (input position, counters, the open shards, new dedup hashes) is saved under
``DATASET/.progress``; a killed job started again continues from there and writes byte-identical output.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from pipeline.config import DataConfig, SourceConfig, config_hash
from pipeline.tokenize.bpe import tokenizer_identity
from pipeline.tokenize.dedup import HashSet64
from pipeline.tokenize.sources import SKIP_REASONS, Record, Unit, plan_units, read_unit
from pipeline.tokenize.worker import BLANK, DOC, BatchResult, process_batch
from pipeline.tokenize.writer import FORMAT_VERSION, MANIFEST, ShardWriter, atomic_write, write_manifest

BATCH_BYTES = 1 << 20  # raw bytes per batch handed to a worker
BATCH_RECORDS = 4096
MAX_LOCATIONS = 5  # first locations kept per skip reason
PROGRESS = ".progress"
STATE_VERSION = 1


class BadRecordError(ValueError):
    """A bad input record under `strict`."""


def content_config(cfg: DataConfig) -> dict:
    """The part of the data config that decides the dataset's bytes (not where it goes, how many workers make it,
    whether bad records fail the job, or training-time mixing): recorded in the manifest and fingerprinted."""
    d = dataclasses.asdict(cfg)
    for key in ("dataset_dir", "workers", "strict", "mixture"):
        d.pop(key)
    return d


def data_fingerprint(cfg: DataConfig) -> str:
    return config_hash(content_config(cfg))


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
        self.ident = tokenizer_identity(cfg.tokenizer)
        self.dtype = np.dtype(np.uint16 if self.ident["n_vocab"] <= 2**16 else np.uint32)
        self.sources: list[SourceConfig] = list(cfg.sources) + list(cfg.validation_sources)
        self.units: list[list[Unit]] = [plan_units(i, s) for i, s in enumerate(self.sources)]  # fails fast
        self.writers = {s: ShardWriter(self.out, s, cfg.shard_tokens, self.dtype) for s in ("train", "val")}
        self.dedup = HashSet64()
        self.stats = [{"kind": s.kind, "paths": s.paths, "name": s.name, "documents": 0, "bytes": 0, "tokens": 0,
                       "duplicates": 0, "skipped": {r: 0 for r in SKIP_REASONS},
                       "first_skipped": {r: [] for r in SKIP_REASONS}} for s in self.sources]
        self.capped: set[int] = set()
        self.position = (-1, -1, -1)  # last record handled
        self.bytes_read = 0
        self.snapshots = 0

    # ------------------------------------------------------------------------------------------- state
    def _split_of(self, source: int, h: int) -> str:
        if source >= len(self.cfg.sources):
            return "val"
        if self.cfg.validation_sources:
            return "train"
        return "val" if is_validation(h, self.cfg.val_fraction) else "train"

    def save_state(self) -> None:
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
            skip = r0 if (unit.source, unit.index) == (s0, u0) else -1
            if batch and batch[-1].pos[0] != unit.source:  # one source per batch (one text field)
                yield batch
                batch, size = [], 0
            for rec in read_unit(unit, self.sources[unit.source], skip):
                if unit.source in self.capped:
                    break
                batch.append(rec)
                size += rec.nbytes
                if size >= BATCH_BYTES or len(batch) >= BATCH_RECORDS:
                    yield batch
                    batch, size = [], 0
        if batch:
            yield batch

    # ------------------------------------------------------------------------------------------ handling
    def handle(self, records: list[Record], res: BatchResult, bar) -> None:
        d = 0  # document index within the batch
        offset = 0
        batch_bytes = sum(r.nbytes for r in records)
        self.bytes_read += batch_bytes
        for rec, kind in zip(records, res.kinds.tolist()):
            src = rec.pos[0]
            if kind == DOC:
                h, ntok, nbytes = int(res.hashes[d]), int(res.ntokens[d]), int(res.nbytes[d])
                tokens = res.tokens[offset:offset + ntok]
                d += 1
                offset += ntok
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
                    raise BadRecordError(f"{where}: {reason.replace('_', ' ')} (strict mode; drop data.strict / "
                                         f"--strict to count and skip such records instead)")
                st["skipped"][reason] += 1
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
        bar.update(batch_bytes)
        bar.set_postfix_str(f"{sum(s['documents'] for s in self.stats):,} docs, "
                            f"{sum(s['tokens'] for s in self.stats) / max(1e-9, time.time() - self.t0):,.0f} tok/s",
                            refresh=False)

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
        pool = ProcessPoolExecutor(self.workers, mp_context=ctx) if self.workers > 1 else _InProcess()
        try:
            with pool:
                inflight: deque = deque()
                for batch in self.batches():
                    recs = [(r.raw, r.fmt) for r in batch]
                    text_field = self.sources[batch[0].pos[0]].text_field  # batches() keeps one source per batch
                    inflight.append((batch, pool.submit(process_batch, recs, text_field, self.dtype.name)))
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
        splits = {s: w.close() for s, w in self.writers.items()}
        empty = [s for s in ("train", "val") if splits[s]["tokens"] == 0]
        if empty:
            raise ValueError(f"the {' and '.join(empty)} split is empty ({sum(s['documents'] for s in self.stats)} "
                             f"documents kept in all): add documents, or change data.val_fraction="
                             f"{self.cfg.val_fraction} / data.validation_sources")
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


def tokenize(cfg: DataConfig, force: bool = False, quiet: bool = False, strict: bool | None = None,
             workers: int | None = None) -> dict:
    """Tokenize ``cfg.sources`` into ``cfg.dataset_dir``; reuse a finished dataset made from the same config and
    resume an interrupted one."""
    out = Path(cfg.dataset_dir)
    fingerprint = data_fingerprint(cfg)
    if (out / MANIFEST).is_file() and not force:
        manifest = json.loads((out / MANIFEST).read_text())
        if manifest.get("format_version") != FORMAT_VERSION:
            if not quiet:
                print(f"tokenize: {out} was written by an older version (format {manifest.get('format_version')}); "
                      f"rebuilding it", file=sys.stderr)
            force = True
        elif manifest.get("fingerprint") == fingerprint:
            if not quiet:
                print(f"tokenize: {out} is up to date ({manifest['splits']['train']['tokens']:,} train tokens); "
                      f"--force to rebuild")
            return manifest
        else:
            raise FileExistsError(f"{out} holds a dataset made from a different data config (fingerprint "
                              f"{manifest.get('fingerprint')} != {fingerprint}); choose another "
                                  f"data.dataset_dir or pass --force to overwrite it")
    if force and out.exists():
        shutil.rmtree(out)
    workers = workers or cfg.workers or os.cpu_count() or 1
    job = _Job(cfg, cfg.strict if strict is None else strict, workers, quiet)
    out.mkdir(parents=True, exist_ok=True)
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
            print(f"  skipped {n:,} {reason.replace('_', ' ')}: first at {', '.join(where)}")

