"""Run by tests/test_meta_init.py (under torchrun, or alone for ``single``): build the model the trainer would build
for each backend named on the command line and write, per rank, OUT/<backend>-rank<r>.pt holding

    state   the full state dict after initialisation (rank 0 only; fsdp: get_model_state_dict(full_state_dict),
            ZeRO-3: the parameters gathered with GatheredParameters)
    tied    whether lm_head.weight is still the same Parameter as embed.wte.weight
    loss    the eval-mode loss on a fixed batch, run through the backend's wrapped model (FSDP's lazy init first)
    rss_mb  how much this process's peak RSS grew while the model was built (VmHWM, reset before the build)

With ``--rss-model=JSON`` it then builds that (larger) model for fsdp once more, measuring only, and writes
OUT/fsdp-rss-rank<r>.pt: distributed.md's claim that no rank holds the whole model at start-up, at a size that shows.

Usage: python tests/meta_init_worker.py OUT MODEL_JSON SEED BACKEND... [--measure-only] [--rss-model=JSON]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pipeline.config import RunConfig
from pipeline.config import TrainConfig
from pipeline.model.configs import MODEL_CONFIGS
from pipeline.train.backend import build_backend
from pipeline.train.materialize import build_for_training
from pipeline.train.optim import build_optimizer

BACKENDS = {
    "single": dict(backend="single"),
    "fsdp": dict(backend="fsdp", activation_checkpointing="blocks"),
    "zero3": dict(backend="deepspeed", zero_stage=3, activation_checkpointing="blocks"),
}


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def full_state(model, backend_name: str) -> dict:
    if backend_name == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if backend_name == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def model_config(model_json: str):
    model_dict = json.loads(model_json)
    return MODEL_CONFIGS[model_dict["type"]](**model_dict)


def main(out: Path, model_json: str, seed: int, names: list[str], measure_only: bool, rss_model: str | None) -> None:
    jobs = [(name, name, model_config(model_json), measure_only) for name in names]  # (file tag, backend, ...)
    if rss_model:
        jobs.append(("fsdp-rss", "fsdp", model_config(rss_model), True))
    for tag, name, model_cfg, measure_only in jobs:
        world = int(os.environ.get("WORLD_SIZE", 1))
        tc = TrainConfig(device="cpu", dtype="float32", micro_batch_size=2, grad_accum_steps=world, **BACKENDS[name])
        cfg = RunConfig(seed=seed, model=model_cfg, train=tc)
        backend = build_backend(tc)
        import torch.distributed.fsdp  # noqa: F401  (imported before the measurement: its code is not the model)
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = rss_kb("VmRSS")
        raw = build_for_training(cfg, backend)
        result = {"rss_mb": (rss_kb("VmHWM") - before) / 1024, "tied": raw.lm_head.weight is raw.embed.wte.weight}
        model = raw
        if not measure_only:
            model, _ = backend.setup(raw, lambda m: build_optimizer(m, tc, "cpu"))
            model.eval()
            gen = torch.Generator().manual_seed(0)
            idx = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.block_size + 1), generator=gen)
            with torch.no_grad():
                result["loss"] = model(idx[:, :-1], idx[:, 1:])[1].item()
            result["tied_after_forward"] = raw.lm_head.weight is raw.embed.wte.weight
            state = full_state(raw, name)
            if backend.is_main:
                result["state"] = state
        torch.save(result, out / f"{tag}-rank{backend.rank}.pt")
        del raw, model
        backend.barrier()
    backend.close()


if __name__ == "__main__":
    rss = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--rss-model=")]
    args = [a for a in sys.argv[1:] if a != "--measure-only" and not a.startswith("--rss-model=")]
    main(Path(args[0]), args[1], int(args[2]), args[3:], "--measure-only" in sys.argv, rss[0] if rss else None)
