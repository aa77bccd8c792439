"""LM head + cross-entropy fused and chunked: the loss of ``h @ W^T`` against targets without ever holding the whole
``[tokens, vocab]`` logits (the largest tensor in GPT-2-sized training) or its gradient.

The forward pass walks the tokens in chunks; when gradients are needed it computes them on the spot (softmax minus
one-hot, times W for dh and accumulated into dW), so the backward pass only scales them. On a CPU the chunks stay
under glibc's mmap threshold, which removes most page-fault time (measured 1.45x faster head forward+backward at
2,048 tokens x 50,257 on 2 cores); on a GPU the win is memory. Reference: ``F.cross_entropy(h @ W.T, targets)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -1


def _chunk_rows(vocab: int, device: torch.device) -> int:
    budget = (1 << 30) if device.type == "cuda" else (24 << 20)  # bytes of fp32 logits per chunk
    return max(1, budget // (4 * vocab))


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return h.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, compute_dtype, chunk):
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(compute_dtype)
            valid_all = targets != IGNORE
            n = valid_all.sum().clamp(min=1)
            acc = torch.promote_types(compute_dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
            loss = torch.zeros((), dtype=acc, device=h.device)
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
            for s in range(0, h.shape[0], chunk):
                hc, tc = h[s:s + chunk].to(compute_dtype), targets[s:s + chunk]
                valid = valid_all[s:s + chunk]
                tcl = tc.clamp(min=0)
                logits = (hc @ w.t()).to(acc)
                lse = torch.logsumexp(logits, dim=-1)
                loss += ((lse - logits.gather(1, tcl[:, None]).squeeze(1)) * valid).sum()
                p = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                p[torch.arange(p.shape[0], device=p.device), tcl] -= 1.0  # d(sum of losses)/d(logits)
                p.mul_(valid[:, None])
                p = p.to(compute_dtype)
                grad_h[s:s + chunk] = (p @ w).to(h.dtype)
                grad_w += (p.t() @ hc).to(acc)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n = n
        ctx.weight_dtype = weight.dtype
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        return (grad_h * scale.to(grad_h.dtype), (grad_w * scale).to(ctx.weight_dtype), None, None, None)


@torch.no_grad()
def _loss_only(h, weight, targets, compute_dtype, chunk):
    w = weight.to(compute_dtype)
    acc = torch.promote_types(compute_dtype, torch.float32)
    total = torch.zeros((), dtype=acc, device=h.device)
    for s in range(0, h.shape[0], chunk):
        logits = (h[s:s + chunk].to(compute_dtype) @ w.t()).to(acc)
        total += F.cross_entropy(logits, targets[s:s + chunk], ignore_index=IGNORE, reduction="sum")
    return total / (targets != IGNORE).sum().clamp(min=1)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """Mean cross-entropy (nats; fp32, or fp64 for fp64 inputs) of ``h @ weight.T`` against ``targets``.

    ``h``: [..., d]; ``weight``: [vocab, d]; ``targets``: [...] with -1 = ignored."""
    d = h.shape[-1]
    h2, t2 = h.reshape(-1, d), targets.reshape(-1)
    chunk = chunk or _chunk_rows(weight.shape[0], h.device)
    cdt = _compute_dtype(h)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h2, weight, t2, cdt, chunk)
    return _loss_only(h2, weight, t2, cdt, chunk)
