"""`grt tokenize RECIPE --tasks N --task-id I`: one slice of a tokenization spread over N processes or nodes.

The slice is a contiguous run of the input's units (files; a Hugging Face dataset is one unit), in the one-node job's
reading order, balanced by bytes on disk: a task reads only its own files, and the slices put end to end are the
one-node job's input. Slicing by document hash instead would make every task read the whole input.

A task decides nothing that depends on other tasks (dedup, ``max_bytes`` caps, the split, shard packing): it writes
every document's tokens, in reading order, to ``DATASET/.tasks/I/docs_*.bin`` and one event per record (position,
kind, content hash, token and byte counts) to ``events_*.npy``. :mod:`pipeline.tokenize.merge` replays the events of
tasks 0..N-1 through the one-node job's own record handling, which makes the dataset byte-identical to a one-node run.

A task is resumable after kill -9 with the one-node job's state machinery (``.progress/state.json``, saved each time a
``docs`` shard is completed); ``task.json``, written last, marks it finished and lists the units it read, which the
merge checks against the split of the sources. ``--force`` redoes a task's slice from scratch.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from pipeline.config import DataConfig
from pipeline.runtime.locking import FolderLock
from pipeline.tokenize.sources import Unit
from pipeline.tokenize.stage import MISSING
from pipeline.tokenize.stage import PROGRESS
from pipeline.tokenize.stage import _finished
from pipeline.tokenize.stage import _Job
from pipeline.tokenize.stage import record_results
from pipeline.tokenize.tokenizers import FILES
from pipeline.tokenize.worker import BLANK
from pipeline.tokenize.worker import DOC
from pipeline.tokenize.writer import MANIFEST
from pipeline.tokenize.writer import ShardWriter
from pipeline.tokenize.writer import atomic_write

TASKS = ".tasks"  # under the dataset folder
DONE = "task.json"  # a finished task's record, written last
PLAN = "plan.json"  # written when a task starts: what `grt tokenize merge DIR` needs to know
DOCS = "docs"  # the split name of a task's document stream
EVENT = np.dtype([("kind", "<i1"), ("source", "<u4"), ("unit", "<u4"), ("record", "<u8"), ("raw_bytes", "<u8"),
                  ("hash", "<u8"), ("tokens", "<u8"), ("bytes", "<u8")])


def task_dir(dataset_dir: str | Path, task_id: int) -> Path:
    return Path(dataset_dir) / TASKS / str(task_id)


def slice_units(sizes: list[int | None], tasks: int) -> list[int]:
    """The task of each unit: contiguous slices, balanced by size (a unit of unknown size counts as the mean)."""
    known = [s for s in sizes if s is not None]
    mean = sum(known) / len(known) if known else 1
    w = [max(1.0, float(mean if s is None else s)) for s in sizes]
    total, before, out = sum(w), 0.0, []
    for x in w:  # the task whose share holds the unit's midpoint: non-decreasing, so each slice is contiguous
        out.append(min(tasks - 1, int(tasks * (before + x / 2) / total)))
        before += x
    return out


def task_command(recipe: str, tasks: int, task_id: int, force: bool = False) -> str:
    return f"grt tokenize {recipe} --tasks {tasks} --task-id {task_id}{' --force' if force else ''}"


def split_units(units: list[Unit], tasks: int) -> list[list[list]]:
    """Each task's units as ``[source, index, name, size]`` (what ``task.json`` records): the deterministic split of
    the sources' units (in reading order) for ``tasks`` tasks."""
    owner = slice_units([u.size for u in units], tasks)
    out: list[list[list]] = [[] for _ in range(tasks)]
    for u, t in zip(units, owner):
        out[t].append([u.source, u.index, u.name, u.size])
    return out


class TaskJob(_Job):
    """The one-node job, reading only its slice and writing documents and events instead of deciding about them."""

    def __init__(self, cfg: DataConfig, strict: bool, workers: int, quiet: bool, tasks: int, task_id: int):
        super().__init__(cfg, strict, workers, quiet)
        self.tasks, self.task_id = tasks, task_id
        self.data_fingerprint = self.fingerprint  # the one-node job's: the merged dataset's
        self.fingerprint = f"{self.fingerprint}/task {task_id} of {tasks}"
        self.slice = split_units([u for us in self.units for u in us], tasks)[task_id]
        self.only = {(source, index) for source, index, _, _ in self.slice}
        self.out = task_dir(cfg.dataset_dir, task_id)
        self.progress_dir = self.out / PROGRESS
        self.tok_spec = "gpt2" if self.tok.kind == "gpt2" else str((self.out / FILES[self.tok.kind]).resolve())
        self.writers = {DOCS: ShardWriter(self.out, DOCS, cfg.shard_tokens, self.dtype)}
        self.events: list[tuple] = []  # since the last snapshot
        self.fields: list[list[str]] = []  # of each record without the text field since the last snapshot

    def handle(self, records, res, bar) -> None:
        for rec, kind, (h, ntok, nbytes, tokens), fields in record_results(records, res):
            self.bytes_read += rec.nbytes
            self.position = rec.pos
            if kind == MISSING:
                self.fields.append(list(fields))
            if kind == BLANK:
                continue
            if kind != DOC and self.strict:
                raise self.bad_record(rec, kind, fields)
            self.events.append((kind, *rec.pos, rec.nbytes, h, ntok, nbytes))
            if kind == DOC and self.writers[DOCS].add_document(tokens):
                self.save_state()
        bar.update(sum(r.nbytes for r in records))

    def _write_events(self, tag: int) -> None:
        atomic_write(self.progress_dir / f"events_{tag:06d}.npy", np.array(self.events, dtype=EVENT).tobytes())
        atomic_write(self.progress_dir / f"fields_{tag:06d}.json", json.dumps(self.fields).encode())
        self.events, self.fields = [], []

    def save_state(self) -> None:
        # written under the next snapshot's number before the state that names it: a kill in between leaves a file
        # the resumed job overwrites
        self._write_events(self.snapshots + 1)
        super().save_state()

    def finish(self) -> dict:
        docs = self.writers[DOCS].close()
        self._write_events(self.snapshots + 1)
        done = {"fingerprint": self.fingerprint, "tasks": self.tasks, "task_id": self.task_id,
                "event_files": self.snapshots + 1, "docs": docs, "units": self.slice}
        atomic_write(self.out / DONE, json.dumps(done).encode())
        return done


