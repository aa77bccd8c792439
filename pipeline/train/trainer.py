"""A small generic trainer: build everything from the recipe, loop, call back. Checkpointing is built in because
resume must restore what the loop owns (step, loader counters); everything optional is a callback.

Randomness: the global RNG is reseeded from (seed, step, micro-batch index over all ranks) before every forward,
so noise and dropout depend on which samples are processed, not on what happened before — after a resume, with
activation checkpointing, or with another world size they are the same — and the recurrence depth comes from
(seed, step) alone, so every rank runs the same number of recurrence steps (FSDP and ZeRO-3 would hang otherwise).
With ``train.depth_granularity=micro_step`` the depth is drawn per micro-step instead (the paper's Algorithm 1 draws
r inside every forward), from (seed, step, micro-step index on this rank): still the same on every rank at the same
micro-step and after a resume, but rank r's micro-step m holds global micro-batch m * world + r, so which samples
meet which depth depends on the world size (see :meth:`Trainer.step_depths`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from ops import set_backend as set_fused_ops_backend
from pipeline.config import RunConfig
from pipeline.exits import DiskFull, TrainingStopped
from pipeline.locking import FolderLock
from pipeline.model import model_class, model_info
from pipeline.tokenize.bpe import tokenizer_identity
from pipeline.tracking import open_training_tracker
from pipeline.train.backend import build_backend
from pipeline.train.peers import failure_line
from pipeline.train import faults
from pipeline.train.callbacks import Callback, ConsoleLogger, TrackerCallback
from pipeline.train.checkpoint import (INDEX, disk_full_cause, disk_full_message, disk_full_while_training, hash_share,
                                       list_checkpoints, load_checkpoint, prepare_staging, publish, set_aside_names,
                                       staging_dir)
from pipeline.train.data import SequenceLoader, TokenShards, check_shards, check_windows, validation_batches
from pipeline.train.materialize import build_for_training
from pipeline.train.mfu import device_peak_flops, peak_flops_report
from pipeline.train.optim import build_optimizer, lr_at
from pipeline.train.run_folder import (STOPPED, clear_stopped, cut_metrics_back, lock_run_folder, mark_stopped,
                                       newest_intact_checkpoint, recipe_changes, release_run_folder,
                                       start_fresh_metrics)


def check_dataset_matches_model(manifest: dict, cfg: RunConfig, where: str = "the dataset") -> None:
    """Refuse a dataset whose tokenizer differs from the recipe's or cannot feed this model, naming both values."""
    tok = manifest["tokenizer"]
    want = tokenizer_identity(cfg.data.tokenizer)
    problems = [f"{key}: dataset {tok.get(key)!r} != recipe's {cfg.data.tokenizer} tokenizer {want[key]!r}"
                for key in ("name", "vocab_hash", "n_vocab", "eot_id") if tok.get(key) != want[key]]
    if tok["n_vocab"] > cfg.model.vocab_size:
        problems.append(f"vocabulary size: dataset {tok['n_vocab']} token ids > model.vocab_size="
                        f"{cfg.model.vocab_size}")
    if problems:
        raise ValueError(f"{where} does not fit this recipe: " + "; ".join(problems) +
                         ". Re-tokenize it with the recipe's tokenizer (grt tokenize RECIPE --force) or fix "
                         "model.vocab_size / data.tokenizer.")


