"""Optional concerns of training, as callbacks: the console step line and the tracker (MLflow); the test fault
hooks (:class:`pipeline.train.faults.FaultInjection`). The save hooks are called by :mod:`pipeline.train.checkpointer`
around each save: started (its staging folder made), written (this rank's files, or their background write, under
way) and ended (published, or failed)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.runtime import storage
from pipeline.train.curriculum import accum_at


class Callback:
    """The loop's hooks, in the order they run; each does nothing here."""

    def on_train_start(self, trainer) -> None: ...

    def on_loss(self, trainer, loss):
        """Each micro-step's loss before its backward: returned as it is, or replaced (the fault hooks' NaN)."""
        return loss

    def on_step_end(self, trainer, metrics: dict) -> None: ...
    def on_step_checked(self, trainer, metrics: dict) -> None:
        """After every callback's on_step_end and the non-finite-steps check, before the stop-signal agreement."""
    def on_eval(self, trainer, metrics: dict) -> None: ...
    def on_save_start(self, trainer, step: int, staging: Path) -> None: ...
    def on_save_written(self, trainer, step: int) -> None: ...
    def on_save_end(self, trainer) -> None: ...
    def on_checkpoint(self, trainer, path, info: dict) -> None: ...
    def on_train_end(self, trainer, status: str) -> None: ...


def where_run_is(cfg) -> str:
    """The run folder as said to users: on object storage, the store's URL and this node's working copy."""
    return f"{cfg.run_url} (this node's copy: {cfg.run_dir})" if cfg.run_url else str(cfg.run_dir)


