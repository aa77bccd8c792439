"""Triton kernels for the GRT step's elementwise work (CUDA; on a CPU only under ``TRITON_INTERPRET=1``, for tests).

    gate update   g = sigmoid(z / tau + eps_g),  h' = g * h + (1 - g) * o      eps_g = sigma_g * N(0, 1)
    state noise   x = h + eps_x                                                eps_x = sigma_x * N(0, 1)

The noise is drawn inside the kernels from Philox at (seed, element index), so no noise tensor is ever stored: the
backward kernel draws the same eps_g again from the same seed, recomputes g from z, and writes dz, dh, do in one pass:

    dh = g * dy,   do = (1 - g) * dy,   dz = dy * (h - o) * g * (1 - g) / tau

Inputs may be float32 or bfloat16 (math in float32), each its own (autocast hands z and o in bf16 with h in float32),
any shape, contiguous; each output takes the dtype of the input it belongs to (y and dh: h's, dz: z's, do: o's).

``seed`` is not specialised on (``do_not_specialize``): Triton would otherwise build a kernel per class of seed value
(seed == 1, seed % 16 == 0, any other), so a run's first few seeds would each stall on a compile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["seed"])
def _gate_fwd(z_ptr, h_ptr, o_ptr, y_ptr, n, inv_tau, sigma, seed, BLOCK: tl.constexpr, NOISE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    logit = z * inv_tau
    if NOISE:
        logit += sigma * tl.randn(seed, offs)
    g = tl.sigmoid(logit)
    tl.store(y_ptr + offs, (o + g * (h - o)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _gate_bwd(dy_ptr, z_ptr, h_ptr, o_ptr, dz_ptr, dh_ptr, do_ptr, n, inv_tau, sigma, seed, BLOCK: tl.constexpr,
              NOISE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    logit = z * inv_tau
    if NOISE:
        logit += sigma * tl.randn(seed, offs)  # the forward's noise, drawn again
    g = tl.sigmoid(logit)
    tl.store(dh_ptr + offs, (g * dy).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(do_ptr + offs, ((1.0 - g) * dy).to(do_ptr.dtype.element_ty), mask=mask)
    tl.store(dz_ptr + offs, (dy * (h - o) * g * (1.0 - g) * inv_tau).to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _add_noise(h_ptr, y_ptr, n, sigma, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (h + sigma * tl.randn(seed, offs)).to(y_ptr.dtype.element_ty), mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


def _check(*ts: torch.Tensor) -> None:
    for t in ts:
        if not t.is_contiguous():
            raise ValueError("the Triton gate kernels take contiguous tensors; call .contiguous() first")
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"the Triton gate kernels take float32 or bfloat16, got {t.dtype}")
    if len({t.shape for t in ts}) != 1:
        raise ValueError(f"z, h, o must have one shape, got {[tuple(t.shape) for t in ts]}")


def gate_forward(z: torch.Tensor, h: torch.Tensor, o: torch.Tensor, tau: float, sigma: float, seed: int):
    _check(z, h, o)
    y = torch.empty_like(h)
    n = y.numel()
    if n:
        _gate_fwd[_grid(n)](z, h, o, y, n, 1.0 / tau, sigma, seed, BLOCK=BLOCK, NOISE=sigma > 0)
    return y


def gate_backward(dy: torch.Tensor, z: torch.Tensor, h: torch.Tensor, o: torch.Tensor, tau: float, sigma: float,
                  seed: int):
    dy = dy.contiguous()
    _check(z, h, o)
    dz, dh, do = torch.empty_like(z), torch.empty_like(h), torch.empty_like(o)
    n = dy.numel()
    if n:
        _gate_bwd[_grid(n)](dy, z, h, o, dz, dh, do, n, 1.0 / tau, sigma, seed, BLOCK=BLOCK, NOISE=sigma > 0)
    return dz, dh, do


def add_noise(h: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    _check(h)
    y = torch.empty_like(h)
    n = y.numel()
    if n:
        _add_noise[_grid(n)](h, y, n, sigma, seed, BLOCK=BLOCK)
    return y
