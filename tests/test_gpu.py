"""CUDA checks: the Triton gate kernels on a real GPU against the reference (float32, bfloat16 and the mixed dtypes
autocast hands them), their noise (state noise and gate noise, forward and backward) against the formula with the
same draws, kernel builds per seed, and compiled + fused training against eager. Skipped without CUDA. Importable
without pytest, so that `make gpu-check` (bench/gpu_check.py) runs them on a GPU image that has torch and triton only.

The ``check_*`` functions take the device and the sizes: tests/test_fast_step.py runs them on tiny shapes under
Triton's interpreter on a CPU, so the normal suite exercises the same checks."""
import copy
import math

import torch

from ops import gate as gate_ops

try:
    import pytest

    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
except ImportError:  # bench/gpu_check.py calls the functions directly
    pass

try:
    import triton
    import triton.language as tl
except ImportError:  # the checks below need triton; pytest reports their import error where they run
    triton = None

if triton is not None:
    @triton.jit
    def _normal_kernel(y_ptr, n, seed, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.randn(seed, offs), mask=offs < n)


def philox_normal(seed: int, shape, device) -> torch.Tensor:
    """N(0, 1) at (seed, flat element index), as ``tl.randn`` draws it, in float64: the noise the kernels say they
    add. A kernel of its own (another block size), so a kernel that read other indices or seeds would not match."""
    n = torch.Size(shape).numel()
    y = torch.empty(n, device=device)
    if n:
        _normal_kernel[(triton.cdiv(n, 512),)](y, n, seed, BLOCK=512)
    return y.view(shape).double()


def _fwd_bwd(backend, z, h, o, dy, sigma, seed, inv_tau=1 / 0.7):
    gate_ops.set_backend(backend)
    try:
        zz, hh, oo = (t.detach().clone().requires_grad_() for t in (z, h, o))
        y = gate_ops.gate_update(zz, hh, oo, inv_tau, sigma, seed)
        y.backward(dy)
        return y.detach(), zz.grad, hh.grad, oo.grad
    finally:
        gate_ops.set_backend("auto")


def gate_by_hand(z, h, o, dy, inv_tau, eps_g):
    """(y, dz, dh, do) of y = o + g (h - o), g = sigmoid(z inv_tau + eps_g), in float64."""
    z, h, o, dy = (t.double() for t in (z, h, o, dy))
    g = torch.sigmoid(z * inv_tau + eps_g)
    return o + g * (h - o), dy * (h - o) * g * (1 - g) * inv_tau, g * dy, (1 - g) * dy


def _tol(t):
    return dict(rtol=2e-2, atol=2e-2) if t.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