def format_step_line(m: dict, max_steps: int) -> str:
    """One fixed-format line: step | loss | grad_norm | lr | r | tok/s | flops/tok | mfu | mem."""
    parts = [f"step {m['step']:>{len(str(max_steps))}}/{max_steps}", f"loss {m['loss']:.4f}",
             f"grad_norm {m['grad_norm']:.3f}", f"lr {m['lr']:.2e}"]
    if m.get("z_loss") is not None:  # train.z_loss on: its term, apart from the loss
        parts.insert(2, f"z_loss {m['z_loss']:.2e}")
    if m.get("depth") is not None:
        parts.append(f"r {m['depth']:.2f}")
    parts.append(f"tok/s {m['tokens_per_s']:,.0f}")
    parts.append(f"flops/tok {m['flops_per_token'] / 1e6:,.1f}M")
    parts.append(f"mfu {100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "mfu n/a")
    if m.get("skipped_steps"):
        parts.append(f"skipped {m['skipped_steps']}")
    if m.get("mem_gb") is not None:
        parts.append(f"mem {m['mem_gb']:.2f}GB")
    return " | ".join(parts)


def next_step_tokens(trainer) -> str:
    """The tokens of the step about to train, and under train.batch_ramp those it ramps to."""
    tc = trainer.cfg.train
    now = tc.micro_batch_size * accum_at(tc, trainer.step + 1) * trainer.seq_len
    final = tc.micro_batch_size * tc.grad_accum_steps * trainer.seq_len
    return f"{now:,}" if now == final else f"{now:,} (ramped to {final:,} by train.batch_ramp)"


class ConsoleLogger(Callback):
    """Prints the step line every ``log_interval`` steps and appends every step's metrics to metrics.jsonl."""

    def __init__(self, log_interval: int, stream=None):
        self.log_interval, self._stream = log_interval, stream
        self._file = None

    @property
    def stream(self):
        return self._stream or sys.stdout  # looked up when printing: sys.stdout may be replaced after import

    def on_train_start(self, trainer) -> None:
        self._file = open(trainer.run_dir / "metrics.jsonl", "a")
        where = f"resumed at step {trainer.step}" if trainer.step else "from scratch"
        mesh = getattr(trainer.backend, "mesh", None)  # train.fsdp_shard's 2-D (replicate, shard) mesh
        hsdp = f" (HSDP: shard {mesh.shape[1]} x replicate {mesh.shape[0]})" if mesh is not None else ""
        print(f"train: {trainer.cfg.name} ({trainer.info['shorthand']}, {trainer.info['params'] / 1e6:.2f}M params) "
              f"{where} on {trainer.backend.name} x{trainer.backend.world_size}{hsdp} {trainer.device} "
              f"{str(trainer.amp_dtype).replace('torch.', '')}; "
              f"{next_step_tokens(trainer)} tokens/step; run folder {where_run_is(trainer.cfg)}", file=self.stream,
              flush=True)

    def on_step_end(self, trainer, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()  # a killed job keeps every logged step
        if metrics["step"] % self.log_interval == 0 or metrics["step"] == trainer.cfg.train.max_steps:
            print(format_step_line(metrics, trainer.cfg.train.max_steps), file=self.stream, flush=True)

    def on_eval(self, trainer, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()  # on the disk (and so in the run files a checkpoint uploads) before the next step
        depth = f"r={metrics['val_depth']}, " if metrics.get("val_depth") is not None else ""
        from pipeline.model.registry import NOISY_TYPES

        noise = ", noise off" if trainer.cfg.model.type in NOISY_TYPES else ""
        print(f"eval step {metrics['step']} | val_loss {metrics['val_loss']:.4f} ({depth}{metrics['val_tokens']:,} "
              f"validation tokens{noise})", file=self.stream, flush=True)

    def on_checkpoint(self, trainer, path, info: dict) -> None:
        self._file.write(json.dumps(info) + "\n")
        self._file.flush()
        rss = (f", rank-0 peak RSS {info['rss_peak_mb']:,.0f} MB ({info['rss_peak_over_before_mb']:+,.0f} MB over "
               f"its RSS before the save)" if "rss_peak_mb" in info else "")
        took = "published after" if trainer.cfg.train.async_checkpoint else "took"
        stored = f" -> {info['stored']}" if "stored" in info else ""
        print(f"checkpoint {path}{stored} ({info['format']}, {took} {info['checkpoint_s']:.2f} s{rss})",
              file=self.stream, flush=True)

    def on_train_end(self, trainer, status: str) -> None:
        if self._file:
            self._file.close()


class TrackerCallback(Callback):
    """Sends params (the flattened recipe and the model's figures), the tokenized datasets as the run's inputs,
    metrics, artifacts and (with tracking.system_metrics) system metrics to the tracker."""

    STEP_KEYS = ("loss", "grad_norm", "lr", "depth", "tokens_per_s", "flops_per_token", "tokens_seen", "mem_gb",
                 "mfu", "skipped_steps", "grad_accum_steps", "depth_bound",  # these two: curricula only
                 "z_loss")  # train.z_loss only

    def __init__(self, tracker):
        self.tracker = tracker

    def on_train_start(self, trainer) -> None:
        params = dict(trainer.cfg.flat())
        params.update({f"info.{k}": v for k, v in trainer.info.items()})
        params["info.tokens_per_step"] = trainer.tokens_per_step
        self.tracker.log_params(params)
        self.tracker.set_tags({"model.type": trainer.cfg.model.type, "shorthand": trainer.info["shorthand"],
                               "run_dir": trainer.cfg.run_url or str(trainer.run_dir.resolve())})
        dataset_dirs = trainer.dataset_dirs  # local folders (an s3:// dataset's copy in the node cache)
        urls = [str(d) if storage.is_remote(d) else None for d in trainer.cfg.data.training_datasets()[0]]
        self.tracker.log_datasets(dataset_dirs, "train", urls)  # an s3:// dataset is named by its URL
        self.tracker.log_artifact(trainer.run_dir / "recipe.yaml")
        for d in dataset_dirs:
            self.tracker.log_artifact(Path(d) / "manifest.json", "data" if len(dataset_dirs) == 1
                                      else f"data/{Path(d).name}")
        if trainer.cfg.tracking.system_metrics:
            self.tracker.start_system_metrics()
        if self.tracker.ui_url:
            print(f"tracking: MLflow run {self.tracker.run_id}: {self.tracker.ui_url}", flush=True)

    def on_step_end(self, trainer, metrics: dict) -> None:
        if metrics["step"] % trainer.cfg.train.log_interval == 0 or metrics["step"] == trainer.cfg.train.max_steps:
            self.tracker.log_metrics({k: metrics[k] for k in self.STEP_KEYS if metrics.get(k) is not None},
                                     metrics["step"])

    def on_eval(self, trainer, metrics: dict) -> None:
        extra = {f"val_loss_exit_{e}": v for e, v in zip(metrics.get("exit", []), metrics.get("exit_loss", []))}
        if metrics.get("val_bpb") is not None:
            extra["val_bpb"] = metrics["val_bpb"]  # train.eval_exits: empty when off, the call as before
        extra.update({k: v for k, v in metrics.items() if k.startswith("task_")})  # train.eval_tasks
        self.tracker.log_metrics({"val_loss": metrics["val_loss"], **extra}, metrics["step"])
