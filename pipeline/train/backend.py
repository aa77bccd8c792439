"""The seam between the trainer and how it is parallelised. ``train.backend`` picks one; each knows its rank and
world size and wraps the model (later: DDP, FSDP2 per block, DeepSpeed ZeRO)."""
from __future__ import annotations

import torch
import torch.nn as nn


class SingleProcess:
    """One process, one device."""

    name = "single"
    rank = 0
    world_size = 1
    is_main = True

    def __init__(self, device: torch.device):
        self.device = device

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def reduce_mean(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


BACKENDS = {"single": SingleProcess}


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but torch sees no CUDA device; use train.device=cpu or auto")
        return torch.device("cuda")
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


def build_backend(name: str, device: torch.device):
    return BACKENDS[name](device)
