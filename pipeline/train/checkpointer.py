"""Checkpointing beside the trainer: resume from the newest intact checkpoint, save (in the background with
``train.async_checkpoint``), publish once every rank has written its part, and stop every rank together when a save
does not fit on its disk. The format and the index on disk are :mod:`pipeline.train.checkpoint`'s; the run folder's
bookkeeping (metrics history, stopped.json) is :mod:`pipeline.train.run_folder`'s."""
from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path

from pipeline.config.loading import with_current_keys
from pipeline.config.recipe_files import changed_keys
from pipeline.runtime import storage
from pipeline.runtime.exit_status import DiskFull
from pipeline.runtime.locking import launch_job_id
from pipeline.runtime.storage import StorageError
from pipeline.train.branch import branch_point
from pipeline.train.branch import set_by_branch
from pipeline.train.checkpoint import INDEX
from pipeline.train.checkpoint import INDEX_VERSION
from pipeline.train.checkpoint import disk_full_cause
from pipeline.train.checkpoint import disk_full_message
from pipeline.train.checkpoint import hash_share
from pipeline.train.checkpoint import list_checkpoints
from pipeline.train.checkpoint import load_checkpoint
from pipeline.train.checkpoint import prepare_staging
from pipeline.train.checkpoint import publish
from pipeline.train.checkpoint import set_aside_names
from pipeline.train.checkpoint import staging_dir
from pipeline.train.curriculum import tokens_through
from pipeline.train.relaunch import record_relaunch
from pipeline.train.relaunch import relaunch_from_env
from pipeline.train.run_folder import cut_metrics_back
from pipeline.train.run_folder import mark_stopped
from pipeline.train.run_folder import newest_intact_checkpoint
from pipeline.train.run_folder import recipe_changes
from pipeline.train.run_folder import start_fresh_metrics
from pipeline.train.run_store import RunStore
from pipeline.train.run_store import committed_steps
from pipeline.train.run_store import step_url


def model_config_diff(saved_recipe: dict, now: dict) -> list[str]:
    """``model.KEY: checkpoint A != recipe B`` for each model value of the checkpoint's whole recipe (read with
    today's keys: an old run's ``train.bptt_k`` is its ``model.backprop_steps``) that differs from ``now``, this
    launch's model section."""
    saved = with_current_keys(saved_recipe).get("model") or {}
    return [f"model.{k}: checkpoint {saved.get(k)!r} != recipe {now.get(k)!r}" for k in changed_keys(saved, now)
            if k != "depth_schedule"]  # a training curriculum, not the weights: it may change on a resume


def attempt(fn, *args) -> tuple:
    """``(fn(*args), None)``, or ``(None, what it raised)``: a failed part of a save is agreed on by every rank before
    any acts on it. (torch.distributed.checkpoint raises CheckpointException, a BaseException.)"""
    try:
        return fn(*args), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        return None, e


class PeakRSS:
    """This process's peak resident memory over a stretch of code (Linux: the kernel's high-water mark, reset by
    writing 5 to /proc/self/clear_refs; elsewhere only the RSS at the end is known)."""

    def __init__(self):
        import psutil

        self._proc = psutil.Process()
        self.before = self._proc.memory_info().rss
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.exact = True
        except OSError:
            self.exact = False

    def measure(self) -> dict:
        peak = None
        if self.exact:
            with open("/proc/self/status") as f:
                peak = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), None)
        peak = max(peak or 0, self._proc.memory_info().rss)
        now = self._proc.memory_info().rss
        return {"rss_before_mb": self.before / 2**20, "rss_peak_mb": max(peak, now) / 2**20,
                "rss_peak_over_before_mb": (max(peak, now) - self.before) / 2**20, "rss_now_mb": now / 2**20}


