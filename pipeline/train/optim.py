"""AdamW with decay on matmul weights only, and the warm-up + cosine schedule (paper §4)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pipeline.config import TrainConfig
from pipeline.train.schedule import scheduled_lr


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on Linear weights; none on biases, norms and embeddings (the tied head is the embedding)."""
    decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():  # unique parameters (tied tensors once)
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if id(p) in decay_ids and id(p) not in embed_ids else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.Optimizer:
    kwargs = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             **kwargs)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up from 0 over ``warmup_steps``, then cosine from ``lr`` to ``min_lr`` at ``max_steps``; the
    other ``train.lr_schedule`` choices are :func:`pipeline.train.schedule.scheduled_lr`'s."""
    if cfg.lr_schedule != "cosine":
        return scheduled_lr(step, cfg)
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= cfg.max_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
