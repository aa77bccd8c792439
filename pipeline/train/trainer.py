"""A small generic trainer: build everything from the recipe, resume, then a loop of (step, callbacks, maybe
validate, maybe save) and the finish. Checkpoints are :class:`~pipeline.train.checkpointer.Checkpointer`'s, beside
the trainer; everything optional is a callback (:mod:`pipeline.train.callbacks`), the test fault hooks too.

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
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch

from ops import set_backend as set_fused_ops_backend
from pipeline.config import RunConfig
from pipeline.model import model_class
from pipeline.model import model_info
from pipeline.model.z_loss import ZLossMeter
from pipeline.runtime.exit_status import DiskFull
from pipeline.runtime.exit_status import TrainingStopped
from pipeline.runtime.locking import FolderLock
from pipeline.runtime.seeds import derive_seed
from pipeline.tokenize.dataset_cache import local_dataset
from pipeline.tokenize.tokenizers import carry_tokenizer
from pipeline.tracking import open_training_tracker
from pipeline.train import curriculum
from pipeline.train import faults
from pipeline.train.backend import build_backend
from pipeline.train.callbacks import Callback
from pipeline.train.callbacks import ConsoleLogger
from pipeline.train.callbacks import TrackerCallback
from pipeline.train.checkpoint import disk_full_cause
from pipeline.train.checkpoint import disk_full_while_training
from pipeline.train.checkpointer import Checkpointer
from pipeline.train.data import SequenceLoader
from pipeline.train.data import TokenShards
from pipeline.train.data import check_shards
from pipeline.train.data import check_windows
from pipeline.train.data import validation_batches
from pipeline.train.data_match import check_dataset_matches_model
from pipeline.train.in_loop_eval import InLoopEval
from pipeline.train.in_loop_tasks import InLoopTasks
from pipeline.train.materialize import build_for_training
from pipeline.train.mfu import device_peak_flops
from pipeline.train.mfu import peak_flops_report
from pipeline.train.optim import build_optimizer
from pipeline.train.optim import lr_at
from pipeline.train.peers import failure_line
from pipeline.train.relaunch import relaunch_tags
from pipeline.train.run_folder import STOPPED
from pipeline.train.run_folder import clear_stopped
from pipeline.train.run_folder import lock_run_folder
from pipeline.train.run_folder import mark_stopped
from pipeline.train.run_folder import release_run_folder
from pipeline.train.spike import SpikeGuard


def step_seed(seed: int, step: int, block: int) -> int:
    """Seed of the noise for micro-batch ``block`` of a step, counted over all ranks (rank r's micro-step m is block
    m * world + r, the same samples a single process sees as its micro-step m * world + r)."""
    return derive_seed("noise", seed, step, block)


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
        dirs, weights = cfg.data.training_datasets()
        # an s3:// dataset: its checked copy in the node cache, fetched before the process group exists (a cold
        # cache may take longer than any collective timeout while the other nodes wait)
        dirs = [local_dataset(d) for d in dirs]
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
        for problem in curriculum.world_size_problems(tc, self.backend.world_size):
            raise ValueError(problem)
        self.run_dir = cfg.run_dir

        self.dataset_dirs = dirs
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
                                     vocab_size=cfg.model.vocab_size, pin_memory=self.device.type == "cuda",
                                     document_masking=cfg.data.document_masking)
        self.tokens_per_step = tc.micro_batch_size * tc.grad_accum_steps * self.seq_len

        self.model_cls = model_class(cfg.model.type)
        self.info = model_info(cfg.model)
        set_fused_ops_backend(tc.fused_ops)
        # built, sharded, materialised and initialised; unwrapped: train_depth and friends stay reachable
        self.raw_model = build_for_training(cfg, self.backend)
        self.in_loop_eval = InLoopEval(self) if tc.eval_exits else None
        self.in_loop_tasks = InLoopTasks(self) if tc.eval_tasks else None  # checks the task files now
        self.z_loss = ZLossMeter(self.raw_model, tc.z_loss)  # train.z_loss: its coefficient set on the LM head
        self.model, self.optimizer = self.backend.setup(
            self.raw_model, lambda m: build_optimizer(m, tc, self.device.type))
        self.step = 0
        self.bad_steps = 0
        self.skipped_steps = 0
        self.spike = SpikeGuard(tc.spike)  # train.spike: the window of recent losses (restored by the resume)
        self.tokens_seen = 0  # summed per step: train.batch_ramp changes a step's tokens
        self.tracker_run_id = None
        self._stop_signal, self._stop_time = None, 0.0  # the first SIGTERM/SIGINT received, and when
        self._stopped_together = False  # every rank stopped at the same step boundary (an agreed signal stop)
        self.checkpointer = Checkpointer(cfg, self.backend)
        self.tracker = None
        self.run_lock = self._lock_run_folder()
        try:
            self.checkpointer.resume(self)
            if self.in_loop_eval is not None:  # eval_curve.png keeps the evals before the resume
                self.in_loop_eval.resumed(self)
            # every rank takes part (hostnames are gathered; a store that cannot be reached stops all); None off
            # rank 0
            self.tracker = open_training_tracker(cfg, self.run_dir, self.tracker_run_id, self.backend)
        except BaseException:
            self._release_run_folder()
            raise
        if self.tracker is not None and self.checkpointer.relaunch_line:  # the same MLflow run says it restarted
            self.tracker.set_tags(relaunch_tags(self.checkpointer.relaunch, self.checkpointer.relaunch_line))
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
        if faults.requested():  # the tests' GRT_FAULT_* hooks, last: a step is logged before its fault strikes
            self.callbacks.append(faults.FaultInjection())

    # ----------------------------------------------------------------------------------------------- state
    def _check_data(self) -> None:
        """Everything about the data that can fail a run, checked before step 1 (all problems at once): every shard's
        size against its manifest (with data.verify=full also each sha256 and every token id, the ranks sharing the
        reading), and that every dataset and the validation split hold a window of block_size + 1 tokens."""
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
        return lock_run_folder(self.run_dir, self.backend, self.cfg.run_url)

    def _release_run_folder(self) -> None:
        release_run_folder(self.run_lock, self.run_dir, self._created_run_dir)
        self.run_lock = None

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> dict:
        tc = self.cfg.train
        status, last_eval = "FAILED", None
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        # on NCCL a collective with a dead or frozen peer does not fail in Python: the heartbeat thread reports it
        self.backend.watch_peers(tc.heartbeat_timeout_s, self._rank_lost_from_heartbeat)
        try:
            self._start()
            while self.step < tc.max_steps:
                metrics = self.train_step()
                self._count_bad_step(metrics)
                for cb in self.callbacks:
                    cb.on_step_end(self, metrics)
                self._check_bad_steps()
                for cb in self.callbacks:
                    cb.on_step_checked(self, metrics)
                stop = self._stop_signal_agreed()
                # stopping: the save comes first (launchers give the ranks ~30 s after a signal)
                if (self.step % tc.eval_interval == 0 and not stop) or self.step == tc.max_steps:
                    last_eval = self._validate_or_save()
                    for cb in self.callbacks:
                        cb.on_eval(self, last_eval)
                self.checkpointer.poll(self)
                if (self.step % tc.checkpoint_interval == 0 or self.step == tc.max_steps or stop
                        or self.step in tc.keep_steps):  # (train.keep_steps: branch points, saved off the interval)
                    self.checkpointer.save(self)
                if stop:
                    self.checkpointer.finish(self)
                if stop and self.step < tc.max_steps:  # (a signal during the last step: the run is finished)
                    status = "KILLED"
                    raise self._stopped_on(stop)
            self.checkpointer.finish(self)
            if last_eval is None:  # resumed at max_steps: report the final loss anyway
                last_eval = self.validate()
            status = "FINISHED"
            return last_eval
        except KeyboardInterrupt:
            status = "KILLED"
            if self.backend.is_main:
                print(f"\naborted by a second Ctrl-C at step {self.step}, without saving; the newest checkpoint is "
                      f"{self.checkpointer.newest() or 'none'}", file=sys.stderr, flush=True)
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

    def _start(self) -> None:
        """Said before the first step: nothing to train (already at max_steps), or the recipe of this launch written
        (each checkpoint keeps the one it was trained with); then the callbacks' start."""
        tc = self.cfg.train
        if self.step >= tc.max_steps:
            if self.backend.is_main:
                clear_stopped(self.run_dir)  # finished by this max_steps, whatever stopped it before
                past = "past" if self.step > tc.max_steps else "at"
                print(f"train: {self.cfg.name} is already {past} train.max_steps={tc.max_steps} (its newest "
                      f"checkpoint is step {self.step}): nothing to train. Raise train.max_steps to train "
                      f"longer; `grt eval {self.cfg.run_url or self.run_dir}` evaluates it", flush=True)
        elif self.backend.is_main:
            (self.run_dir / "recipe.yaml").write_text(self.cfg.to_yaml())
            carry_tokenizer(self.cfg.data.tokenizer, self.dataset_dir, self.run_dir)  # eval/generate/export read it
            clear_stopped(self.run_dir)
        self.checkpointer.push_run_files()  # out_dir on object storage: the store has the run files from the start
        for cb in self.callbacks:  # inside fit's try: a callback that fails still closes the tracker and the group
            cb.on_train_start(self)
        self.model.train()

    def _count_bad_step(self, metrics: dict) -> None:
        if metrics["finite"]:
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            self.skipped_steps += 1
        metrics["skipped_steps"] = self.skipped_steps

    def _check_bad_steps(self) -> None:
        if self.bad_steps >= self.cfg.train.max_bad_steps:
            raise BadStepsError(
                f"{self.bad_steps} non-finite steps in a row (the last at step {self.step}), each "
                f"skipped; stopping. Last good checkpoint: {self.checkpointer.newest() or 'none'}. Lower "
                f"train.lr or check the data, then resume.")

    def _stopped_on(self, signum: int) -> TrainingStopped:
        """An agreed signal stop after the save of this step: stopped.json on rank 0, and the error that says so."""
        tc = self.cfg.train
        self._stopped_together = True
        name = signal.Signals(signum).name
        where = self.checkpointer.folder(self.step)
        if self.backend.is_main:
            mark_stopped(self.run_dir, name, self.step, tc.max_steps, where)
        return TrainingStopped(signum, self.step, where, f"{name}: saved step {self.step} (of {tc.max_steps}) to "
                               f"{where}; the run is not finished (exit status {128 + signum}, and "
                               f"{self.run_dir / STOPPED} says so): the same command resumes it",
                               report=self.backend.is_main)

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
        depth = self.model_cls.recurrence_depth(self.cfg.model)
        at_depth = {"n_steps": depth} if depth is not None else {}
        for batch in validation_batches(self.val_data, self.seq_len, self.cfg.train.micro_batch_size,
                                        max_batches=self.cfg.train.eval_batches, vocab_size=self.cfg.model.vocab_size,
                                        document_masking=self.cfg.data.document_masking):
            b = batch.to(self.device)
            with self.autocast():
                _, loss = self.model(b.inputs, b.targets, **at_depth, **b.model_kwargs())
            total += loss.item() * b.targets.numel()
            count += b.targets.numel()
        self.model.train()
        result = {"step": self.step, "val_loss": self.backend.reduce_mean(total / count), "val_tokens": count,
                  "val_depth": depth}
        if self.in_loop_eval is not None:  # train.eval_exits: the loss at every exit and bpb (in_loop_eval.py)
            result.update(self.in_loop_eval.run(self))
        if self.in_loop_tasks is not None:  # train.eval_tasks: downstream scores (in_loop_tasks.py)
            result.update(self.in_loop_tasks.run(self))
        return result

    def _validate_or_save(self) -> dict:
        """Validation that fails (bad data) never costs the finished steps: they are saved before the error rises."""
        try:
            return self.validate()
        except (ValueError, IndexError):
            if not self.checkpointer.has(self.step):
                self.checkpointer.save(self)
                self.checkpointer.finish(self)
            raise

    def step_depths(self) -> list[int | None]:
        """The recurrence depth of each of this rank's micro-steps in the coming step (None: a model without a
        sampled depth runs its own). ``train.depth_granularity=step``: one draw from (seed, step) for all of them.
        ``micro_step``: one draw per micro-step m from (seed, step, m), m the index in this rank's accumulation loop
        and not the global micro-batch index, so every rank at micro-step m runs the same depth (FSDP and ZeRO-3
        need all ranks to call the same modules). The price: rank r's micro-step m holds global micro-batch
        m * world + r, so the depth a given sample meets depends on the world size (per step it does not)."""
        seed, step = self.cfg.seed, self.step
        bound = curriculum.depth_kwargs(self.cfg.model, step + 1)  # model.depth_schedule (none: {})
        if self.cfg.train.depth_granularity == "micro_step":
            return [self.raw_model.train_depth(seed, step, micro, **bound) for micro in range(self.accum)]
        return [self.raw_model.train_depth(seed, step, **bound)] * self.accum

    def train_step(self) -> dict:
        tc, be = self.cfg.train, self.backend
        t0 = time.perf_counter()
        lr = lr_at(self.step, tc)
        be.set_lr(self.optimizer, lr)
        ga = curriculum.accum_at(tc, self.step + 1)  # train.batch_ramp: this step's micro-batches over all ranks
        self.accum, self.tokens_per_step = ga // be.world_size, tc.micro_batch_size * ga * self.seq_len
        self.tokens_seen += self.tokens_per_step
        # the micro-steps' losses summed on the device (fp64: the sum a Python float would give), read once per step:
        # no host sync per micro-step, so the host queues the next micro-batch while the device computes. The sum is
        # finite exactly when every loss is; a non-finite one still runs its backward (every rank does the same
        # work), and the step is then dropped or, where the backend cannot drop it, the run stops before the update.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        depths = self.step_depths()
        for micro, depth in enumerate(depths):
            if self.spike.pending:  # after a spike rollback: the spiky steps' micro-batches are not trained again
                self.spike.skip_spiky_data(self)
            b = self.loader.next_batch().to(self.device, non_blocking=True)
            torch.manual_seed(step_seed(self.cfg.seed, self.step, micro * be.world_size + be.rank))
            last = micro == self.accum - 1
            with be.no_sync(self.model, last):
                with self.autocast():
                    _, loss = self.model(b.inputs, b.targets, n_steps=depth, **b.model_kwargs())
                for cb in self.callbacks:
                    loss = cb.on_loss(self, loss)
                be.backward(self.model, loss, self.accum, last)
            loss_sum += self.z_loss.objective(loss)  # the loss without train.z_loss's term (logged apart)
        # one read of the sum, one all-reduce: a non-finite loss on any rank makes the mean non-finite on every rank,
        # so all take the same decision
        mean_loss = be.reduce_mean(loss_sum.item() / self.accum)
        finite = math.isfinite(mean_loss)
        if not finite and not be.can_skip:
            raise BadStepsError(f"non-finite loss at step {self.step + 1}: the {be.name} backend cannot skip a step "
                                f"once its engine has counted the accumulation window, so the run stops here, "
                                f"before the update. Last good checkpoint: {self.checkpointer.newest() or 'none'}")
        spike = self.spike.decide(self, mean_loss) if finite and self.spike.on else None  # the same on every rank
        if finite and spike is None:
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
        step_flops = mean_over(depths, lambda d: self.model_cls.training_flops_per_token(self.cfg.model, d))
        mfu = step_flops * self.tokens_per_step / dt / (self.peak_flops * be.world_size) if self.peak_flops else None
        # per micro-step: "depth" is the mean over this rank's micro-steps (the console's r, MLflow's depth) and
        # "depths" (metrics.jsonl) lists them in order; every rank ran the same list
        per_micro = tc.depth_granularity == "micro_step" and depths[0] is not None
        metrics = {"step": self.step, "loss": mean_loss, "grad_norm": grad_norm,
                   "lr": lr, "depth": sum(depths) / len(depths) if per_micro else depths[0],
                   "tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt, "mfu": mfu,
                   "flops_per_token": flops, "tokens_seen": self.tokens_seen,
                   "epoch": self.loader.epoch, "finite": finite,
                   "mem_gb": torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None}
        metrics.update(curriculum.step_metrics(self.cfg, self.step))  # grad_accum_steps / depth_bound, when scheduled
        metrics.update(self.z_loss.step_metrics(be, self.accum))  # {"z_loss": ...} when train.z_loss is on
        if per_micro:
            metrics["depths"] = depths
        if spike is not None:  # its update was not taken: said and logged; stop raises, rollback reloads
            return self.spike.acted(self, spike, mean_loss, metrics)
        return metrics

    # --------------------------------------------------------------------------------- signals and failures
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

    def _stop_disk_full_outside_a_save(self, cause: OSError) -> DiskFull:
        """A full disk met while training (a log, the metrics, a tracker's file) rather than inside a save: this rank
        stops in one line, and stopped.json (a few hundred bytes) is written if it still fits."""
        _, newest = self.checkpointer.mark_stopped_at_newest("a full disk", self.backend.is_main)
        message = f"error: {disk_full_while_training(cause, self.step, self.run_dir, newest)}"
        self.backend.report_failure(message.removeprefix("error: "))  # the other ranks name it, not a lost node
        print(message, file=sys.stderr, flush=True)
        return DiskFull(self.step, newest, message, report=False)

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
        step, newest = self.checkpointer.mark_stopped_at_newest(f"the loss of a rank ({lost})", first_survivor)
        resume = (f"last intact checkpoint: step {step} at {newest}" if newest else
                  "no checkpoint was written yet: a relaunch starts from step 0")
        remedy = ("Fix the cause before relaunching" if failed else
                  "Bring the lost node back (or replace it)")
        return RankLost(f"{lost} during step {self.step + 1}, so rank {self.backend.rank} stops too; {resume}. "
                        f"{remedy}, and run the same launch on every node: it resumes from there "
                        f"({self.run_dir / STOPPED} says so)")

    def _clean_up(self, status: str) -> None:
        self.checkpointer.wait()  # a background save ends before the process groups it uses are destroyed
        for cb in self.callbacks:  # a save that failed in flight left its hooks open: end them (idempotent) first
            cb.on_save_end(self)
        for cb in self.callbacks:
            cb.on_train_end(self, status)
        if self.tracker is not None:
            self.tracker.close(status)
        self.checkpointer.push_run_files()  # (object storage) the final metrics, stopped.json
        # every rank ends together after a finish or an agreed stop; after a failure or an abort, at once
        self.backend.close(ok=status == "FINISHED" or self._stopped_together or self.checkpointer.stopped_together)
        self._release_run_folder()


def train(cfg: RunConfig) -> dict:
    return Trainer(cfg).fit()