def read_done(dataset_dir: str | Path, task_id: int) -> dict | None:
    path = task_dir(dataset_dir, task_id) / DONE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tokenize_task(cfg: DataConfig, tasks: int, task_id: int, recipe: str, quiet: bool = False,
                  strict: bool | None = None, workers: int | None = None, force: bool = False) -> dict | None:
    """Tokenize task ``task_id``'s slice of ``cfg``'s sources into ``DATASET/.tasks/<task_id>``; a finished task is
    kept, an interrupted one resumed, unless ``force``: then the slice is redone from scratch. Returns the task's
    record, or None when the dataset folder already holds this config's finished dataset (nothing to do)."""
    import os

    if tasks < 1 or not 0 <= task_id < tasks:
        raise ValueError(f"--task-id {task_id} is not in 0..{tasks - 1} (--tasks {tasks}); give a task id below "
                         f"--tasks")
    if "://" in str(cfg.dataset_dir):
        raise ValueError(f"data.dataset_dir={cfg.dataset_dir}: --tasks needs a folder every task and the merge share "
                         f"(a shared filesystem), not an object store; tokenize to a shared folder, then upload it")
    strict = cfg.strict if strict is None else strict
    workers = workers or cfg.workers or os.cpu_count() or 1
    job = TaskJob(cfg, strict, workers, quiet, tasks, task_id)
    out = Path(cfg.dataset_dir)
    if not force:  # the folder merged into: another config's dataset is refused (one line, both fingerprints)
        manifest = _finished(out, job.data_fingerprint)[0]
        if manifest is not None:
            if not quiet:
                print(f"tokenize: {out} is up to date ({manifest['splits']['train']['tokens']:,} train tokens); "
                      f"task {task_id} of {tasks} has nothing to do (--force to rebuild)")
            return None
    lock = FolderLock(job.out, "tokenize task folder", fix=f" (task {task_id} of {tasks} runs twice)").acquire()
    try:
        done = None if force else read_done(cfg.dataset_dir, task_id)
        if done is not None and done.get("fingerprint") == job.fingerprint:
            if not quiet:
                print(f"tokenize: task {task_id} of {tasks} is done; run `grt tokenize merge {cfg.dataset_dir}` "
                      f"when all are (--force to redo it)")
            return done
        if force and (out / MANIFEST).is_file():  # the merge then rebuilds the dataset instead of keeping it
            (out / MANIFEST).unlink()
            if not quiet:
                print(f"tokenize: --force: removed {out / MANIFEST}; `grt tokenize merge {out}` rebuilds the dataset "
                      f"once all tasks are done", file=sys.stderr)
        (job.out / DONE).unlink(missing_ok=True)
        resumed = not force and job.load_state()
        if not resumed:  # from scratch: only what a task writes here goes (never other files of the folder)
            shutil.rmtree(job.progress_dir, ignore_errors=True)
            for f in job.out.glob(f"{DOCS}_[0-9][0-9][0-9][0-9][0-9][0-9].*"):
                f.unlink()
        job.progress_dir.mkdir(exist_ok=True)
        plan = {"tasks": tasks, "recipe": recipe, "fingerprint": job.data_fingerprint,
                "data": dataclasses.asdict(cfg)}
        atomic_write(job.out / PLAN, json.dumps(plan).encode())
        if resumed and not quiet:
            print(f"tokenize: task {task_id} of {tasks}: resuming after {job.bytes_read / 1e6:,.1f} MB of input",
                  file=sys.stderr)
        done = job.run()
    finally:
        lock.release()
    if not quiet:
        print(f"tokenize: task {task_id} of {tasks}: {done['docs']['documents']:,} documents, "
              f"{done['docs']['tokens']:,} tokens -> {job.out}; then `grt tokenize merge {cfg.dataset_dir}`")
    return done