def ks_statistic_normal(x: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance sup |F_n - Phi| of the sample ``x`` to N(0, 1), by hand (no scipy on the GPU
    image): Phi(x) = (1 + erf(x / sqrt 2)) / 2 against the empirical CDF on each side of every jump."""
    x = x.flatten().double().sort().values
    n = x.numel()
    phi = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    i = torch.arange(1, n + 1, device=x.device, dtype=torch.float64)
    return max((i / n - phi).max().item(), (phi - (i - 1) / n).max().item())


def assert_iid_standard_normal(e: torch.Tensor, block: int, what: str = "noise") -> None:
    """``e`` (draws that should be iid N(0, 1), in element-index order) looks it, block by block: a kernel whose
    program drew from offsets or a seed not tied to its block would repeat one block's draws in every block.
    ``block``: the kernel's BLOCK (one program's elements). Bounds: 5 standard errors (draws at a fixed seed, so a
    pass or a failure is deterministic): the mean 1/sqrt(n), the variance sqrt(2/n), a mean product of two
    independent N(0, 1) 1/sqrt(m) (lag 1 and the same position in neighbouring blocks); the Kolmogorov-Smirnov
    distance under its 1% critical value 1.63/sqrt(n)."""
    e = e.flatten().double()
    n = e.numel()
    nb = n // block
    assert nb >= 4, f"{what}: {n} draws span {nb} full blocks of {block}; the checks need several"
    blocks = e[: nb * block].view(nb, block)
    distinct = torch.unique(blocks, dim=0).shape[0]
    assert distinct == nb, f"{what}: only {distinct} distinct blocks of {block} draws among {nb}"
    cross = (blocks[1:] * blocks[:-1]).mean().item()  # element i of block b against element i of block b + 1
    assert abs(cross) < 5 / ((nb - 1) * block) ** 0.5, f"{what}: correlation across neighbouring blocks {cross:.4f}"
    lag1 = (e[1:] * e[:-1]).mean().item()
    assert abs(lag1) < 5 / (n - 1) ** 0.5, f"{what}: lag-1 correlation {lag1:.4f}"
    # every lag up to n/2 at once (FFT): a repeat at any period (half a block, an odd stride) shows as one lag whose
    # mean product is far beyond its standard error 1/sqrt(n - k); 6.5 s.e. is about 1e-4 of a false alarm over n/2
    # lags (~5 s.e. is the largest expected of 2M clean lags)
    acf = torch.fft.irfft(torch.fft.rfft(e, 2 * n).abs() ** 2, 2 * n)[1: n // 2 + 1]
    z = acf / torch.arange(n - 1, n - n // 2 - 1, -1, device=e.device, dtype=e.dtype).sqrt()
    k = int(z.abs().argmax())
    assert z[k].abs().item() < 6.5, f"{what}: correlation at lag {k + 1}: {z[k].item():.1f} standard errors"
    mean, var = e.mean().item(), e.var().item()
    assert abs(mean) < 5 / n ** 0.5 and abs(var - 1) < 5 * (2 / n) ** 0.5, (what, mean, var)
    ks = ks_statistic_normal(e)
    assert ks < 1.63 / n ** 0.5, f"{what}: Kolmogorov-Smirnov distance to N(0, 1) {ks:.5f} >= {1.63 / n ** 0.5:.5f}"


def grads_of(model: torch.nn.Module) -> dict:
    """{parameter name: its gradient (None where it has none)}."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_grads_close(got: dict, want: dict, rel: float, msg: str = "") -> None:
    """Every gradient in ``got`` (``grads_of``) within ``rel`` of ``want``'s, relative to its norm:
    ||g - g_want|| / ||g_want|| <= rel (where ``want``'s is zero, ``got``'s must be too). The same parameter names,
    each with a gradient on both sides or on neither."""
    assert got.keys() == want.keys(), msg
    bad = []
    for name, ref in want.items():
        g = got[name]
        assert (g is None) == (ref is None), f"{msg} {name}: a gradient on one side only"
        if ref is None:
            continue
        err = (g.double() - ref.double()).norm().item()
        scale = ref.double().norm().item()
        if err > rel * scale or (scale == 0 and err > 0):
            bad.append(f"{name}: {err / scale if scale else err:.2e}")
    assert not bad, f"{msg} gradients off by more than {rel:.0e} of their norm: {bad}"