def model_config_diff(saved: dict, now: dict) -> list[str]:
    return [f"model.{k}: checkpoint {saved.get(k)!r} != recipe {now.get(k)!r}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]


def step_seed(seed: int, step: int, block: int) -> int:
    """Seed of the noise for micro-batch ``block`` of a step, counted over all ranks (rank r's micro-step m is block
    m * world + r, the same samples a single process sees as its micro-step m * world + r)."""
    return int.from_bytes(hashlib.sha256(f"noise:{seed}:{step}:{block}".encode()).digest()[:8], "little")




def attempt(fn, *args) -> tuple:
    """``(fn(*args), None)``, or ``(None, what it raised)``: a failed part of a save is agreed on by every rank before
    any acts on it. (torch.distributed.checkpoint raises CheckpointException, a BaseException.)"""
    try:
        return fn(*args), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        return None, e


def mean_over(depths: list, value) -> float | int:
    """The mean of ``value(d)`` over the micro-steps' depths; the value itself (its type kept) when they agree."""
    values = [value(d) for d in depths]
    return values[0] if len(set(values)) == 1 else sum(values) / len(values)


class BadStepsError(FloatingPointError):
    pass


class RankLost(ConnectionError):
    """Another rank of the job died (or its node did): this one cannot go on alone."""


# A second SIGINT this long after the first aborts at once; sooner, it is the same Ctrl-C delivered twice (the
# terminal signals the whole process group, and torchrun passes the signal it got on to its ranks as well).
SIGINT_REPEAT_S = 1.0


class Trainer:
    def __init__(self, cfg: RunConfig, callbacks: list[Callback] | None = None):
        self.cfg = cfg
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        torch.manual_seed(cfg.seed)  # the global RNG too (the initial weights take cfg.seed explicitly)
        self.backend = build_backend(tc)
        try:  # the nodes of one job: the same recipe and code, checked before anything else is built
            self.backend.check_same_job(cfg.to_dict())
        except BaseException:
            self.backend.close(ok=False)
            raise
        self.device, self.amp_dtype = self.backend.device, self.backend.amp_dtype
        self.peak_flops = device_peak_flops(self.device)
        if self.device.type == "cuda" and self.backend.is_main:
            print(peak_flops_report(self.device), flush=True)  # the figure MFU is computed against, or why none
        if tc.grad_accum_steps % self.backend.world_size:
            raise ValueError(f"train.grad_accum_steps={tc.grad_accum_steps} counts micro-batches over all "
                             f"{self.backend.world_size} ranks and must be a multiple of the world size")
        self.run_dir = cfg.run_dir
        self.ckpt_dir = self.run_dir / "checkpoints"

        dirs, weights = cfg.data.training_datasets()
        self.dataset_dir = Path(dirs[0])
        self.train_data = [TokenShards(d, "train") for d in dirs]
        for d, ds in zip(dirs, self.train_data):
            check_dataset_matches_model(ds.manifest, cfg, f"the dataset at {d}")
        self.val_data = TokenShards(self.dataset_dir, "val")
        self.seq_len = cfg.model.block_size
        self._check_data()
        self.accum = tc.grad_accum_steps // self.backend.world_size
        self.loader = SequenceLoader(self.train_data, self.seq_len, tc.micro_batch_size, cfg.seed,
                                     self.backend.rank, self.backend.world_size, weights,
                                     vocab_size=cfg.model.vocab_size, pin_memory=self.device.type == "cuda")
        self.tokens_per_step = tc.micro_batch_size * tc.grad_accum_steps * self.seq_len

        self.model_cls = model_class(cfg.model.type)
        self.info = model_info(cfg.model)
        set_fused_ops_backend(tc.fused_ops)
        # built, sharded, materialised and initialised; unwrapped: train_depth and friends stay reachable
        self.raw_model = build_for_training(cfg, self.backend)
        self.model, self.optimizer = self.backend.setup(
            self.raw_model, lambda m: build_optimizer(m, tc, self.device.type))
        self.step = 0
        self.bad_steps = 0
        self.skipped_steps = 0
        self.tracker_run_id = None
        self._stop_signal, self._stop_time = None, 0.0  # the first SIGTERM/SIGINT received, and when
        self._stopped_together = False  # every rank stopped at the same step boundary (an agreed signal stop)
        self._pending_save = None  # (future or None, step, start time, PeakRSS or None, error) of the save in flight
        self._filling_disk = None  # the GRT_FAULT_DISK_FULL hook while its save is in flight
        self.tracker = None
        self.run_lock = self._lock_run_folder()
        try:
            self._resume()
            # every rank takes part (hostnames are gathered; a store that cannot be reached stops all); None off
            # rank 0
            self.tracker = open_training_tracker(cfg, self.run_dir, self.tracker_run_id, self.backend)
        except BaseException:
            self._release_run_folder()
            raise
        if self.tracker is not None and self.tracker.run_id:
            self.tracker_run_id = self.tracker.run_id
            (self.run_dir / "run.json").write_text(json.dumps(
                {"mlflow_run_id": self.tracker.run_id, "tracking_uri": self.tracker.uri}, indent=2))
        if callbacks is not None:
            self.callbacks = list(callbacks)
        elif self.backend.is_main:
            self.callbacks = [ConsoleLogger(tc.log_interval)] + ([TrackerCallback(self.tracker)] if self.tracker
                                                                 else [])
        else:
            self.callbacks = []

    # ----------------------------------------------------------------------------------------------- state
    def _check_data(self) -> None:
        """Everything about the data that can fail a run, checked before step 1 (all problems at once): every shard's
        size against its manifest (with data.verify=full also each sha256 and every token id, the ranks sharing the reading), and
        that every dataset and the validation split hold a window of block_size + 1 tokens."""
        cfg, be = self.cfg, self.backend
        share = (be.rank, be.world_size)  # with data.verify=full each rank reads its share of the shards
        problems = [p for ds in [*self.train_data, self.val_data]
                    for p in check_shards(ds, cfg.model.vocab_size, cfg.data.verify, share)]
        problems += check_windows(self.train_data, self.val_data, self.seq_len,
                                  has_validation_sources=bool(cfg.data.validation_sources),
                                  val_fraction=cfg.data.val_fraction)
        if not self.backend.all_true(not problems, patient=True):
            raise ValueError(" | ".join(problems) if problems else
                             f"another rank found problems in the data (data.verify={cfg.data.verify}; see its "
                             f"error)")

    def _lock_run_folder(self) -> FolderLock | None:
        self._created_run_dir = not self.run_dir.exists()
        return lock_run_folder(self.run_dir, self.backend)

    def _release_run_folder(self) -> None:
        release_run_folder(self.run_lock, self.run_dir, self._created_run_dir)
        self.run_lock = None

    def _resume(self) -> None:
        if not list_checkpoints(self.ckpt_dir):
            aside = set_aside_names(self.ckpt_dir)
            if aside:  # a relaunch after "every checkpoint is damaged" must not quietly start over
                raise ValueError(f"{self.ckpt_dir} holds only checkpoints set aside as damaged ("
                                 f"{', '.join(aside)}): nothing to resume from. Start the run over "
                                 f"under another name=, or remove {self.ckpt_dir} to train this one from scratch")
            start_fresh_metrics(self.run_dir, self.backend.is_main)
            return
        if self.cfg.train.resume == "never":
            raise FileExistsError(f"{self.run_dir} already has checkpoints and train.resume=never; choose another "
                                  f"name= or delete {self.ckpt_dir}")
        newest, unindexed = newest_intact_checkpoint(self.ckpt_dir, self.run_dir, self.backend)
        if newest is None and unindexed:
            raise ValueError(f"no checkpoint under {self.ckpt_dir} can be verified: {len(unindexed)} have no "
                             f"{INDEX} ({', '.join(c.name for c in unindexed)}; see the warnings). If they were written "
                             f"by a grt before checkpoints carried an index and you trust them, `grt checkpoint verify "
                             f"{self.run_dir} --adopt` indexes them; then run this command again")
        if newest is None:
            raise ValueError(f"every checkpoint under {self.ckpt_dir} is damaged (each moved aside as damaged_step_*, "
                             f"see the warnings): nothing to resume from. Start the run over under another name=, "
                             f"or remove {self.ckpt_dir} to train this one from scratch")
        t0, rss = time.perf_counter(), PeakRSS()
        state = load_checkpoint(newest, map_location="cpu", verify=False)
        diff = model_config_diff(state["recipe"]["model"], dataclasses.asdict(self.cfg.model))
        if diff:
            raise ValueError(f"cannot resume {newest}: the model changed since it was saved ({'; '.join(diff)}). "
                             f"Restore the recipe or start a new run under another name=")
        self.backend.load_model_optimizer(self.model, self.optimizer, newest, state)
        self.loader.load_state_dict(state["loader"])
        self.step = state["step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.tracker_run_id = state.get("mlflow_run_id")
        saved_recipe = state["recipe"]
        del state  # the checkpoint's tensors (a mapping, or whole copies) go now; what stays is the loaded state
        self._report_resume(newest, time.perf_counter() - t0, rss)
        if self.backend.is_main:
            changes = recipe_changes(saved_recipe, self.cfg.to_dict())
            if changes:
                print(f"note: the recipe changed since the checkpoint at step {self.step} ({newest / 'recipe.yaml'}):"
                      f" {'; '.join(changes)}", file=sys.stderr, flush=True)
            cut_metrics_back(self.run_dir, self.step)

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

    def save(self) -> Path | None:
        """Every rank takes part; rank 0 publishes the folder atomically once every rank has written its part. With
        ``train.async_checkpoint`` the shards are written in the background and published by :meth:`poll_save`
        (returns None then). A part that fails on any rank (a full disk) is agreed on by all
        (:meth:`_agree_on_save`)."""
        self.finish_save()  # at most one save in flight
        t0, rss = time.perf_counter(), PeakRSS() if self.backend.is_main else None
        error = None
        if self.backend.is_main:
            _, error = attempt(prepare_staging, self.ckpt_dir, self.step)
        self._agree_on_save(self.step, error)
        tmp = staging_dir(self.ckpt_dir, self.step)
        state = {"step": self.step, "loader": self.loader.state_dict(), "recipe": self.cfg.to_dict(),
                 "mlflow_run_id": self.tracker_run_id, "info": self.info, "skipped_steps": self.skipped_steps,
                 "world_size": self.backend.world_size}
        if self.step == faults.FAULT_DISK_FULL[0] and faults.FAULT_DISK_FULL[2] in (None, self.backend.rank):
            self._filling_disk = faults.FillingDisk(tmp, faults.FAULT_DISK_FULL[1]).__enter__()  # left by finish_save
        with faults.slowed_first_write(faults.FAULT_SLOW_SAVE_S if self.backend.is_main else 0):
            pending, error = attempt(self.backend.save_model_optimizer, self.model, self.optimizer, tmp, state)
        if self.step == faults.FAULT_KILL_IN_SAVE:
            os.kill(os.getpid(), signal.SIGKILL)
        self._pending_save = (pending, self.step, t0, rss, error)
        if pending is None:
            return self.finish_save()
        return None

    def poll_save(self) -> None:
        """Publish an async save once every rank's background write has finished (one small collective)."""
        if self._pending_save is not None and self.backend.all_true(self._pending_save[0].done()):
            self.finish_save()

    def finish_save(self) -> Path | None:
        """Wait for the save in flight (if any) on every rank, then publish it."""
        if self._pending_save is None:
            return None
        pending, step, t0, rss, error = self._pending_save
        self._pending_save = None
        try:
            if pending is not None:
                _, error = attempt(pending.result)  # this rank's background write failed (a full disk: ENOSPC)
            # every wait on another rank's file I/O is patient: rank 0 alone writes a full checkpoint, and a multi-GB
            # write to network storage outlasts collective_timeout_s (and NCCL's watchdog)
            self._agree_on_save(step, error)
            tmp = staging_dir(self.ckpt_dir, step)
            if self.backend.world_size > 1:  # every rank hashes a share of the files for the index (rank 0 the rest)
                self._agree_on_save(step, attempt(hash_share, tmp, self.backend.rank, self.backend.world_size)[1])
            path = self.ckpt_dir / f"step_{step:08d}"
            if self.backend.is_main:
                path, error = attempt(publish, self.ckpt_dir, step, self.cfg.to_yaml(),
                                      self.cfg.train.keep_checkpoints)
            self._agree_on_save(step, error)
        finally:
            self._end_fault_hooks()
        info = {"checkpoint": step, "format": self.cfg.train.resolved_checkpoint_format(),
                "checkpoint_s": time.perf_counter() - t0}
        if rss is not None:
            info.update(rss.measure())
        for cb in self.callbacks:
            cb.on_checkpoint(self, path, info)
        return path

    def _end_fault_hooks(self) -> None:
        if self._filling_disk is not None:
            self._filling_disk.__exit__()
            self._filling_disk = None

    def _agree_on_save(self, step: int, error: BaseException | None) -> None:
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
                      f"before it in {self.ckpt_dir} are intact")

    def _stop_disk_full(self, step: int, cause: OSError | None) -> DiskFull:
        """Every rank, once all have stopped writing the save of ``step``: rank 0 removes that save's staging folder
        (it may hold most of what the disk had left) and writes stopped.json; the newest published checkpoint stays."""
        if self.backend.is_main:
            shutil.rmtree(staging_dir(self.ckpt_dir, step), ignore_errors=True)
        message = f"error: {disk_full_message(self.ckpt_dir, step, cause, self.run_dir.parent)}"
        _, newest = self._mark_stopped_at_newest("a full disk", self.backend.is_main)
        if self.backend.is_main:
            # said now, not by the CLI at exit: once the other ranks have exited, torchrun SIGTERMs this one
            print(message, file=sys.stderr, flush=True)
        self._stopped_together = True  # every rank stops here, at the same agreement
        return DiskFull(step, newest, message, report=False)

    # ------------------------------------------------------------------------------------------------ loop
    def autocast(self):
        if self.amp_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    @torch.no_grad()
    def validate(self) -> dict:
        """Mean validation loss at the evaluation depth (R for GRT), noise off. Every rank runs the same batches
        (sharded models need all ranks in every forward)."""
        self.model.eval()
        total, count = 0.0, 0
        # the depth said explicitly: RecurTrace without n_steps would halt per token at its threshold instead
        depth = getattr(self.cfg.model, "n_recurrence", None)
        at_depth = {"n_steps": depth} if depth is not None else {}
        for x, y in validation_batches(self.val_data, self.seq_len, self.cfg.train.micro_batch_size,
                                       max_batches=self.cfg.train.eval_batches, vocab_size=self.cfg.model.vocab_size):
            with self.autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device), **at_depth)
            total += loss.item() * y.numel()
            count += y.numel()
        self.model.train()
        return {"step": self.step, "val_loss": self.backend.reduce_mean(total / count), "val_tokens": count,
                "val_depth": depth}

    def step_depths(self) -> list[int | None]:
        """The recurrence depth of each of this rank's micro-steps in the coming step (None: a model without a
        sampled depth runs its own). ``train.depth_granularity=step``: one draw from (seed, step) for all of them.
        ``micro_step``: one draw per micro-step m from (seed, step, m), m the index in this rank's accumulation loop
        and not the global micro-batch index, so every rank at micro-step m runs the same depth (FSDP and ZeRO-3
        need all ranks to call the same modules). The price: rank r's micro-step m holds global micro-batch
        m * world + r, so the depth a given sample meets depends on the world size (per step it does not)."""
        seed, step = self.cfg.seed, self.step
        if self.cfg.train.depth_granularity == "micro_step":
            return [self.raw_model.train_depth(seed, step, micro) for micro in range(self.accum)]
        return [self.raw_model.train_depth(seed, step)] * self.accum

    def train_step(self) -> dict:
        tc, be = self.cfg.train, self.backend
        t0 = time.perf_counter()
        lr = lr_at(self.step, tc)
        be.set_lr(self.optimizer, lr)
        # the micro-steps' losses summed on the device (fp64: the sum a Python float would give), read once per step:
        # no host sync per micro-step, so the host queues the next micro-batch while the device computes. The sum is
        # finite exactly when every loss is; a non-finite one still runs its backward (every rank does the same
        # work), and the step is then dropped or, where the backend cannot drop it, the run stops before the update.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        depths = self.step_depths()
        for micro, depth in enumerate(depths):
            x, y = self.loader.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            torch.manual_seed(step_seed(self.cfg.seed, self.step, micro * be.world_size + be.rank))
            last = micro == self.accum - 1
            with be.no_sync(self.model, last):
                with self.autocast():
                    _, loss = self.model(x, y, n_steps=depth)
                if self.step + 1 in faults.FAULT_NAN_STEPS:
                    loss = loss * float("nan")
                be.backward(self.model, loss, self.accum, last)
            loss_sum += loss.detach()
        # one read of the sum, one all-reduce: a non-finite loss on any rank makes the mean non-finite on every rank,
        # so all take the same decision
        mean_loss = be.reduce_mean(loss_sum.item() / self.accum)
        finite = math.isfinite(mean_loss)
        if not finite and not be.can_skip:
            last_ckpt = list_checkpoints(self.ckpt_dir)
            raise BadStepsError(f"non-finite loss at step {self.step + 1}: the {be.name} backend cannot skip a step "
                                f"once its engine has counted the accumulation window, so the run stops here, "
                                f"before the update. Last good checkpoint: {last_ckpt[-1] if last_ckpt else 'none'}")
        if finite:
            grad_norm = be.step(self.model, self.optimizer)  # non-finite norms: the step is not taken
            finite = math.isfinite(grad_norm) or not be.can_skip
        else:
            grad_norm = float("nan")
            be.skip_step(self.model, self.optimizer)
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        # FLOPs per token averaged over the micro-steps (each holds the same number of tokens)
        flops = mean_over(depths, lambda d: self.model_cls.flops_per_token(self.cfg.model, d, with_head=True))
        # model FLOPs utilisation: forward + backward = 3x the forward FLOPs (or the method's own count: Poisson's
        # no-grad steps, MoR's capacities, Ouro's heads at every loop), over the peak of all devices
        train_flops = getattr(self.model_cls, "training_flops_per_token", None)
        step_flops = mean_over(depths, lambda d: train_flops(self.cfg.model, d)) if train_flops else 3 * flops
        mfu = step_flops * self.tokens_per_step / dt / (self.peak_flops * be.world_size) if self.peak_flops else None
        # per micro-step: "depth" is the mean over this rank's micro-steps (the console's r, MLflow's depth) and
        # "depths" (metrics.jsonl) lists them in order; every rank ran the same list
        per_micro = tc.depth_granularity == "micro_step" and depths[0] is not None
        metrics = {"step": self.step, "loss": mean_loss, "grad_norm": grad_norm,
                   "lr": lr, "depth": sum(depths) / len(depths) if per_micro else depths[0],
                   "tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt, "mfu": mfu,
                   "flops_per_token": flops, "tokens_seen": self.step * self.tokens_per_step,
                   "epoch": self.loader.epoch, "finite": finite,
                   "mem_gb": torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None}
        if per_micro:
            metrics["depths"] = depths
        return metrics

    def _on_signal(self, signum, frame) -> None:
        """SIGTERM / the first SIGINT: stop at the next step boundary after saving. A second SIGINT (not the same
        Ctrl-C delivered twice) aborts at once."""
        now = time.monotonic()
        if self._stop_signal is None:
            self._stop_signal, self._stop_time = signum, now
            if self.backend.is_main:
                again = " (Ctrl-C again to abort without saving)" if signum == signal.SIGINT else ""
                os.write(2, f"\n{signal.Signals(signum).name}: saving at the end of the step in progress, then "
                            f"stopping{again}\n".encode())
        elif signum == signal.SIGINT and now - self._stop_time > SIGINT_REPEAT_S:
            raise KeyboardInterrupt

    def _stop_signal_agreed(self) -> int | None:
        """The signal every rank stops on at this step boundary (None: go on). All ranks take the same decision;
        SIGINT wins when any rank got it (a Ctrl-C), else SIGTERM."""
        if self.backend.all_true(self._stop_signal is None):
            return None
        return signal.SIGTERM if self.backend.all_true(self._stop_signal != signal.SIGINT) else signal.SIGINT

    def _validate_or_save(self) -> dict:
        """Validation that fails (bad data) never costs the finished steps: they are saved before the error rises."""
        try:
            return self.validate()
        except (ValueError, IndexError):
            if not (self.ckpt_dir / f"step_{self.step:08d}").is_dir():
                self.save()
                self.finish_save()
            raise

    def fit(self) -> dict:
        tc = self.cfg.train
        status, last_eval = "FAILED", None
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        # on NCCL a collective with a dead or frozen peer does not fail in Python: the heartbeat thread reports it
        self.backend.watch_peers(tc.heartbeat_timeout_s, self._rank_lost_from_heartbeat)
        try:
            if self.step >= tc.max_steps:
                if self.backend.is_main:
                    clear_stopped(self.run_dir)  # finished by this max_steps, whatever stopped it before
                    past = "past" if self.step > tc.max_steps else "at"
                    print(f"train: {self.cfg.name} is already {past} train.max_steps={tc.max_steps} (its newest "
                          f"checkpoint is step {self.step}): nothing to train. Raise train.max_steps to train "
                          f"longer; `grt eval {self.run_dir}` evaluates it", flush=True)
            elif self.backend.is_main:
                # the recipe of the launch that trains (each checkpoint keeps the one it was trained with)
                (self.run_dir / "recipe.yaml").write_text(self.cfg.to_yaml())
                clear_stopped(self.run_dir)
            for cb in self.callbacks:  # inside the try: a callback that fails still closes the tracker and the group
                cb.on_train_start(self)
            self.model.train()
            while self.step < tc.max_steps:
                metrics = self.train_step()
                if metrics["finite"]:
                    self.bad_steps = 0
                else:
                    self.bad_steps += 1
                    self.skipped_steps += 1
                metrics["skipped_steps"] = self.skipped_steps
                for cb in self.callbacks:
                    cb.on_step_end(self, metrics)
                if self.bad_steps >= tc.max_bad_steps:
                    last = list_checkpoints(self.ckpt_dir)
                    raise BadStepsError(
                        f"{self.bad_steps} non-finite steps in a row (the last at step {self.step}), each "
                        f"skipped; stopping. Last good checkpoint: {last[-1] if last else 'none'}. Lower "
                        f"train.lr or check the data, then resume.")
                if self.step == faults.FAULT_KILL_AT_STEP and faults.FAULT_KILL_RANK in (None, self.backend.rank):
                    os.kill(os.getpid(), faults.FAULT_KILL_SIGNAL)  # fault injection for the tests: `kill -9`
                faults.raise_at_step(self.step, self.backend.rank)
                if self.step == faults.FAULT_SIGNAL_AT_STEP[0] and self.backend.rank == 0:
                    os.kill(os.getpid(), faults.FAULT_SIGNAL_AT_STEP[1])  # the tests' Ctrl-C / SIGTERM at a known step
                stop = self._stop_signal_agreed()
                # stopping: the save comes first (launchers give the ranks ~30 s after a signal)
                if (self.step % tc.eval_interval == 0 and not stop) or self.step == tc.max_steps:
                    last_eval = self._validate_or_save()
                    for cb in self.callbacks:
                        cb.on_eval(self, last_eval)
                self.poll_save()
                if self.step % tc.checkpoint_interval == 0 or self.step == tc.max_steps or stop:
                    self.save()
                if stop:
                    self.finish_save()
                if stop and self.step < tc.max_steps:  # (a signal during the last step: the run is finished)
                    status, self._stopped_together = "KILLED", True
                    name = signal.Signals(stop).name
                    where = self.ckpt_dir / f"step_{self.step:08d}"
                    if self.backend.is_main:
                        mark_stopped(self.run_dir, name, self.step, tc.max_steps, where)
                    raise TrainingStopped(stop, self.step, where, f"{name}: saved step {self.step} (of "
                                          f"{tc.max_steps}) to {where}; the run is not finished (exit status "
                                          f"{128 + stop}, and {self.run_dir / STOPPED} says so): the same command "
                                          f"resumes it",
                                          report=self.backend.is_main)
            self.finish_save()
            if last_eval is None:  # resumed at max_steps: report the final loss anyway
                last_eval = self.validate()
            status = "FINISHED"
            return last_eval
        except KeyboardInterrupt:
            status = "KILLED"
            if self.backend.is_main:
                last = list_checkpoints(self.ckpt_dir)
                print(f"\naborted by a second Ctrl-C at step {self.step}, without saving; the newest checkpoint is "
                      f"{last[-1] if last else 'none'}", file=sys.stderr, flush=True)
            raise
        except OSError as e:
            if disk_full_cause(e) is None or isinstance(e, RankLost):
                raise
            raise self._stop_disk_full_outside_a_save(disk_full_cause(e)) from e
        except RuntimeError as e:  # a failed collective (gloo, NCCL, the store): is a rank gone?
            lost = self.backend.lost_ranks()
            if lost is None:
                self.backend.report_failure(failure_line(e))  # this rank's own error: the others name it
                raise
            raise self._rank_lost(lost) from e
        except Exception as e:
            if not isinstance(e, (TrainingStopped, RankLost)):
                self.backend.report_failure(failure_line(e))
            raise
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C now would cut the clean-up and hide the report
            try:
                self._clean_up(status)
            finally:
                for s, h in handlers.items():
                    signal.signal(s, h)

    def _stop_disk_full_outside_a_save(self, cause: OSError) -> DiskFull:
        """A full disk met while training (a log, the metrics, a tracker's file) rather than inside a save: this rank
        stops in one line, and stopped.json (a few hundred bytes) is written if it still fits."""
        _, newest = self._mark_stopped_at_newest("a full disk", self.backend.is_main)
        message = f"error: {disk_full_while_training(cause, self.step, self.run_dir, newest)}"
        self.backend.report_failure(message.removeprefix("error: "))  # the other ranks name it, not a lost node
        print(message, file=sys.stderr, flush=True)
        return DiskFull(self.step, newest, message, report=False)

    def _mark_stopped_at_newest(self, why: str, write: bool) -> tuple[int, Path | None]:
        """(step, folder) of the newest published checkpoint, the one a relaunch resumes from (a save in flight was
        never published); with ``write``, stopped.json says the run stopped there because of ``why`` (a few hundred
        bytes: skipped if even those do not fit on a full disk)."""
        published = list_checkpoints(self.ckpt_dir)
        newest = published[-1] if published else None
        step = int(newest.name.split("_")[1]) if newest else 0
        if write:
            with contextlib.suppress(OSError):
                mark_stopped(self.run_dir, why, step, self.cfg.train.max_steps, newest or Path("none"))
        return step, newest

    def _rank_lost_from_heartbeat(self, lost: tuple[str, list[int], bool]) -> None:
        """The heartbeat thread saw another rank fail or fall silent while this one is stuck in a collective (NCCL's,
        or gloo's with a frozen peer): the same one line and stopped.json, then the process ends from that thread."""
        print(f"error: {self._rank_lost(lost)}", file=sys.stderr, flush=True)
        os._exit(1)

    def _rank_lost(self, lost: tuple[str, list[int], bool]) -> RankLost:
        """The one line (and stopped.json) of a rank that outlived another: who stopped answering, and what the
        relaunch resumes from (the newest published checkpoint; a save in flight was never published)."""
        lost, gone, failed = lost
        first_survivor = self.backend.rank == min(set(range(self.backend.world_size)) - set(gone))
        step, newest = self._mark_stopped_at_newest(f"the loss of a rank ({lost})", first_survivor)
        resume = (f"last intact checkpoint: step {step} at {newest}" if newest else
                  "no checkpoint was written yet: a relaunch starts from step 0")
        remedy = ("Fix the cause before relaunching" if failed else
                  "Bring the lost node back (or replace it)")
        return RankLost(f"{lost} during step {self.step + 1}, so rank {self.backend.rank} stops too; {resume}. "
                        f"{remedy}, and run the same launch on every node: it resumes from there "
                        f"({self.run_dir / STOPPED} says so)")

    def _clean_up(self, status: str) -> None:
        if self._pending_save is not None and self._pending_save[0] is not None:
            # an async save still writing when training failed: let its thread finish before the process groups
            # it uses are destroyed (it stays unpublished: the other ranks may not have reached it)
            attempt(self._pending_save[0].result)  # its error: the one that brought us here is the one to report
        self._end_fault_hooks()
        for cb in self.callbacks:
            cb.on_train_end(self, status)
        if self.tracker is not None:
            self.tracker.close(status)
        # every rank ends together after a finish or an agreed stop; after a failure or an abort, at once
        self.backend.close(ok=status == "FINISHED" or self._stopped_together)
        self._release_run_folder()


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


def train(cfg: RunConfig) -> dict:
    return Trainer(cfg).fit()