class Checkpointer:
    """The checkpoints of one run folder (``RUN/checkpoints/step_NNNNNNNN``). Its methods take the trainer, as the
    callbacks do: what a checkpoint holds is the trainer's (model, optimizer, loader, step counters), and a published
    checkpoint is announced to the trainer's callbacks (``on_checkpoint``; the fault hooks' ``on_save_*``)."""

    def __init__(self, cfg, backend):
        self.cfg, self.backend = cfg, backend
        self.run_dir = cfg.run_dir
        self.dir = self.run_dir / "checkpoints"
        self.stopped_together = False  # a full disk stopped every rank at the same agreement
        self._pending = None  # (future or None, step, start time, PeakRSS or None, error) of the save in flight
        self.relaunch = None  # a torchrun restart or SLURM requeue of this job, agreed by :meth:`resume`
        self.relaunch_line = None  # its log line, once resumed (rank 0)
        # out_dir on object storage: the store keeps the run, run_dir is this node's working copy
        self.store = RunStore(cfg.run_url, self.run_dir, backend) if cfg.run_url else None

    # ------------------------------------------------------------------------------------------ where
    @property
    def kept_at(self) -> str:
        """Where the run's checkpoints are kept, as said to users: on object storage, the store's folder."""
        return storage.join(self.store.url, "checkpoints") if self.store else str(self.dir)

    def folder(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}"

    def has(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is published."""
        return self.folder(step).is_dir()

    def newest(self) -> Path | None:
        """The newest published checkpoint (a save in flight is not published yet)."""
        published = list_checkpoints(self.dir)
        return published[-1] if published else None

    def mark_stopped_at_newest(self, why: str, write: bool) -> tuple[int, Path | None]:
        """(step, folder) of the newest published checkpoint, the one a relaunch resumes from (a save in flight was
        never published); with ``write``, stopped.json says the run stopped there because of ``why`` (a few hundred
        bytes: skipped if even those do not fit on a full disk)."""
        newest = self.newest()
        step = int(newest.name.split("_")[1]) if newest else 0
        if write:
            try:
                mark_stopped(self.run_dir, why, step, self.cfg.train.max_steps, newest or Path("none"))
            except OSError:
                pass
        return step, newest

    # ------------------------------------------------------------------------------------------ resume
    def resume(self, trainer) -> None:
        """Load the newest intact checkpoint into the trainer (model, optimizer, loader, step counters), or start the
        run folder's metrics afresh when there is none; refuse what cannot be resumed, saying why and what to do."""
        self.relaunch = relaunch_from_env(backend=self.backend)  # every rank: the group's highest counts
        if self.store is not None:  # this node's copy made to hold what the store holds intact
            if (self.cfg.train.resume == "never" and self.relaunch is None and self.cfg.train.branch_from is None
                    and committed_steps(self.store.url)):  # refused before anything is fetched or moved
                raise FileExistsError(f"{self.store.url} already has checkpoints and train.resume=never; choose "
                                      f"another name= or delete {self.kept_at}")
            t0 = time.perf_counter()
            pulled = self.store.pull_for_resume()  # (checked file by file: not verified again below)
            if pulled is not None and self.backend.is_main:
                print(f"resume: checkpoint step {pulled} of {self.store.url} on this node's copy {self.run_dir} in "
                      f"{time.perf_counter() - t0:.1f} s (each file checked against its index)", flush=True)
        # a branch (train.branch_from) before its first save starts from its parent's checkpoint, resumed as any
        branching = self.cfg.train.branch_from is not None and not list_checkpoints(self.dir)
        if not list_checkpoints(self.dir) and not branching:
            aside = set_aside_names(self.dir)
            if aside:  # a relaunch after "every checkpoint is damaged" must not quietly start over
                raise ValueError(f"{self.dir} holds only checkpoints set aside as damaged ("
                                 f"{', '.join(aside)}): nothing to resume from. Start the run over "
                                 f"under another name=, or remove {self.dir} to train this one from scratch")
            start_fresh_metrics(self.run_dir, self.backend.is_main)
            self._record_relaunch(None, 0)
            return
        # the one resume rule (pipeline/train/relaunch.py): a relaunch resumes its own job's checkpoints, whatever
        # train.resume says
        if self.cfg.train.resume == "never" and not branching and self.relaunch is None:
            raise FileExistsError(f"{self.store.url if self.store else self.run_dir} already has checkpoints and "
                                  f"train.resume=never; choose another name= or delete {self.kept_at}")
        if branching:
            newest, unindexed = branch_point(self.cfg, self.backend), []
        elif self.store is not None and pulled is not None:  # the copy holds just the checkpoint the pull checked
            newest, unindexed = self.folder(pulled), []
        else:
            newest, unindexed = newest_intact_checkpoint(self.dir, self.run_dir, self.backend)
        if newest is None and unindexed:
            raise ValueError(f"no checkpoint under {self.dir} can be verified: {len(unindexed)} have no "
                             f"{INDEX} ({', '.join(c.name for c in unindexed)}; see the warnings). If they were "
                             f"written by a grt before checkpoints carried an index and you trust them, `grt "
                             f"checkpoint verify {self.run_dir} --adopt` indexes them; then run this command again")
        if newest is None:
            raise ValueError(f"every checkpoint under {self.dir} is damaged (each moved aside as damaged_step_*, "
                             f"see the warnings): nothing to resume from. Start the run over under another name=, "
                             f"or remove {self.dir} to train this one from scratch")
        t0, rss = time.perf_counter(), PeakRSS()
        state = load_checkpoint(newest, map_location="cpu", verify=False)
        self._check_own_job(newest, state, branching)
        diff = model_config_diff(state["recipe"], dataclasses.asdict(self.cfg.model))
        if diff:
            raise ValueError(f"cannot resume {newest}: the model changed since it was saved ({'; '.join(diff)}). "
                             f"Restore the recipe or start a new run under another name=")
        self._load_into(trainer, newest, state)
        trainer.spike.load_state_dict(state.get("spike"))
        trainer.tracker_run_id = None if branching else state.get("mlflow_run_id")  # a branch: not its parent's
        saved_recipe = state["recipe"]
        del state  # the checkpoint's tensors (a mapping, or whole copies) go now; what stays is the loaded state
        self._report_resume(newest, time.perf_counter() - t0, rss)
        if self.backend.is_main:
            changes = recipe_changes(saved_recipe, self.cfg.to_dict())
            if branching:  # what grt branch set is the branch itself, not a change to warn of
                changes = [c for c in changes if not set_by_branch(c.split(":", 1)[0])]
            if changes:
                what = ("the branch's recipe differs from its parent's at" if branching else
                        "the recipe changed since")
                print(f"note: {what} the checkpoint at step {trainer.step} ({newest / 'recipe.yaml'}): "
                      f"{'; '.join(changes)}", file=sys.stderr, flush=True)
            cut_metrics_back(self.run_dir, trainer.step)
        self._record_relaunch(newest, trainer.step)

    def _check_own_job(self, newest: Path, state: dict, branching: bool) -> None:
        """train.resume=never lets a relaunch resume only the checkpoints its own job wrote: relaunch counters in the
        environment of another job (a new job started inside a requeued allocation) do not open a finished run."""
        if self.cfg.train.resume != "never" or branching or self.relaunch is None:
            return
        mine, theirs = launch_job_id(), state.get("job")
        if mine != theirs:
            raise FileExistsError(f"{self.run_dir} already has checkpoints and train.resume=never; this process is a "
                                  f"relaunch ({self.relaunch.counters}) of {mine or 'an unnamed job'}, but {newest} "
                                  f"was written by {theirs or 'an unnamed job'}: choose another name= or delete "
                                  f"{self.kept_at}")

    def _record_relaunch(self, folder: Path | None, step: int) -> None:
        if self.relaunch is not None and self.backend.is_main:
            self.relaunch_line = record_relaunch(self.relaunch, self.run_dir, folder, step)

    def reload(self, trainer, folder: Path) -> None:
        """train.spike's rollback: load ``folder`` (the newest checkpoint, or a branch's starting point; the caller
        has published any save in flight) into the running trainer as :meth:`resume` does, the metrics history kept
        (it records the rollback)."""
        if self.store is not None and folder.parent == self.dir:  # a node-local disk holds its own ranks' files only
            self.store.complete_local(int(folder.name.split("_")[1]))
        state = load_checkpoint(folder, map_location="cpu", verify=False)
        self._load_into(trainer, folder, state)
        trainer.spike.rolled_back(state.get("spike"))

    def _load_into(self, trainer, folder: Path, state: dict) -> None:
        """The checkpoint ``state`` (read from ``folder``) into the trainer: model, optimizer, loader, step counters."""
        self.backend.load_model_optimizer(trainer.model, trainer.optimizer, folder, state)
        trainer.loader.load_state_dict(state["loader"])
        trainer.step = state["step"]
        trainer.skipped_steps = state.get("skipped_steps", 0)
        trainer.tokens_seen = state.get("tokens_seen", tokens_through(self.cfg, trainer.step))  # (older: none)

    def _report_resume(self, folder: Path, seconds: float, rss: PeakRSS) -> None:
        """One line on rank 0: how long the load took and the host memory it took on the ranks, summed: the rise of
        each rank's peak resident memory over the load, and of that what was only held while loading (the rest
        stays: the optimizer state made by the load, which a fresh run makes at its first step)."""
        import gc

        gc.collect()
        m = rss.measure()
        be = self.backend
        peak, transient = m["rss_peak_over_before_mb"], m["rss_peak_mb"] - m["rss_now_mb"]
        peak_sum, transient_sum = (be.reduce_mean(v) * be.world_size for v in (peak, transient))
        transient_max = be.reduce_max(transient)
        if be.is_main:
            print(f"resume: {folder} loaded in {seconds:.1f} s; host memory over the load, summed over "
                  f"{be.world_size} rank(s): peak +{peak_sum:,.0f} MB, of which {transient_sum:,.0f} MB only while "
                  f"loading (at most {transient_max:,.0f} MB on one rank)", flush=True)

    # ------------------------------------------------------------------------------------------ save
    def save(self, trainer) -> Path | None:
        """Every rank takes part; rank 0 publishes the folder atomically once every rank has written its part. With
        ``train.async_checkpoint`` the shards are written in the background and published by :meth:`poll` (returns
        None then). A part that fails on any rank (a full disk) is agreed on by all (:meth:`_agree`)."""
        self.finish(trainer)  # at most one save in flight
        step, be = trainer.step, self.backend
        t0, rss = time.perf_counter(), PeakRSS() if be.is_main else None
        error = None
        if be.is_main:
            _, error = attempt(prepare_staging, self.dir, step)
        self._agree(step, error)
        tmp = staging_dir(self.dir, step)
        state = {"step": step, "loader": trainer.loader.state_dict(), "recipe": self.cfg.to_dict(),
                 "mlflow_run_id": trainer.tracker_run_id, "info": trainer.info,
                 "skipped_steps": trainer.skipped_steps, "world_size": be.world_size,
                 "tokens_seen": trainer.tokens_seen, "job": launch_job_id()}
        if trainer.spike.on:  # train.spike's window (off: the checkpoint as before)
            state["spike"] = trainer.spike.state_dict()
        for cb in trainer.callbacks:
            cb.on_save_start(trainer, step, tmp)
        pending, error = attempt(be.save_model_optimizer, trainer.model, trainer.optimizer, tmp, state)
        for cb in trainer.callbacks:
            cb.on_save_written(trainer, step)
        self._pending = (pending, step, t0, rss, error)
        if pending is None:
            return self.finish(trainer)
        return None

    def poll(self, trainer) -> None:
        """Publish an async save once every rank's background write has finished (one small collective)."""
        if self._pending is not None and self.backend.all_true(self._pending[0].done()):
            self.finish(trainer)

    def finish(self, trainer) -> Path | None:
        """Wait for the save in flight (if any) on every rank, then publish it."""
        if self._pending is None:
            return None
        pending, step, t0, rss, error = self._pending
        self._pending = None
        be = self.backend
        try:
            if pending is not None:
                _, error = attempt(pending.result)  # this rank's background write failed (a full disk: ENOSPC)
            # every wait on another rank's file I/O is patient: rank 0 alone writes a full checkpoint, and a multi-GB
            # write to network storage outlasts collective_timeout_s (and NCCL's watchdog)
            self._agree(step, error)
            tmp = staging_dir(self.dir, step)
            if self.store is not None:
                path = self._publish_to_store(step, tmp)
            else:
                if be.world_size > 1:  # every rank hashes a share of the files for the index (rank 0 the rest)
                    self._agree(step, attempt(hash_share, tmp, be.rank, be.world_size)[1])
                path = self.folder(step)
                if be.is_main:
                    path, error = attempt(publish, self.dir, step, self.cfg.to_yaml(),
                                          self.cfg.train.keep_checkpoints, set(self.cfg.train.keep_steps))
                self._agree(step, error)
        finally:
            for cb in trainer.callbacks:
                cb.on_save_end(trainer)
        info = {"checkpoint": step, "format": self.cfg.train.resolved_checkpoint_format(),
                "checkpoint_s": time.perf_counter() - t0}
        if self.store is not None:
            info["stored"] = step_url(self.store.url, step)
        if rss is not None:
            info.update(rss.measure())
        for cb in trainer.callbacks:
            cb.on_checkpoint(trainer, path, info)
        return path

    def _publish_to_store(self, step: int, tmp: Path) -> Path:
        """out_dir on object storage: rank 0 marks the upload as grt's, every rank uploads its share of the staged
        files, rank 0 uploads the run files then the index last (the commit), then each node publishes its copy
        (pipeline/train/run_store.py)."""
        be, store, tc = self.backend, self.store, self.cfg.train
        error = None
        if be.is_main:
            _, error = attempt(lambda: ((tmp / "recipe.yaml").write_text(self.cfg.to_yaml()),
                                        store.begin_upload(step)))
        self._agree(step, error)
        digests, error = attempt(store.upload_share, tmp, step)
        self._agree(step, error)
        merged = {k: v for part in be.gather(digests) for k, v in part.items()}
        error = None
        if be.is_main:
            self.push_run_files()  # the metrics up to this step are on the store before the step is
            _, error = attempt(store.commit, tmp, step, merged)
        self._agree(step, error)
        if be.is_main:
            store.prune(step, tc.keep_checkpoints, set(tc.keep_steps))
        index = {"version": INDEX_VERSION, "files": dict(sorted(merged.items()))}
        path, error = attempt(store.publish_local, tmp, step, index, tc.keep_checkpoints, set(tc.keep_steps))
        self._agree(step, error)
        return path

    def push_run_files(self) -> None:
        """Rank 0 of a run on object storage: the run files that changed, to the store (a failure is a warning: the
        checkpoints are what a resume needs, and the next push sends them)."""
        if self.store is None or not self.backend.is_main:
            return
        try:
            self.store.push_run_files()
        except (OSError, StorageError) as e:
            print(f"warning: could not upload the run files of {self.run_dir} to {self.store.url}: {e}; the next "
                  f"checkpoint tries again", file=sys.stderr, flush=True)

    def wait(self) -> None:
        """An async save still writing when training failed: let its thread finish before the process groups it
        uses are destroyed (it stays unpublished: the other ranks may not have reached it)."""
        if self._pending is not None and self._pending[0] is not None:
            attempt(self._pending[0].result)  # its error: the one that brought us here is the one to report

    def _agree(self, step: int, error: BaseException | None) -> None:
        """Where the save's barriers stood: every rank learns whether every rank's part of the save of ``step``
        succeeded (one small all-reduce on the patient group). A full disk on any rank stops them all together
        (:meth:`_stop_disk_full`); another failure is raised where it happened and named on the other ranks."""
        code = 0 if error is None else 2 if disk_full_cause(error) is not None else 1
        worst = self.backend.reduce_max(float(code))
        if worst == 0:
            return
        if worst == 2:
            raise self._stop_disk_full(step, disk_full_cause(error))
        if error is not None:
            raise error
        raise OSError(f"another rank failed to save the checkpoint of step {step} (see its error); the checkpoints "
                      f"before it in {self.dir} are intact")

    def _stop_disk_full(self, step: int, cause: OSError | None) -> DiskFull:
        """Every rank, once all have stopped writing the save of ``step``: rank 0 removes that save's staging folder
        (it may hold most of what the disk had left) and writes stopped.json; the newest published checkpoint stays."""
        if self.backend.is_main:
            shutil.rmtree(staging_dir(self.dir, step), ignore_errors=True)
        message = f"error: {disk_full_message(self.dir, step, cause, self.run_dir.parent)}"
        _, newest = self.mark_stopped_at_newest("a full disk", self.backend.is_main)
        if self.backend.is_main:
            # said now, not by the CLI at exit: once the other ranks have exited, torchrun SIGTERMs this one
            print(message, file=sys.stderr, flush=True)
        self.stopped_together = True  # every rank stops here, at the same agreement
        return DiskFull(step, newest, message, report=False)