def check_compiled_training_matches_eager(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                                          depths, backend="inductor", fused: str = "auto", loss_rel: float = 1e-5,
                                          grad_rel: float = 1e-5) -> torch.nn.Module:
    """``model`` (trained eagerly with the reference ops, AdamW) against a copy compiled by ``apply_compile`` (the
    fused ops on ``fused``): at each training step, at depth r from ``depths``, both start from the same weights (the
    copy takes the eager model's after every optimizer step) and their loss (within ``loss_rel``) and every
    gradient (within ``grad_rel`` of its norm) agree. Both sides run in float32, so they differ only by rounding
    (fused kernels, reductions regrouped, a Triton sigmoid): this test's GPU shapes under inductor on a CPU (batch
    2) give losses within 1e-7 and gradients within 1e-6 of their norm (worst: the gate's LayerNorms, 9.5e-7), so
    the defaults leave a factor of 10 or more (calibrated on a CPU: not yet run on a GPU; a GPU failure message
    lists each parameter's error, to tell rounding from a bug). The weights are synced because independent trajectories
    drift apart with
    no bug at all: AdamW's first updates are ~lr * sign(g), and a near-zero gradient element whose sign rounding
    flips moves its weight by 2 lr. Returns the compiled copy."""
    from pipeline.train.parallelize import apply_compile

    fast = copy.deepcopy(model)
    apply_compile(fast, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, r in enumerate(depths):
        losses = []
        for m, ops_backend in ((model, "reference"), (fast, fused)):
            gate_ops.set_backend(ops_backend)  # the backward runs the op's backward on the same path
            try:
                _, loss = m(idx, targets, n_steps=r)
                loss.backward()
            finally:
                gate_ops.set_backend("auto")
            losses.append(loss.item())
        want, got = losses
        assert abs(got - want) <= loss_rel * abs(want), (step, r, got, want)
        assert_grads_close(grads_of(fast), grads_of(model), grad_rel, f"step {step} r={r}:")
        opt.step()
        model.zero_grad(set_to_none=True)
        fast.zero_grad(set_to_none=True)
        with torch.no_grad():
            for (name, p), (name_f, q) in zip(model.named_parameters(), fast.named_parameters()):
                assert name == name_f
                q.copy_(p)
    return fast


# ------------------------------------------------------------------------------------------------ the checks
def check_state_noise_kernel(device, n: int, seed: int = 12345, sigma: float = 0.3) -> None:
    """grt::state_noise on the kernel: x = h + sigma * eps with eps the Philox draws at (seed, index), float32 and
    bfloat16 out; eps ~ N(0, 1) by its moments and two-sided tails; d x / d h = identity."""
    torch.manual_seed(0)
    eps = philox_normal(seed, (n,), device)
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(n, device=device).to(dtype).requires_grad_()
        gate_ops.set_backend("triton")
        try:
            x = gate_ops.state_noise(h, sigma, torch.tensor(seed))
            dy = torch.randn_like(x)
            x.backward(dy)
        finally:
            gate_ops.set_backend("auto")
        assert x.dtype == dtype and h.grad.dtype == dtype
        want = h.detach().double() + sigma * eps
        torch.testing.assert_close(x.double(), want, **_tol(x))
        assert torch.equal(h.grad, dy)
    # the draws themselves: N(0, 1) (standard errors at n: mean 1/sqrt(n), variance sqrt(2/n), tail p(1-p)/n)
    e = eps.flatten()
    k = 6.0 / n ** 0.5
    assert abs(e.mean().item()) < k and abs(e.var().item() - 1) < k * 1.5, (e.mean().item(), e.var().item())
    for t, p in ((1.0, 0.317311), (2.0, 0.045500)):  # P(|N(0,1)| > t)
        frac = (e.abs() > t).double().mean().item()
        assert abs(frac - p) < 6 * (p * (1 - p) / n) ** 0.5, (t, frac)
    # neighbouring indices and neighbouring seeds are uncorrelated
    assert abs((e[1:] * e[:-1]).mean().item()) < k
    assert abs((philox_normal(seed + 1, (n,), device).flatten() * e).mean().item()) < k


def check_gate_noise_forward_backward(device, shapes, sigma: float = 0.8, seed: int = 77,
                                      dtypes=((torch.float32,) * 3, (torch.bfloat16,) * 3,
                                              (torch.bfloat16, torch.float32, torch.bfloat16))) -> None:
    """grt::gate_update on the kernel with noise on, forward and backward, for each (z, h, o) dtype triple (the
    last is autocast's: z and o bf16 from Linear and the blocks, h float32): equal to the formula by hand with the
    Philox draws at (seed, index), each output in its own input's dtype. The backward is right only if it redraws
    the forward's noise."""
    inv_tau = 1 / 0.7
    for shape in shapes:
        eps = sigma * philox_normal(seed, shape, device)
        for zt, ht, ot in dtypes:
            torch.manual_seed(1)
            z, h, o, dy = (torch.randn(shape, device=device) for _ in range(4))
            z, h, o, dy = z.to(zt), h.to(ht), o.to(ot), dy.to(ht)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):  # as in training
                got = _fwd_bwd("triton", z, h, o, dy, sigma, torch.tensor(seed), inv_tau)
            want = gate_by_hand(z, h, o, dy, inv_tau, eps)
            for name, a, b, dt in zip(("y", "dz", "dh", "do"), got, want, (ht, zt, ht, ot)):
                assert a.dtype == dt and a.shape == torch.Size(shape), (name, a.dtype, dt)
                torch.testing.assert_close(a.double(), b, **_tol(a), msg=f"{name} {shape} {(zt, ht, ot)}")
    # the reference path takes the same mixed dtypes (its own noise: torch's generator seeded with the seed)
    shape = shapes[0]
    z, h, o, dy = (torch.randn(shape, device=device) for _ in range(4))
    z, o = z.bfloat16(), o.bfloat16()
    gen = torch.Generator(device=device).manual_seed(seed)
    eps_ref = sigma * torch.randn(shape, generator=gen, device=device, dtype=torch.float32).double()
    got = _fwd_bwd("reference", z, h, o, dy, sigma, torch.tensor(seed), inv_tau)
    for a, b, dt in zip(got, gate_by_hand(z, h, o, dy, inv_tau, eps_ref), (h.dtype, z.dtype, h.dtype, o.dtype)):
        assert a.dtype == dt
        torch.testing.assert_close(a.double(), b, **_tol(a))


