"""Downstream tasks during training (``train.eval_tasks``): at each ``train.eval_interval``, the first
``train.eval_task_limit`` items of each task scored through the same lm-eval adapter as ``grt eval``
(:func:`~pipeline.eval.lm_eval.downstream.run_tasks`), at ``eval.task_depths`` (default the trained depth).

Every rank scores every request (the same forwards, no collective inside): lm-eval shards a task across ranks only
through its own accelerate gather, which this loop does not run, so a rank never waits on another here and all ranks
hold the same numbers (rank 0 logs them; lm-eval answers on LOCAL_RANK 0 only, so the call runs as LOCAL_RANK 0).
Sharded parameters (FSDP, ZeRO-3): every rank runs the same forwards, so the blocks gather in them as in training;
what the adapter reads outside a forward (FSDP: the root's parameters; ZeRO-3: the model's own and the LM head's
weight) is gathered for the call (:func:`~pipeline.train.in_loop_eval.gathered`, :func:`~.head`).
lm-eval seeds Python's, NumPy's and torch's RNGs: they are saved before and put back after, and the model is put
back in train mode, so training goes on as without. No standard errors: lm-eval bootstraps some (perplexity) in a
forked process pool, which can hang a process that runs threads (torch's, MLflow's, the heartbeat): seen here as a
test stuck 13 minutes in a forked child.
"""
from __future__ import annotations

import contextlib
import os
import random
import sys
import time

import numpy as np
import torch

from pipeline.train.in_loop_tasks_check import DEFAULT_LIMIT


@contextlib.contextmanager
def as_local_rank_0():
    """LOCAL_RANK=0 for the block: lm-eval's simple_evaluate returns its results on LOCAL_RANK 0 only (None
    elsewhere), and here every rank scores for itself."""
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


@contextlib.contextmanager
def rng_kept(device: torch.device):
    """Python's, NumPy's and torch's (CPU and, on CUDA, the device's) RNG states put back on exit."""
    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def task_keys(downstream: dict) -> dict[str, float]:
    """run_tasks' result -> {"task_<task>_<metric>": value} (one depth), or "..._d<depth>" per depth when several;
    no stderrs (not computed: see :meth:`InLoopTasks.run`)."""
    depths = downstream["depths"]
    out = {}
    for depth, table in depths.items():
        tail = f"_d{depth}" if len(depths) > 1 else ""
        for task, row in table.items():
            out.update({f"task_{task}_{m}{tail}": v for m, v in row.items()
                        if m != "items" and not m.endswith("_stderr")})
    return out


class InLoopTasks:
    """The model being trained scored on ``train.eval_tasks``; :meth:`run` returns the metrics to add to the eval's."""

    def __init__(self, trainer):
        from pipeline.eval.lm_eval.downstream import check_task_inputs
        from pipeline.model import model_class

        cfg = trainer.cfg
        self.cfg, self.backend = cfg, trainer.backend
        self.tasks = list(cfg.train.eval_tasks)
        self.limit = cfg.train.eval_task_limit or DEFAULT_LIMIT
        # before training starts: lm-eval imports and the data folder holds every task's files (one line if not),
        # on every rank, agreed: a file missing on one node stops all ranks here rather than leave them waiting
        error = None
        try:
            self.data_dir = str(check_task_inputs(self.tasks, cfg.eval.task_data_dir))
        except (LookupError, OSError) as e:
            error = e
        if not self.backend.all_true(error is None, patient=True):
            raise error or FileNotFoundError("train.eval_tasks: another rank cannot read its task files (its error "
                                             "names them); give every node the task data folder")
        self.depths = list(cfg.eval.task_depths) or [model_class(cfg.model.type).full_depth(cfg.model)]

    def run(self, trainer) -> dict:
        """Score every task on this rank (every rank the same), then train mode, routing and RNGs as they were."""
        from pipeline.eval.analyses.methods import routing
        from pipeline.eval.lm_eval.downstream import run_tasks  # lm-eval loads only for runs that use it
        from pipeline.infer.precision import inference_precision
        from pipeline.train.in_loop_eval import gathered
        from pipeline.train.in_loop_eval import head

        t0 = time.perf_counter()
        model, ev = trainer.raw_model, self.cfg.eval
        was_training = model.training
        model.eval()
        try:  # MoR: the adapter switches to causal routing; routing() puts the training routing back
            with rng_kept(trainer.device), as_local_rank_0(), routing(model, getattr(model, "routing", None)), \
                    inference_precision(ev.dtype, trainer.device), gathered(model, self.backend), \
                    (head(model, self.backend) or contextlib.nullcontext)():
                res = run_tasks(model, self.cfg, self.tasks, self.depths, ev.task_batch_size, self.data_dir,
                                self.limit, quiet=True,
                                bootstrap_iters=0)  # no forked pool in a threaded trainer
        finally:
            model.train(was_training)
        out = task_keys(res)
        out["task_eval_s"] = time.perf_counter() - t0
        if self.backend.is_main:
            shown = ", ".join(f"{k.removeprefix('task_')} {v:.4g}" for k, v in out.items() if k != "task_eval_s")
            print(f"tasks step {trainer.step} | {shown} ({out['task_eval_s']:.1f} s)", file=sys.stdout, flush=True)
        return out
