"""The seam between the trainer and how it is parallelised. ``train.backend`` picks one of

    single     one process
    ddp        torch DistributedDataParallel
    fsdp       FSDP2 (``fully_shard``), applied per block by :mod:`pipeline.train.parallelize`
    deepspeed  DeepSpeed ZeRO stage ``train.zero_stage`` (0..3), config generated from the recipe

Each knows its rank and world size, wraps the model and optimizer, runs backward and the optimizer step, and saves
and loads the model + optimizer part of a checkpoint. Launch: ``torchrun`` for all of them (and the ``deepspeed``
launcher for DeepSpeed); the process group is created from the launcher's environment.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from pipeline.config import TrainConfig


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but torch sees no CUDA device; use train.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def autocast_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 autocast where the device does it natively (CUDA with bf16); fp32 elsewhere unless asked."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _global_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip (max_norm > 0) or just measure the global L2 norm of the gradients; works for DTensor (FSDP2) too."""
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


class SingleProcess:
    """One process, one device. Also the base of the distributed backends."""

    name = "single"
    can_skip = True  # a non-finite step can be dropped without touching the optimizer

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = pick_device(cfg.device)
        self.amp_dtype = autocast_dtype(cfg.dtype, self.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- model and optimizer
    def setup(self, model: nn.Module, optimizer_fn) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move/wrap the (already parallelized) model and build its optimizer."""
        model = model.to(self.device)
        return model, optimizer_fn(model)

    def no_sync(self, model, last_micro: bool):
        return contextlib.nullcontext()

    def backward(self, model, loss: torch.Tensor, accum: int, last_micro: bool) -> None:
        (loss / accum).backward()

    def step(self, model, optimizer) -> float:
        """Clip, step, zero; returns the gradient norm before clipping. Non-finite gradients: no step (the same
        decision on every rank, since the norm is global)."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = _global_grad_norm(params, self.cfg.grad_clip)
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def skip_step(self, model, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def set_lr(self, optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    # ---- collectives (no-ops in one process)
    def all_true(self, flag: bool) -> bool:
        return flag

    def reduce_mean(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ---- checkpoints: full (unsharded) state dicts, interchangeable between single, ddp and fsdp
    def model_optimizer_state(self, model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(self.unwrap(model), optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {"model": msd, "optimizer": osd}

    def save_model_optimizer(self, model, optimizer, folder: Path, state: dict) -> None:
        """Called on every rank; rank 0 writes ``state`` (already holding the full state dicts) as one file."""
        self._write_state(folder, state)

    def _write_state(self, folder: Path, state: dict) -> None:
        if self.is_main:
            with open(folder / "state.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

    def load_model_optimizer(self, model, optimizer, folder: Path, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.unwrap(model), optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True))


class TorchDistributed(SingleProcess):
    """Common part of the distributed backends: rank and world size from the launcher's environment."""

    launch_hint = "torchrun --nproc_per_node N -m pipeline.cli train RECIPE"

    def __init__(self, cfg: TrainConfig):
        if "RANK" not in os.environ:
            raise RuntimeError(f"train.backend={cfg.backend} needs a launcher: run it under `{self.launch_hint}` "
                               f"(see README: Distributed training)")
        self.cfg = cfg
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = pick_device(cfg.device, self.local_rank)
        self.amp_dtype = autocast_dtype(cfg.dtype, self.device)
        self._init_process_group(datetime.timedelta(seconds=cfg.collective_timeout_s))

    def _init_process_group(self, timeout: datetime.timedelta) -> None:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout,
                                    device_id=self.device if self.device.type == "cuda" else None)

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([0.0 if flag else 1.0], device=self.device)
        dist.all_reduce(t)
        return t.item() == 0.0

    def reduce_mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world_size

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.barrier()  # nobody tears the group down while a peer is still in a collective
            except Exception:  # a peer is gone: the error that brought us here is the one to report
                pass
            dist.destroy_process_group()


class DDP(TorchDistributed):
    name = "ddp"

    def setup(self, model, optimizer_fn):
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        ddp = DistributedDataParallel(model, device_ids=[self.local_rank] if self.device.type == "cuda" else None)
        return ddp, optimizer_fn(model)

    def no_sync(self, model, last_micro: bool):
        return contextlib.nullcontext() if last_micro else model.no_sync()  # all-reduce once per step

    def unwrap(self, model):
        return model.module


class FSDP(TorchDistributed):
    """FSDP2: the per-block ``fully_shard`` calls happen in :func:`pipeline.train.parallelize.parallelize`."""

    name = "fsdp"

    def setup(self, model, optimizer_fn):
        return model, optimizer_fn(model)

    def no_sync(self, model, last_micro: bool):
        model.set_requires_gradient_sync(last_micro)  # reduce-scatter once per step
        return contextlib.nullcontext()


class DeepSpeed(TorchDistributed):
    """DeepSpeed ZeRO 0..3 with ``torch.optim.AdamW`` as the client optimizer. The engine does accumulation,
    clipping and the step; checkpoints use DeepSpeed's own (sharded) format inside the step folder."""

    name = "deepspeed"
    can_skip = False  # the engine's accumulation window cannot be abandoned half-way
    launch_hint = ("torchrun --nproc_per_node N -m pipeline.cli train RECIPE` or `deepspeed --num_gpus N "
                   "--module pipeline.cli train RECIPE")

    def _init_process_group(self, timeout: datetime.timedelta) -> None:
        import deepspeed

        if self.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        deepspeed.init_distributed("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout)

    def ds_config(self) -> dict:
        """The DeepSpeed config generated from the recipe; ``train.deepspeed`` is merged over it (escape hatch)."""
        from pipeline.config import deep_merge

        c = self.cfg
        config = {
            "train_micro_batch_size_per_gpu": c.micro_batch_size,
            "gradient_accumulation_steps": c.grad_accum_steps // self.world_size,
            "gradient_clipping": c.grad_clip,
            "zero_optimization": {"stage": c.zero_stage},
            "bf16": {"enabled": self.amp_dtype == torch.bfloat16},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
            "zero_allow_untested_optimizer": True,
        }
        return deep_merge(config, c.deepspeed or {})

    def setup(self, model, optimizer_fn):
        import deepspeed

        model = model.to(self.device)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer_fn(model),
                                                       config=self.ds_config())
        return engine, optimizer

    def backward(self, model, loss, accum, last_micro) -> None:
        model.backward(loss)  # the engine scales by 1/accumulation itself
        if not last_micro:
            model.step()  # counts the micro-step; the optimizer only steps at the accumulation boundary

    def step(self, model, optimizer) -> float:
        model.step()
        norm = model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def unwrap(self, model):
        return model.module

    def model_optimizer_state(self, model, optimizer) -> dict:
        return {}

    def save_model_optimizer(self, model, optimizer, folder: Path, state: dict) -> None:
        model.save_checkpoint(str(folder), tag="deepspeed", save_latest=False)
        self._write_state(folder, state)

    def load_model_optimizer(self, model, optimizer, folder, state) -> None:
        path, _ = model.load_checkpoint(str(folder), tag="deepspeed", load_optimizer_states=True,
                                        load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint (tag 'deepspeed'); it was written by "
                                    f"another backend — resume with that backend")


BACKENDS = {"single": SingleProcess, "ddp": DDP, "fsdp": FSDP, "deepspeed": DeepSpeed}


def build_backend(cfg: TrainConfig):
    return BACKENDS[cfg.backend](cfg)
