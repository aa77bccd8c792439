"""CUDA checks: the Triton gate kernels on a real GPU against the reference (float32 and bfloat16), and compiled +
fused training against eager. Skipped without CUDA. Importable without pytest, so that `make gpu-check`
(bench/gpu_check.py) runs them on a GPU image that has torch and triton only."""
import copy

import torch

from ops import gate as gate_ops

try:
    import pytest

    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
except ImportError:  # bench/gpu_check.py calls the functions directly
    pass


def _fwd_bwd(backend, z, h, o, dy, sigma, seed):
    gate_ops.set_backend(backend)
    try:
        zz, hh, oo = (t.detach().clone().requires_grad_() for t in (z, h, o))
        y = gate_ops.gate_update(zz, hh, oo, 1 / 0.7, sigma, seed)
        y.backward(dy)
        return y.detach(), zz.grad, hh.grad, oo.grad
    finally:
        gate_ops.set_backend("auto")


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
    n = 1 << 22
    z, h, o = torch.zeros(n, device="cuda"), torch.ones(n, device="cuda"), torch.zeros(n, device="cuda")
    g = gate_ops.gate_update(z, h, o, 1.0, 0.5, torch.tensor(9))
    eps = torch.logit(g.double())
    assert abs(eps.mean().item()) < 2e-3 and abs(eps.std().item() - 0.5) < 5e-3
    again = gate_ops.gate_update(z, h, o, 1.0, 0.5, torch.tensor(9))
    assert torch.equal(g, again)


def test_cuda_compiled_fused_training_matches_eager():
    from pipeline.config import GRTConfig
    from pipeline.model import build_model
    from pipeline.train.parallelize import apply_compile

    torch.manual_seed(0)
    cfg = GRTConfig(vocab_size=1024, block_size=128, d_model=256, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=4, sigma_x=0.0, sigma_g=0.0)
    eager = build_model(cfg).cuda().train()
    fast = copy.deepcopy(eager)
    apply_compile(fast)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, fast)]
    idx = torch.randint(0, 1024, (8, 128), device="cuda")
    targets = torch.roll(idx, -1, 1)
    for step in range(10):
        losses = []
        for m, opt, backend in ((eager, opts[0], "reference"), (fast, opts[1], "auto")):
            gate_ops.set_backend(backend)
            _, loss = m(idx, targets, n_steps=1 + step % 4)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        gate_ops.set_backend("auto")
        assert abs(losses[0] - losses[1]) < 1e-3 * max(1.0, abs(losses[0])), (step, losses)
