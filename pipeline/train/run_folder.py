"""A run folder's bookkeeping around training: the one-job lock, one metrics history, what changed in the recipe.

``runs/NAME/`` is owned by one job (rank 0 holds ``.lock``, see :mod:`pipeline.locking`); ``metrics.jsonl`` holds
one history (a resume cuts it back to the resumed step, a restart from step 0 moves the older one aside); each
checkpoint keeps the recipe it was trained with and a resume lists what changed since.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from pipeline.locking import FALLBACK_FILE, LOCK_FILE, FolderLock, FolderLockedError

METRICS = "metrics.jsonl"


def lock_run_folder(run_dir: Path, backend) -> FolderLock | None:
    """Global rank 0 takes the run folder's lock for the life of the job (creating the folder: not before, so that a
    job that fails its checks leaves none); every rank stops when it cannot be had. None off rank 0."""
    lock, error = None, None
    if backend.is_main:
        try:
            lock = FolderLock(run_dir, "run folder",
                              fix=", or train this recipe under another name= (a new run folder)").acquire()
        except OSError as e:  # FolderLockedError, or the folder cannot be made
            error = e
    if not backend.all_true(error is None):
        if error is not None:
            raise error
        raise FolderLockedError(f"rank 0 could not take the run folder {run_dir} (see its error)")
    return lock


def release_run_folder(lock: FolderLock | None, run_dir: Path, created: bool) -> None:
    """Release the lock; a folder this job created and wrote nothing into is removed again (before the release: a
    job waiting for the lock then finds the folder gone and makes a new one)."""
    if lock is None:
        return
    if created and run_dir.is_dir() and not any(p.name not in (LOCK_FILE, FALLBACK_FILE) for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)
    lock.release()


def start_fresh_metrics(run_dir: Path, is_main: bool) -> None:
    """A run that starts from step 0 in a folder holding an older history: that history is moved aside."""
    f = run_dir / METRICS
    if is_main and f.is_file() and f.stat().st_size:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(f.stat().st_mtime))
        aside = f.with_name(f"metrics.before-{stamp}.jsonl")
        os.replace(f, aside)
        print(f"note: {run_dir} has no checkpoint, so training starts from step 0; the earlier metrics moved to "
              f"{aside.name}", file=sys.stderr, flush=True)


def cut_metrics_back(run_dir: Path, step: int) -> int:
    """Drop the lines of steps after ``step`` (trained again after a resume) and any line a kill cut short, so that
    every reader sees one history. Returns how many lines were dropped."""
    f = run_dir / METRICS
    if not f.is_file():
        return 0
    kept, dropped = [], 0
    for line in f.read_text().splitlines():
        try:
            rec = json.loads(line)
            at = rec.get("step", rec.get("checkpoint"))
        except (ValueError, AttributeError):
            dropped += 1
            continue
        if isinstance(at, int) and at > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = f.with_name(f.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, f)
    return dropped


STOPPED = "stopped.json"  # present while the run is stopped short of max_steps by a signal


def mark_stopped(run_dir: Path, signal_name: str, step: int, max_steps: int, checkpoint: Path) -> None:
    """Say in the run folder that this run was stopped, not finished: launchers (torchrun) replace the ranks' exit
    status with their own, so a script checks this file instead (removed when the run trains again)."""
    (run_dir / STOPPED).write_text(json.dumps({
        "signal": signal_name, "step": step, "max_steps": max_steps, "checkpoint": str(checkpoint),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resume": "run the same command again"}, indent=2) + "\n")


def clear_stopped(run_dir: Path) -> None:
    (run_dir / STOPPED).unlink(missing_ok=True)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        out.update(_flat(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def recipe_changes(saved: dict, now: dict) -> list[str]:
    """``key: old -> new`` for every recipe value that differs between a checkpoint and this launch."""
    a, b = _flat(saved), _flat(now)
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
