"""Run by tests/test_gpu_paths.py as one rank (RANK/WORLD_SIZE/MASTER_* set by the test): the DeepSpeed backend with
train.dtype=bfloat16 at ZeRO stage STAGE, two training steps of a small GRT; inside the second optimizer step (the
peak of model state: gradients, master weights and AdamW state all alive) the bytes of every tensor alive in the
process, against the preflight's parameters + gradients + optimizer for the same model and plan; and the dtypes the
engine runs with (what it made of the generated config).

Usage: python tests/deepspeed_bytes_worker.py STAGE OUT_JSON
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fsdp_comm_worker import live_tensor_bytes
from launch.memory import model_state_bytes
from launch.memory import param_counts
from pipeline.config import TrainConfig
from pipeline.model import build_model
from pipeline.model.configs import MODEL_CONFIGS
from pipeline.train.backend import DeepSpeed
from pipeline.train.optim import build_optimizer


def main(stage: int, out: Path) -> None:
    tc = TrainConfig(backend="deepspeed", device="cpu", dtype="bfloat16", zero_stage=stage, grad_accum_steps=1,
                     micro_batch_size=2)
    cfg = MODEL_CONFIGS["grt"](type="grt", vocab_size=64, block_size=8, d_model=128, n_head=2,
                               n_prelude=1, n_core=2, n_coda=1, n_recurrence=2)
    base = live_tensor_bytes()
    be = DeepSpeed(tc)
    engine, opt = be.setup(build_model(cfg, seed=3), lambda m: build_optimizer(m, tc, "cpu"))
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt  # the client AdamW inside DeepSpeed's wrapper
    seen = []
    step = inner.step

    def measured_step(*args, **kwargs):
        seen.append(live_tensor_bytes() - base)
        return step(*args, **kwargs)
    inner.step = measured_step
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = engine(x, x, n_steps=2)
        be.backward(engine, loss, 1, True)
        be.step(engine, opt)
    est = model_state_bytes(param_counts(cfg), "deepspeed", stage, 1, bf16=True)
    model_dtype, accum_dtype = engine.get_data_types()
    out.write_text(json.dumps({"engine_dtypes": {"model": str(model_dtype), "grad_accum": str(accum_dtype),
                                                 "communication": str(engine.communication_data_type)},
                               "measured": seen[-1], "preflight": est["parameters"] + est["gradients"] +
                               est["optimizer"], "rows": est, "params": sum(p.numel() for p in engine.parameters())}))
    be.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
