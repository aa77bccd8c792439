"""Run by tests/test_gpu_paths.py under torchrun (2 ranks, gloo): FSDP2 as the trainer applies it (parallelize +
the fsdp backend's setup/no_sync/backward), counting per micro-step

- the all-gathers and reduce-scatters the process issues (torch.distributed's entry points wrapped by name, so the
  count is what goes over the wire, whatever FSDP2 does inside), at depth R = 1 and R = 4;
- the bytes of every tensor alive in the process after a micro-step that is not the step's last (found with the
  garbage collector, storages counted once): what accumulation holds between micro-steps, unsharded or not.

Usage: python tests/fsdp_comm_worker.py OUT_JSON
"""
from __future__ import annotations

import gc
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.config import TrainConfig
from pipeline.model import build_model
from pipeline.model.configs import MODEL_CONFIGS
from pipeline.train.backend import FSDP
from pipeline.train.optim import build_optimizer
from pipeline.train.parallelize import parallelize

COLLECTIVES = {"all_gather": ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
               "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")}
counts = {"all_gather": 0, "reduce_scatter": 0}


def wrap_collectives() -> None:
    for kind, names in COLLECTIVES.items():
        for name in names:
            fn = getattr(dist, name, None)
            if fn is None:
                continue

            def counted(*args, _fn=fn, _kind=kind, **kwargs):
                counts[_kind] += 1
                return _fn(*args, **kwargs)
            setattr(dist, name, counted)


def live_tensor_bytes() -> int:
    """Bytes of the storages of every tensor the garbage collector can reach (each storage once)."""
    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() on a deprecated alias among the objects warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        if obj.device.type == "meta":
            continue
        local = obj._local_tensor if hasattr(obj, "_local_tensor") else obj  # a DTensor: its shard
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        key = storage.data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def main(out: Path) -> None:
    wrap_collectives()
    tc = TrainConfig(backend="fsdp", device="cpu", dtype="float32", grad_accum_steps=4)
    be = FSDP(tc)
    # a core that dominates the parameters, so that what accumulation holds shows in the byte count
    cfg = MODEL_CONFIGS["grt"](type="grt", vocab_size=64, block_size=8, d_model=128, n_head=2,
                               n_prelude=1, n_core=2, n_coda=1, n_recurrence=4)
    model = build_model(cfg, seed=3)
    n_params = sum(p.numel() for p in model.parameters())
    parallelize(model, tc, torch.float32, be.device)
    model, opt = be.setup(model, lambda m: build_optimizer(m, tc, "cpu"))
    g = torch.Generator().manual_seed(be.rank)
    x = torch.randint(0, 64, (2, 8), generator=g)
    result = {"params": n_params, "world": be.world_size, "per_micro_step": {}}

    def micro_step(depth: int, last: bool) -> dict:
        before = dict(counts)
        with be.no_sync(model, last):
            _, loss = model(x, x, n_steps=depth)
            be.backward(model, loss, 2, last)
        return {k: counts[k] - before[k] for k in counts}

    for depth in (1, 4):
        micro_step(depth, last=True)  # warm-up: lazy FSDP init, first gathers
        opt.zero_grad(set_to_none=True)
        result["per_micro_step"][str(depth)] = micro_step(depth, last=True)
        opt.zero_grad(set_to_none=True)
    base = live_tensor_bytes()  # parameters (sharded), optimizer state, no gradients
    micro_step(4, last=False)
    result["held_after_non_last_micro_step"] = live_tensor_bytes() - base
    result["shard_grad_bytes"] = 4 * n_params / be.world_size
    result["full_grad_bytes"] = 4 * n_params
    micro_step(4, last=True)
    result["grad_bytes_after_last"] = sum(p.grad._local_tensor.numel() * 4 for p in model.parameters()
                                          if p.grad is not None)
    if be.rank == 0:
        out.write_text(json.dumps(result))
    be.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
