"""`grt tokenize merge DIR`: the dataset of N finished tokenize tasks, byte-identical to a one-node run.

The events of tasks 0..N-1 (:mod:`pipeline.tokenize.tasks`) are, end to end, the one-node job's records in its reading
order. They are replayed, with the documents' tokens, through the one-node job's own record handling
(:meth:`pipeline.tokenize.stage._Job.handle`): dedup (first occurrence wins), ``max_bytes`` caps, the split by content
hash, shard packing, the counts and the manifest are its own. The merge holds the dataset folder's lock, is resumable
after kill -9 through the same state (``DATASET/.progress``), and removes the task folders once the manifest is written.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from pipeline.config import DataConfig
from pipeline.config import from_dict
from pipeline.tokenize.sources import Record
from pipeline.tokenize.stage import BATCH_RECORDS
from pipeline.tokenize.stage import MISSING
from pipeline.tokenize.stage import _finished
from pipeline.tokenize.stage import _Job
from pipeline.tokenize.stage import _lock_dataset
from pipeline.tokenize.stage import data_fingerprint
from pipeline.tokenize.stage import report
from pipeline.tokenize.tasks import DOCS
from pipeline.tokenize.tasks import EVENT
from pipeline.tokenize.tasks import PLAN
from pipeline.tokenize.tasks import TASKS
from pipeline.tokenize.tasks import read_done
from pipeline.tokenize.tasks import split_units
from pipeline.tokenize.tasks import task_command
from pipeline.tokenize.tasks import task_dir
from pipeline.tokenize.tokenizers import keep_copy
from pipeline.tokenize.worker import DOC
from pipeline.tokenize.worker import BatchResult
from pipeline.tokenize.writer import MANIFEST

MERGED = ".tasks.merged"  # the task folders of a finished merge, being removed


def read_plan(dataset_dir: str | Path) -> dict:
    """The plan of the run the task folders under ``DIR/.tasks`` belong to. Folders of another run (another --tasks or
    data config: an earlier attempt) are never mixed in: the merge refuses, naming them and what to do."""
    root = Path(dataset_dir) / TASKS
    runs: dict[tuple, list[tuple[float, str, dict]]] = {}  # (tasks, fingerprint) -> (mtime, folder, plan)
    no_plan: list[str] = []
    for d in sorted((p for p in root.iterdir() if p.is_dir()), key=_folder_order) if root.is_dir() else []:
        try:
            plan, mtime = json.loads((d / PLAN).read_text()), (d / PLAN).stat().st_mtime
        except (OSError, ValueError):
            no_plan.append(d.name)  # a task killed before it wrote its plan, or not a task's folder
            continue
        runs.setdefault((plan["tasks"], plan.get("fingerprint")), []).append((mtime, d.name, plan))
    if not runs:
        raise FileNotFoundError(f"{dataset_dir} holds no tokenize tasks ({root} is missing or empty); run "
                                f"`grt tokenize RECIPE --tasks N --task-id I` for I in 0..N-1 first")
    newest = max(runs, key=lambda k: max(m for m, _, _ in runs[k]))
    plan, tasks = max(runs[newest], key=lambda r: r[0])[2], newest[0]
    ids = {str(i) for i in range(tasks)}
    replaced = [(f, k) for k in runs if k != newest for _, f, _ in runs[k] if f in ids]
    leftover = [(f, k) for k in runs if k != newest for _, f, _ in runs[k] if f not in ids]
    leftover += [(f, None) for f in no_plan if f not in ids]
    if replaced or leftover:
        def run(k):
            return "no task's plan" if k is None else f"--tasks {k[0]}, data fingerprint {k[1]}"

        parts = [f"the newest run is --tasks {tasks} (data fingerprint {newest[1]}, recipe {plan['recipe']}), and "
                 f"the merge never mixes in another run's folders"]
        if replaced:
            parts.append(f"folder{'s' if len(replaced) > 1 else ''} "
                         f"{', '.join(f'{f} ({run(k)})' for f, k in replaced)} must be redone for this run: "
                         + "; ".join(f"`{task_command(plan['recipe'], tasks, int(f))}`" for f, _ in replaced[:3]))
        if leftover:
            parts.append(f"folder{'s' if len(leftover) > 1 else ''} "
                         f"{', '.join(f'{f} ({run(k)})' for f, k in leftover)} {'are' if len(leftover) > 1 else 'is'}"
                         f" left from another run: remove {'them' if len(leftover) > 1 else 'it'} (`rm -r "
                         f"{' '.join(str(root / f) for f, _ in leftover)}`)")
        raise FileExistsError(f"{root} holds task folders of another run: {'; '.join(parts)}; then merge again")
    return plan


def _folder_order(p: Path) -> tuple:
    return (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name)


def unfinished(dataset_dir: str | Path, cfg: DataConfig, tasks: int) -> list[int]:
    """The tasks with no finished record of this config."""
    fp = data_fingerprint(cfg)
    return [i for i in range(tasks)
            if (read_done(dataset_dir, i) or {}).get("fingerprint") != f"{fp}/task {i} of {tasks}"]


def unit_problems(out: Path, job: _Job, tasks: int, recipe: str) -> str | None:
    """None when the units the finished tasks read are exactly the split of the sources (as they are now) for
    ``tasks`` tasks; else the one line that names the missing, doubled or changed units and the tasks to redo."""
    expected = split_units([u for us in job.units for u in us], tasks)
    got = [(read_done(out, i) or {}).get("units") for i in range(tasks)]
    bad = [i for i in range(tasks) if got[i] != expected[i]]
    if not bad:
        return None
    want = {tuple(u): i for i, us in enumerate(expected) for u in us}
    now = {(u[0], u[2]): u for us in expected for u in us}  # by (source, file): a file's index moves when another
    seen: dict[tuple, list[int]] = {}  # is added or removed before it
    for i, us in enumerate(got):
        for u in us or []:
            seen.setdefault(tuple(u), []).append(i)

    def name(u, tasks_=None) -> str:
        size = "" if u[3] is None else f" at {u[3]:,} bytes"
        return f"{u[2]}{size}" + (f" (task{'s' if len(tasks_) > 1 else ''} {', '.join(map(str, tasks_))})"
                                  if tasks_ else "")

    def change(u) -> str:
        n = now.get((u[0], u[2]))
        if n is None:
            return "now gone"
        if n[3] != u[3]:
            return "now " + ("of unknown size" if n[3] is None else f"{n[3]:,} bytes")
        return f"now unit {n[1]} of its source, not {u[1]} (a file added or removed before it)"

    read = {(u[0], u[2]) for u in seen}
    missing = [u for u in want if (u[0], u[2]) not in read]
    changed = [(u, ts) for u, ts in seen.items() if u not in want]
    twice = [(u, ts) for u, ts in seen.items() if len(ts) > 1]
    moved = [(u, ts) for u, ts in seen.items() if u in want and len(ts) == 1 and want[u] != ts[0]]
    details = []
    for what, items in (("in no task", [(u, None) for u in missing]), ("read twice", twice),
                        ("read by a task whose slice it is not", moved)):
        if items:
            details.append(f"{what}: {', '.join(name(u, ts) for u, ts in items[:4])}{' ...' if len(items) > 4 else ''}")
    if changed:
        details.append("not as the sources are now: " + ", ".join(
            f"{name(u, ts)}, {change(u)}" for u, ts in changed[:4]) + (" ..." if len(changed) > 4 else ""))
    if any(g is None for g in got):
        details.append(f"task{'s' if sum(g is None for g in got) > 1 else ''} "
                       f"{', '.join(str(i) for i in range(tasks) if got[i] is None)} recorded no unit list")
    how = "; ".join(f"`{task_command(recipe, tasks, i, force=True)}`" for i in bad[:3])
    return (f"{out}: the units the tasks read are not the split of the sources for {tasks} tasks "
            f"({'; '.join(details) or 'another order'}); redo task{'s' if len(bad) > 1 else ''} "
            f"{', '.join(map(str, bad))}: {how}{' ...' if len(bad) > 3 else ''}, then merge again")


class _Tokens:
    """A task's document tokens, read in order from its docs shards."""

    def __init__(self, folder: Path, shards: list[dict], dtype: np.dtype):
        self.arrays = [np.memmap(folder / s["file"], dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
                       for s in shards if s["tokens"]]
        self.i, self.at = 0, 0

    def take(self, n: int) -> np.ndarray:
        parts = []
        while n:
            a = self.arrays[self.i]
            k = min(n, a.size - self.at)
            parts.append(a[self.at:self.at + k])
            self.at, n = self.at + k, n - k
            if self.at == a.size:
                self.i, self.at = self.i + 1, 0
        return np.concatenate(parts) if len(parts) != 1 else np.asarray(parts[0])


class MergeJob(_Job):
    """The one-node job, its records read back from the tasks' events instead of from the sources."""

    def __init__(self, cfg: DataConfig, strict: bool, quiet: bool, tasks: int):
        super().__init__(cfg, strict, 1, quiet)
        self.tasks = tasks

    def task_batches(self, task_id: int) -> Iterator[tuple[list[Record], BatchResult]]:
        done = read_done(self.cfg.dataset_dir, task_id)
        folder = task_dir(self.cfg.dataset_dir, task_id)
        tokens = _Tokens(folder, done["docs"]["shards"], self.dtype)
        for tag in range(1, done["event_files"] + 1):
            ev = np.fromfile(folder / ".progress" / f"events_{tag:06d}.npy", dtype=EVENT)
            fields = iter(json.loads((folder / ".progress" / f"fields_{tag:06d}.json").read_text()))
            recs, kinds, hashes, ntoks, nbytes, toks, missing = [], [], [], [], [], [], []
            for e in ev:
                kind, pos = int(e["kind"]), (int(e["source"]), int(e["unit"]), int(e["record"]))
                doc = tokens.take(int(e["tokens"])) if kind == DOC else None
                f = tuple(next(fields)) if kind == MISSING else ()
                if pos <= tuple(self.position):  # handled before the merge was resumed
                    continue
                if recs and (recs[-1].pos[0] != pos[0] or len(recs) >= BATCH_RECORDS):
                    yield recs, _result(kinds, hashes, ntoks, nbytes, toks, missing, self.dtype)
                    recs, kinds, hashes, ntoks, nbytes, toks, missing = [], [], [], [], [], [], []
                recs.append(Record(None, "", pos, int(e["raw_bytes"])))
                kinds.append(kind)
                if kind == DOC:
                    hashes.append(int(e["hash"]))
                    ntoks.append(int(e["tokens"]))
                    nbytes.append(int(e["bytes"]))
                    toks.append(doc)
                elif kind == MISSING:
                    missing.append(f)
            if recs:
                yield recs, _result(kinds, hashes, ntoks, nbytes, toks, missing, self.dtype)

    def run(self) -> dict:
        self.t0 = time.time()
        keep_copy(self.tok, self.out)  # the tokenizer's copy a one-node run keeps
        bar = tqdm(total=None, unit="B", unit_scale=True, desc="tokenize merge: input replayed", disable=self.quiet,
                   mininterval=1.0)
        try:
            for t in range(self.tasks):
                for recs, res in self.task_batches(t):
                    self.handle(recs, res, bar)
        finally:
            bar.close()
        return self.finish()


def _result(kinds, hashes, ntoks, nbytes, toks, missing, dtype) -> BatchResult:
    return BatchResult(kinds=np.array(kinds, dtype=np.int8), hashes=np.array(hashes, dtype=np.uint64),
                       ntokens=np.array(ntoks, dtype=np.int64), nbytes=np.array(nbytes, dtype=np.int64),
                       tokens=np.concatenate(toks).astype(dtype) if toks else np.empty(0, dtype),
                       missing_fields=missing)


def merge(dataset_dir: str | Path, quiet: bool = False, strict: bool | None = None, force: bool = False) -> dict:
    """Write the dataset of the finished tasks under ``dataset_dir/.tasks``; ``force``: also over a finished dataset
    (of this config or another) found in the folder."""
    out = Path(dataset_dir)
    shutil.rmtree(out / MERGED, ignore_errors=True)  # the task folders of a merge killed as it removed them
    if (out / MANIFEST).is_file() and not (out / TASKS).is_dir():
        with open(out / MANIFEST) as f:
            manifest = json.load(f)
        if not quiet:
            print(f"tokenize merge: {out} is already merged ({manifest['splits']['train']['tokens']:,} train tokens)")
        return manifest
    plan = read_plan(out)
    tasks, recipe = plan["tasks"], plan["recipe"]
    cfg = from_dict({"data": plan["data"]}, source=f"{out / TASKS}/*/{PLAN}", saved=True).data
    # the recipe's dataset_dir may be relative to where the tasks ran: the folder merged is the one given
    cfg = dataclasses.replace(cfg, dataset_dir=str(out))
    missing = unfinished(out, cfg, tasks)
    if missing:
        how = "; ".join(f"`{task_command(recipe, tasks, i)}`" for i in missing[:3])
        raise FileNotFoundError(f"{out}: task{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                                f"{tasks} {'are' if len(missing) > 1 else 'is'} missing or unfinished; run {how}"
                                f"{' ...' if len(missing) > 3 else ''}, then merge again")
    job = MergeJob(cfg, cfg.strict if strict is None else strict, quiet, tasks)
    problem = unit_problems(out, job, tasks, recipe)
    if problem:
        raise ValueError(problem)
    lock = _lock_dataset(out, 0.0)
    try:
        manifest = None if force else _finished(out, job.fingerprint)[0]
        if manifest is None:
            (out / MANIFEST).unlink(missing_ok=True)
            if not job.load_state():
                shutil.rmtree(job.progress_dir, ignore_errors=True)
                for f in out.glob("*_[0-9][0-9][0-9][0-9][0-9][0-9].*"):
                    f.unlink()
            job.progress_dir.mkdir(exist_ok=True)
            t0 = time.time()
            manifest = job.run()
            if not quiet:
                report(manifest, out, time.time() - t0, 1)
        # what the tasks created goes once the manifest is in place, renamed first: a merge killed while deleting
        # leaves no half-removed task folders for the next merge to take for missing tasks
        (out / TASKS).rename(out / MERGED)
        shutil.rmtree(out / MERGED, ignore_errors=True)
    finally:
        lock.release()
    if not quiet:
        print(f"tokenize merge: {tasks} tasks merged into {out}", file=sys.stderr)
    return manifest


__all__ = ["merge", "read_plan", "unfinished", "unit_problems", "DOCS"]
