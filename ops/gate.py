"""The GRT step's elementwise ops as ``torch.library`` custom ops: one op, three paths.

(The plain formulation, ``h' = g * h + (1 - g) * o``, is written ``o + g * (h - o)``: one fewer elementwise op.)

    grt::gate_update(z, h, o, inv_tau, sigma, seed) -> o + g * (h - o),  g = sigmoid(z * inv_tau + sigma * N(0, 1))
    grt::state_noise(h, sigma, seed)               -> h + sigma * N(0, 1)

Each has a fake (meta) implementation and an autograd formula, so ``torch.compile`` traces through them without graph
breaks. Paths: the Triton kernels of :mod:`ops.gate_triton` on CUDA; the plain PyTorch reference on CPU (or anywhere,
with ``set_backend("reference")`` / ``train.fused_ops: reference``); ``set_backend("triton")`` forces the kernels
(on a CPU only under ``TRITON_INTERPRET=1``, which the tests use).

``seed`` is a 0-dim int64 tensor (not a Python int, so compiled code does not specialise on its value): the noise is a
function of (seed, element index) on each path, and the backward draws it again instead of storing it. The reference
path seeds a torch.Generator with it, the kernels use Philox: the two paths draw different (equally distributed)
noise for one seed.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

BACKENDS = ("auto", "reference", "triton")
_backend = os.environ.get("GRT_FUSED_OPS", "auto")


def set_backend(name: str) -> None:
    """'auto' (Triton on CUDA when it imports, else the reference), 'reference', or 'triton'."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"fused-op backend {name!r}: choose one of {list(BACKENDS)}")
    _backend = name


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: Tensor) -> bool:
    if _backend == "reference":
        return False
    if _backend == "triton":
        if not _triton_available():
            raise RuntimeError("train.fused_ops=triton but triton does not import; install triton or use 'auto'")
        return True
    return t.is_cuda and _triton_available()


@torch.compiler.disable  # traced, the draw would be inductor's randint: a C++ CPU kernel, needing a host compiler
def new_seed() -> Tensor:
    """A seed for one op call, drawn from torch's global generator (so a manual_seed makes runs repeatable). Draw it
    in eager code and pass it into compiled code; called inside a compiled function it runs eagerly, at the cost
    of a graph break."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device="cpu")  # whatever torch.device() is in force


def _noise(shape, seed: Tensor, device, sigma: float, dtype: torch.dtype) -> Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return sigma * torch.randn(shape, generator=gen, device=device, dtype=dtype)


def _math_dtype(t: Tensor) -> torch.dtype:
    """float32 for float32/bf16/fp16 inputs (as the kernels), float64 kept for float64."""
    return torch.promote_types(t.dtype, torch.float32)


# ------------------------------------------------------------------------------------------------ gate update
def gated_update(z: Tensor, h: Tensor, o: Tensor, tau: float = 1.0) -> tuple[Tensor, Tensor]:
    """(h', g) without noise in plain PyTorch, for analysis code that needs g itself (evaluation, diagnostics).
    Training goes through :func:`gate_update`."""
    g = torch.sigmoid(z / tau)
    return o + g * (h - o), g


def gate_reference(z: Tensor, inv_tau: float, sigma: float, seed: Tensor) -> Tensor:
    """g = sigmoid(z * inv_tau + eps_g), in float32 (float64 for float64 z)."""
    dt = _math_dtype(z)
    logit = z.to(dt) * inv_tau
    if sigma > 0:
        logit = logit + _noise(z.shape, seed, z.device, sigma, dt)
    return torch.sigmoid(logit)


def gate_update_reference(z: Tensor, h: Tensor, o: Tensor, inv_tau: float, sigma: float, seed: Tensor) -> Tensor:
    g = gate_reference(z, inv_tau, sigma, seed)
    o32 = o.to(g.dtype)
    return (o32 + g * (h.to(g.dtype) - o32)).to(h.dtype)


@torch.library.custom_op("grt::gate_update", mutates_args=())
def gate_update(z: Tensor, h: Tensor, o: Tensor, inv_tau: float, sigma: float, seed: Tensor) -> Tensor:
    if use_triton(z):
        from ops import gate_triton

        return gate_triton.gate_forward(z.contiguous(), h.contiguous(), o.contiguous(), 1.0 / inv_tau, sigma,
                                        int(seed))
    return gate_update_reference(z, h, o, inv_tau, sigma, seed)


@gate_update.register_fake
def _(z, h, o, inv_tau, sigma, seed):
    return torch.empty_like(h)


@torch.library.custom_op("grt::gate_update_backward", mutates_args=())
def gate_update_backward(dy: Tensor, z: Tensor, h: Tensor, o: Tensor, inv_tau: float, sigma: float,
                         seed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if use_triton(z):
        from ops import gate_triton

        return gate_triton.gate_backward(dy, z.contiguous(), h.contiguous(), o.contiguous(), 1.0 / inv_tau, sigma,
                                         int(seed))
    g = gate_reference(z, inv_tau, sigma, seed)
    dy32 = dy.to(g.dtype)
    dz = dy32 * (h.to(g.dtype) - o.to(g.dtype)) * g * (1 - g) * inv_tau
    return dz.to(z.dtype), (g * dy32).to(h.dtype), ((1 - g) * dy32).to(o.dtype)


@gate_update_backward.register_fake
def _(dy, z, h, o, inv_tau, sigma, seed):
    return torch.empty_like(z), torch.empty_like(h), torch.empty_like(o)


def _gate_setup(ctx, inputs, output):
    z, h, o, inv_tau, sigma, seed = inputs
    ctx.save_for_backward(z, h, o, seed)
    ctx.inv_tau, ctx.sigma = inv_tau, sigma


def _gate_backward(ctx, dy):
    z, h, o, seed = ctx.saved_tensors
    dz, dh, do = gate_update_backward(dy, z, h, o, ctx.inv_tau, ctx.sigma, seed)
    return dz, dh, do, None, None, None


gate_update.register_autograd(_gate_backward, setup_context=_gate_setup)


# ------------------------------------------------------------------------------------------------ state noise
@torch.library.custom_op("grt::state_noise", mutates_args=())
def state_noise(h: Tensor, sigma: float, seed: Tensor) -> Tensor:
    if use_triton(h):
        from ops import gate_triton

        return gate_triton.add_noise(h.contiguous(), sigma, int(seed))
    dt = _math_dtype(h)
    return (h.to(dt) + _noise(h.shape, seed, h.device, sigma, dt)).to(h.dtype)


@state_noise.register_fake
def _(h, sigma, seed):
    return torch.empty_like(h)


def _noise_backward(ctx, dy):
    return dy, None, None  # d(h + eps)/dh = 1


state_noise.register_autograd(_noise_backward)
