"""Early-exit curves: validation loss after every recurrence step (GRT) or layer (dense), one pass per batch."""
from __future__ import annotations

import torch

from pipeline.model import model_class


@torch.no_grad()
def exit_curve(model, batches, n_max: int | None, device: torch.device) -> dict:
    """Token-weighted mean of each exit's loss over ``batches``; the gate's mean per step where there is one."""
    model.eval()
    sums, gate_sums, r0_sum, tokens, has_r0 = None, None, 0.0, 0, False
    exits = None
    for x, y in batches:
        out = model.exit_losses(x.to(device), y.to(device), n_max)
        n = y.numel()
        exits = out["exit"]
        sums = [0.0] * len(exits) if sums is None else sums
        sums = [s + l * n for s, l in zip(sums, out["loss"])]
        if out.get("gate_mean"):
            gate_sums = [0.0] * len(exits) if gate_sums is None else gate_sums
            gate_sums = [s + g * n for s, g in zip(gate_sums, out["gate_mean"])]
        if out.get("loss_r0") is not None:
            r0_sum += out["loss_r0"] * n
            has_r0 = True
        tokens += n
    result = {"exit": exits, "loss": [s / tokens for s in sums], "val_tokens": tokens}
    if gate_sums is not None:
        result["gate_mean"] = [s / tokens for s in gate_sums]
    if has_r0:
        result["loss_r0"] = r0_sum / tokens
    return result


def exit_flops(cfg, exits: list[int]) -> list[int]:
    """Inference FLOPs per token (Eq. 1 + head) of exiting at each point."""
    cls = model_class(cfg.type)
    return [cls.flops_per_token(cfg, e, with_head=True) for e in exits]
