"""Fused ops against the plain PyTorch formulation."""
import pytest
import torch
import torch.nn.functional as F

from ops import gated_update
from ops import linear_cross_entropy


def reference(h, w, t):
    return F.cross_entropy(h @ w.T, t, ignore_index=-1)


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_linear_cross_entropy_matches_reference_loss_and_grads(chunk):
    torch.manual_seed(0)
    h = torch.randn(2, 37, 16, dtype=torch.double, requires_grad=True)  # 74 rows: chunks end in a partial tail
    w = torch.randn(101, 16, dtype=torch.double, requires_grad=True)
    t = torch.randint(0, 101, (2, 37))
    t[0, :5] = -1  # ignored positions
    loss = linear_cross_entropy(h, w, t, chunk=chunk)
    (gh, gw) = torch.autograd.grad(3.0 * loss, (h, w))
    ref = reference(h.reshape(-1, 16), w, t.reshape(-1))
    (rh, rw) = torch.autograd.grad(3.0 * ref, (h, w))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-9, atol=1e-12)


def test_linear_cross_entropy_without_grad_and_all_ignored():
    torch.manual_seed(0)
    h, w, t = torch.randn(10, 8), torch.randn(50, 8), torch.randint(0, 50, (10,))
    with torch.no_grad():
        assert linear_cross_entropy(h, w, t, chunk=3).item() == pytest.approx(reference(h, w, t).item(), rel=1e-5)
    assert linear_cross_entropy(h, w, torch.full((10,), -1)).item() == 0.0


def test_linear_cross_entropy_under_bf16_autocast_is_close():
    torch.manual_seed(0)
    h = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(300, 32, requires_grad=True)
    t = torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, t, chunk=16)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    ref = reference(h.detach(), w.detach(), t)
    assert loss.item() == pytest.approx(ref.item(), rel=0.02)


def test_gated_update_reference_equation():
    torch.manual_seed(0)
    z, h, o = torch.randn(3, 4, 5), torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    out, g = gated_update(z, h, o, tau=0.5)
    g_want = 1 / (1 + torch.exp(-z / 0.5))
    torch.testing.assert_close(g, g_want)
    torch.testing.assert_close(out, g_want * h + (1 - g_want) * o)
