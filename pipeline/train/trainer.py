"""A small generic trainer: build everything from the recipe, loop, call back. Checkpointing is built in because
resume must restore what the loop owns (step, loader cursor, RNG); everything optional is a callback."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from pipeline.config import RunConfig
from pipeline.model import build_model, model_class, model_info
from pipeline.tokenize.bpe import tokenizer_identity
from pipeline.tracking import open_tracker
from pipeline.train.backend import autocast_dtype, build_backend, pick_device
from pipeline.train.callbacks import Callback, ConsoleLogger, TrackerCallback
from pipeline.train.checkpoint import list_checkpoints, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from pipeline.train.data import SequenceLoader, TokenShards, validation_batches
from pipeline.train.optim import build_optimizer, lr_at


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


def training_datasets(cfg: RunConfig) -> tuple[list[str], list[float]]:
    """The datasets training samples from, with weights: ``data.mixture`` or ``data.dataset_dir`` alone. The first
    one's validation split is the run's validation set."""
    if cfg.data.mixture:
        return [m.dataset_dir for m in cfg.data.mixture], [m.weight for m in cfg.data.mixture]
    return [cfg.data.dataset_dir], [1.0]


def model_config_diff(saved: dict, now: dict) -> list[str]:
    return [f"model.{k}: checkpoint {saved.get(k)!r} != recipe {now.get(k)!r}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]


class Trainer:
    def __init__(self, cfg: RunConfig, callbacks: list[Callback] | None = None):
        self.cfg = cfg
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        torch.manual_seed(cfg.seed)
        self.device = pick_device(tc.device)
        self.backend = build_backend(tc.backend, self.device)
        self.amp_dtype = autocast_dtype(tc.dtype, self.device)
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.run_dir / "checkpoints"
        dirs, weights = training_datasets(cfg)
        self.dataset_dir = Path(dirs[0])
        self.train_data = [TokenShards(d, "train") for d in dirs]
        for d, ds in zip(dirs, self.train_data):
            check_dataset_matches_model(ds.manifest, cfg, f"the dataset at {d}")
        self.val_data = TokenShards(self.dataset_dir, "val")
        self.seq_len = cfg.model.block_size
        self.accum = tc.grad_accum_steps // self.backend.world_size
        self.loader = SequenceLoader(self.train_data, self.seq_len, tc.micro_batch_size, cfg.seed,
                                     self.backend.rank, self.backend.world_size, weights)
        self.tokens_per_step = tc.micro_batch_size * tc.grad_accum_steps * self.seq_len

        self.model_cls = model_class(cfg.model.type)
        self.info = model_info(cfg.model)
        self.raw_model = build_model(cfg.model)  # unwrapped: its methods (train_depth) stay reachable
        self.model = self.backend.wrap(self.raw_model)
        self.optimizer = build_optimizer(self.model, tc, self.device.type)
        self.step = 0
        self.tracker_run_id = None
        self._resume()
        (self.run_dir / "recipe.yaml").write_text(cfg.to_yaml())
        self.tracker = (open_tracker(cfg.tracking, cfg.name, self.tracker_run_id, {"model.type": cfg.model.type})
                        if self.backend.is_main else None)
        if self.tracker is not None and self.tracker.run_id:
            self.tracker_run_id = self.tracker.run_id
            (self.run_dir / "run.json").write_text(json.dumps(
                {"mlflow_run_id": self.tracker.run_id, "tracking_uri": self.tracker.uri}, indent=2))
        self.callbacks = list(callbacks) if callbacks is not None else (
            [ConsoleLogger(tc.log_interval)] + ([TrackerCallback(self.tracker)] if self.tracker else []))

    # ----------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                "loader": self.loader.state_dict(), "rng": rng_state(), "recipe": self.cfg.to_dict(),
                "mlflow_run_id": self.tracker_run_id, "info": self.info}

    def _resume(self) -> None:
        found = list_checkpoints(self.ckpt_dir)
        if not found:
            return
        if self.cfg.train.resume == "never":
            raise FileExistsError(f"{self.run_dir} already has checkpoints and train.resume=never; choose another "
                                  f"name= or delete {self.ckpt_dir}")
        state = load_checkpoint(found[-1], map_location=self.device)
        diff = model_config_diff(state["recipe"]["model"], dataclasses.asdict(self.cfg.model))
        if diff:
            raise ValueError(f"cannot resume {found[-1]}: the model changed since it was saved ({'; '.join(diff)}). "
                             f"Restore the recipe or start a new run under another name=")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.tracker_run_id = state.get("mlflow_run_id")

    def save(self) -> Path:
        path = save_checkpoint(self.ckpt_dir, self.step, self.state_dict(), self.cfg.to_yaml(),
                               self.cfg.train.keep_checkpoints)
        for cb in self.callbacks:
            cb.on_checkpoint(self, path)
        return path

    # ------------------------------------------------------------------------------------------------ loop
    def autocast(self):
        if self.amp_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    @torch.no_grad()
    def validate(self) -> dict:
        """Mean validation loss at the evaluation depth (R for GRT), noise off."""
        self.model.eval()
        total, count = 0.0, 0
        for x, y in validation_batches(self.val_data, self.seq_len, self.cfg.train.micro_batch_size,
                                       max_batches=self.cfg.train.eval_batches):
            with self.autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device))
            total += loss.item() * y.numel()
            count += y.numel()
        self.model.train()
        depth = getattr(self.cfg.model, "n_recurrence", None)
        return {"step": self.step, "val_loss": self.backend.reduce_mean(total / count), "val_tokens": count,
                "val_depth": depth}

    def train_step(self) -> dict:
        tc = self.cfg.train
        t0 = time.perf_counter()
        lr = lr_at(self.step, tc)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum, depths = 0.0, []
        for micro in range(self.accum):
            x, y = self.loader.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            depth = self.raw_model.train_depth(self.cfg.seed, self.step, micro)
            if depth is not None:
                depths.append(depth)
            with self.autocast():
                _, loss = self.model(x, y, n_steps=depth)
            (loss / self.accum).backward()
            loss_sum += loss.item()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if tc.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip).item()
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        mean_depth = sum(depths) / len(depths) if depths else None
        flops = (sum(self.model_cls.flops_per_token(self.cfg.model, d, with_head=True) for d in depths) / len(depths)
                 if depths else self.model_cls.flops_per_token(self.cfg.model, with_head=True))
        return {"step": self.step, "loss": self.backend.reduce_mean(loss_sum / self.accum), "grad_norm": grad_norm,
                "lr": lr, "depth": mean_depth, "tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt,
                "flops_per_token": flops, "tokens_seen": self.step * self.tokens_per_step, "epoch": self.loader.epoch,
                "mem_gb": torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None}

    def fit(self) -> dict:
        tc = self.cfg.train
        for cb in self.callbacks:
            cb.on_train_start(self)
        status, last_eval = "FAILED", None
        try:
            self.model.train()
            while self.step < tc.max_steps:
                metrics = self.train_step()
                if not math.isfinite(metrics["loss"]):
                    raise FloatingPointError(f"loss is {metrics['loss']} at step {self.step}; lower train.lr or "
                                             f"resume from the last checkpoint in {self.ckpt_dir}")
                for cb in self.callbacks:
                    cb.on_step_end(self, metrics)
                if self.step % tc.eval_interval == 0 or self.step == tc.max_steps:
                    last_eval = self.validate()
                    for cb in self.callbacks:
                        cb.on_eval(self, last_eval)
                if self.step % tc.checkpoint_interval == 0 or self.step == tc.max_steps:
                    self.save()
            if last_eval is None:  # resumed at max_steps: report the final loss anyway
                last_eval = self.validate()
            status = "FINISHED"
            return last_eval
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            for cb in self.callbacks:
                cb.on_train_end(self, status)
            if self.tracker is not None:
                self.tracker.close(status)
            self.backend.close()


def train(cfg: RunConfig) -> dict:
    return Trainer(cfg).fit()