def kernel_builds(fn, seeds) -> list[str]:
    """The kernels Triton builds while ``fn(seed)`` runs for each seed, after one warm-up call (CUDA only: the
    interpreter builds nothing)."""
    from triton import knobs

    fn(int(seeds[0]))
    torch.cuda.synchronize()
    built = []
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: built.append(k.get("repr"))
    try:
        for s in seeds:
            fn(int(s))
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = old
    return built


# Seeds Triton would specialise on without do_not_specialize: == 1 (a constant), % 16 == 0 (aligned), any other
SEED_CLASSES = (5, 1, 16, 32, 7, 2**31 - 2)


# ------------------------------------------------------------------------------------------------- CUDA tests
def test_cuda_kernels_match_reference():
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((8, 1024, 1024), (3, 37, 11), (1025,)):
            torch.manual_seed(0)
            z, h, o, dy = (torch.randn(shape, device="cuda").to(dtype) for _ in range(4))
            seed = torch.tensor(3)
            got = _fwd_bwd("triton", z, h, o, dy, 0.0, seed)
            want = _fwd_bwd("reference", z, h, o, dy, 0.0, seed)
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            for a, b in zip(got, want):
                assert a.dtype == dtype
                torch.testing.assert_close(a.float(), b.float(), **tol)


def test_cuda_noise_moments_and_replay():
    """The kernels' own noise (not a reference's): z = 0, h = 1, o = 0 makes the gate update g = sigmoid(eps_g)
    itself, and state noise on zeros is eps_x itself; both iid N(0, sigma^2) block by block, a function of (seed,
    index) (replayed exactly), another seed uncorrelated."""
    from ops import gate_triton

    n = 1 << 22
    z, h, o = torch.zeros(n, device="cuda"), torch.ones(n, device="cuda"), torch.zeros(n, device="cuda")
    g = gate_ops.gate_update(z, h, o, 1.0, 0.5, torch.tensor(9))
    assert_iid_standard_normal(torch.logit(g.double()) / 0.5, gate_triton.BLOCK, "gate noise")
    again = gate_ops.gate_update(z, h, o, 1.0, 0.5, torch.tensor(9))
    assert torch.equal(g, again)
    x = gate_ops.state_noise(z, 0.1, torch.tensor(3)).double() / 0.1
    assert_iid_standard_normal(x, gate_triton.BLOCK, "state noise")
    other = gate_ops.state_noise(z, 0.1, torch.tensor(4)).double() / 0.1
    assert abs((x * other).mean().item()) < 5 / n ** 0.5  # another seed: other draws


