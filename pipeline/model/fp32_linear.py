"""A Linear whose output is computed in fp32 whatever autocast and the parameters' dtype say: for the small heads
whose output is a logit read by a sigmoid, a softmax or a top-k (GRT's gate, MoR's routers, Ouro's exit gate,
RecurTrace's halting head)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F


def autocast_off(device: torch.device):
    """A region where autocast does not cast (CPU and CUDA: the devices it runs on here; on meta, where
    ``torch.autocast`` refuses the device type, nothing to turn off)."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else contextlib.nullcontext()


class _LinearFP32(torch.autograd.Function):
    """y = x W^T + b computed in fp32 (fp64 kept) from x, W, b in whatever dtype they come, saving x and W as they
    came: a bf16 x is not kept a second time as an fp32 copy (autograd of ``F.linear(x.float(), ...)`` would keep
    the copy, 4 bytes per element on top of the bf16 x that autocast's Linear saved)."""

    @staticmethod
    def forward(ctx, x, w, b):
        dt = torch.promote_types(torch.promote_types(x.dtype, w.dtype), torch.float32)
        with autocast_off(x.device):
            y = F.linear(x.to(dt), w.to(dt), None if b is None else b.to(dt))
        ctx.save_for_backward(x, w)
        ctx.b_dtype = None if b is None else b.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        with autocast_off(dy.device):
            if ctx.needs_input_grad[0]:
                dx = (dy @ w.to(dy.dtype)).to(x.dtype)
            dy2 = dy.reshape(-1, dy.shape[-1])
            if ctx.needs_input_grad[1]:
                dw = (dy2.t() @ x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(w.dtype)
            if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
                db = dy2.sum(0).to(ctx.b_dtype)
        return dx, dw, db


class FP32Linear(nn.Linear):
    """A Linear computed in fp32 (fp64 in an fp64 model) whatever the autocast dtype and the dtype its parameters are
    held in: for the small heads whose output is a logit read by a sigmoid, a softmax or a top-k (GRT's gate, MoR's
    routers, Ouro's exit gate, RecurTrace's halting head). Autocast would run it in bf16 and round the logit to 8
    significant bits: up to 2^-6 = 0.016 at the gate's +4, a 1.5% error in the 1 - g that a near-copy step writes,
    and ties among router scores. A bf16 weight (DeepSpeed's bf16 engine, an FSDP2 bf16 gather) is cast up. A
    module of its own (not ``F.linear`` on its weight from the parent) so that ZeRO-3 gathers its parameters at its
    own forward; the same parameters and checkpoint keys as a plain Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFP32.apply(x, self.weight, self.bias)
