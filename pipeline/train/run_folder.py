"""A run folder's bookkeeping around training: the one-job lock, the checkpoint to resume (verified), one metrics
history, what changed in the recipe, whether the run was stopped.

``runs/NAME/`` is owned by one job (rank 0 holds ``.lock``, see :mod:`pipeline.runtime.locking`); ``metrics.jsonl``
holds one history (a resume cuts it back to the resumed step, a restart from step 0 moves the older one aside); each
checkpoint keeps the recipe it was trained with and a resume lists what changed since.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from pipeline.config.loading import with_current_keys
from pipeline.config.recipe_files import changed_keys
from pipeline.config.recipe_files import flat
from pipeline.runtime.locking import FALLBACK_FILE
from pipeline.runtime.locking import LOCK_FILE
from pipeline.runtime.locking import FolderLock
from pipeline.runtime.locking import FolderLockedError
from pipeline.train.checkpoint import INDEX
from pipeline.train.checkpoint import list_checkpoints
from pipeline.train.checkpoint import set_aside
from pipeline.train.checkpoint import verify_checkpoint

METRICS = "metrics.jsonl"


def lock_run_folder(run_dir: Path, backend, url: str | None = None) -> list[FolderLock] | None:
    """Global rank 0 takes the run folder's lock for the life of the job (creating the folder: not before, so that a
    job that fails its checks leaves none); every rank stops when it cannot be had. A run kept on object storage
    (``url``) is locked there first (a conditional PUT: jobs on other hosts see it), then in the working copy. None
    off rank 0."""
    locks, error = [], None
    if backend.is_main:
        try:
            for folder in ([url] if url else []) + [run_dir]:
                locks.append(FolderLock(folder, "run folder",
                                        fix=", or train this recipe under another name= (a new run folder)").acquire())
        except OSError as e:  # FolderLockedError, or the folder cannot be made
            error = e
            for lock in reversed(locks):
                lock.release()
    if not backend.all_true(error is None):
        if error is not None:
            raise error
        raise FolderLockedError(f"rank 0 could not take the run folder {url or run_dir} (see its error)")
    return locks if backend.is_main else None


def release_run_folder(locks: list[FolderLock] | None, run_dir: Path, created: bool) -> None:
    """Release the lock; a folder this job created and wrote nothing into is removed again (before the release: a
    job waiting for the lock then finds the folder gone and makes a new one)."""
    if locks is None:
        return
    if created and run_dir.is_dir() and not any(p.name not in (LOCK_FILE, FALLBACK_FILE) for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)
    for lock in reversed(locks):
        lock.release()


def newest_intact_checkpoint(ckpt_dir: Path, run_dir: Path, be) -> tuple[Path | None, list[Path]]:
    """The newest checkpoint that matches its index, every rank hashing its share of the files and all taking
    the same decision. A damaged one is moved aside by rank 0 (named in a warning) and the next older one tried;
    one without an index is skipped (it may be a trusted checkpoint of an older grt: --adopt) and, when an older
    one is resumed, renamed unindexed_step_* out of the way of saves and pruning. Returns the choice and the
    checkpoints skipped for having no index."""
    unindexed = []
    for candidate in reversed(list_checkpoints(ckpt_dir)):
        problems = verify_checkpoint(candidate, share=(be.rank, be.world_size))
        if be.all_true(not problems, patient=True):
            if unindexed and be.is_main:  # newer than the one resumed: out of the way of saves and pruning
                for c in unindexed:
                    moved = c.with_name(f"unindexed_{c.name}")
                    os.replace(c, moved)
                    print(f"warning: renamed {c} (no index) to {moved.name}: training goes on from {candidate}. "
                          f"If you trust it, stop, rename it back and run `grt checkpoint verify {run_dir} "
                          f"--adopt`", file=sys.stderr, flush=True)
            be.barrier()
            return candidate, unindexed
        no_index = not (candidate / INDEX).is_file()  # the same answer on every rank
        if no_index:
            unindexed.append(candidate)
        if problems and (be.is_main or not no_index):
            who = f"rank {be.rank}: " if be.world_size > 1 else ""
            print(f"warning: {who}checkpoint {candidate} is damaged ({'; '.join(problems)})", file=sys.stderr,
                  flush=True)
        be.barrier(patient=True)
        if be.is_main:
            if no_index:
                print(f"warning: skipped {candidate} (no index; left where it is); trying the checkpoint "
                      f"before it", file=sys.stderr, flush=True)
            else:
                print(f"warning: moved {candidate} aside to {set_aside(candidate)} (delete it once inspected); "
                      f"trying the checkpoint before it", file=sys.stderr, flush=True)
        be.barrier(patient=True)
    return None, unindexed


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


def recipe_changes(saved: dict, now: dict) -> list[str]:
    """``key: old -> new`` for every recipe value that differs between a checkpoint and this launch, both read with
    today's keys (:func:`~pipeline.config.loading.with_current_keys`: an old run's ``train.bptt_k: 4`` is today's
    ``model.backprop_steps: 4``, no change)."""
    a, b = flat(with_current_keys(saved)), flat(with_current_keys(now))
    keys = [k for k in changed_keys(a, b) if not (a.get(k) == {} and k not in b or b.get(k) == {} and k not in a)]
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in keys]  # (an emptied dict: its keys)