def test_cuda_state_noise_kernel():
    check_state_noise_kernel("cuda", 1 << 22)


def test_cuda_gate_noise_forward_backward_and_mixed_dtypes():
    check_gate_noise_forward_backward("cuda", [(8, 512, 1024), (3, 37, 11), (1025,)])


def test_cuda_a_new_seed_builds_no_kernel():
    from ops import gate_triton

    z, h, o = (torch.randn(4096, device="cuda") for _ in range(3))
    runs = {"gate forward": lambda s: gate_triton.gate_forward(z, h, o, 0.7, 0.1, s),
            "gate backward": lambda s: gate_triton.gate_backward(z, z, h, o, 0.7, 0.1, s),
            "state noise": lambda s: gate_triton.add_noise(h, 0.1, s)}
    builds = {name: kernel_builds(fn, SEED_CLASSES) for name, fn in runs.items()}
    assert not any(builds.values()), f"kernels built per new seed: {builds}"


def test_cuda_compiled_fused_training_matches_eager():
    """Compiled (inductor) + the Triton gate kernels against eager + the reference ops, float32, 10 training steps
    at depths 1..4: each step's loss to 1e-5 and every gradient to 1e-5 of its norm, from the same weights (see
    check_compiled_training_matches_eager)."""
    from pipeline.model import build_model
    from pipeline.model.configs import GRTConfig

    torch.manual_seed(0)
    cfg = GRTConfig(vocab_size=1024, block_size=128, d_model=256, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=4, sigma_x=0.0, sigma_g=0.0)
    eager = build_model(cfg).cuda().train()
    idx = torch.randint(0, 1024, (8, 128), device="cuda")
    check_compiled_training_matches_eager(eager, idx, torch.roll(idx, -1, 1), [1 + step % 4 for step in range(10)])


def test_cuda_compiled_noisy_step_has_no_cpu_kernel_and_matches_eager():
    """Noise on (sigma_x, sigma_g > 0), the Triton kernels in both: the compiled step takes the seeds the eager
    loop draws, so it adds exactly eager's noise; and inductor generates no CPU (C++) kernel for it, which would
    need a host compiler."""
    from torch._inductor.utils import run_and_get_code

    from pipeline.model import build_model
    from pipeline.model.configs import GRTConfig
    from pipeline.train.parallelize import apply_compile

    torch.manual_seed(0)
    # the shapes of the test above, so that Triton's cache holds most of the kernels inductor generates here
    cfg = GRTConfig(vocab_size=1024, block_size=128, d_model=256, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=4, sigma_x=0.1, sigma_g=0.1)
    eager = build_model(cfg).cuda().train()
    fast = copy.deepcopy(eager)
    apply_compile(fast)
    idx = torch.randint(0, 1024, (8, 128), device="cuda")
    targets = torch.roll(idx, -1, 1)

    def train(m):
        out = []
        for r in (1, 2, 3):
            torch.manual_seed(100 + r)  # the same seeds for both models
            _, loss = m(idx, targets, n_steps=r)
            loss.backward()
            out.append((loss.item(), grads_of(m)))
            m.zero_grad(set_to_none=True)
        return out

    got, code = run_and_get_code(train, fast)
    assert code and any("triton" in c for c in code), "no generated code captured"
    cpu = [c for c in code if "cpp_fused" in c or "randint" in c]
    assert not cpu, "inductor generated a CPU kernel (or a seed draw) in the compiled model:\n" + cpu[0][:3000]
    # the same weights, the same kernels and seeds on both sides (float32): only the rounding of inductor's fusions
    # differs, as in check_compiled_training_matches_eager
    for r, ((loss, grads), (want, want_grads)) in enumerate(zip(got, train(eager)), 1):
        assert abs(loss - want) <= 1e-5 * abs(want), (r, loss, want)
        assert_grads_close(grads, want_grads, 1e-5, f"r={r}:")
