"""The per-token fused head + cross-entropy (``reduction="none"``) against F.cross_entropy on full logits."""
import pytest
import torch
import torch.nn.functional as F

from ops import linear_cross_entropy


def reference(h, w, t):
    return F.cross_entropy(h @ w.T, t, ignore_index=-1, reduction="none")


def _inputs(rows=74, d=16, V=101):
    torch.manual_seed(0)
    h = torch.randn(rows, d, dtype=torch.double, requires_grad=True)
    w = torch.randn(V, d, dtype=torch.double, requires_grad=True)
    t = torch.randint(0, V, (rows,))
    t[:5] = -1
    t[40] = -1
    upstream = torch.randn(rows, dtype=torch.double)  # arbitrary per-token weights, negative ones included
    return h, w, t, upstream


@pytest.mark.parametrize("chunk", [1, 7, 64, None])  # 74 rows: chunks with a partial tail, and one chunk for all
def test_per_token_values_and_gradients_equal_the_reference(chunk):
    h, w, t, g = _inputs()
    losses = linear_cross_entropy(h, w, t, chunk=chunk, reduction="none")
    gh, gw = torch.autograd.grad((losses * g).sum(), (h, w))
    ref = reference(h, w, t)
    rh, rw = torch.autograd.grad((ref * g).sum(), (h, w))
    assert losses.shape == t.shape and losses.dtype == torch.double
    torch.testing.assert_close(losses, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)


def test_ignored_tokens_have_zero_loss_and_zero_gradient():
    h, w, t, g = _inputs()
    losses = linear_cross_entropy(h, w, t, chunk=7, reduction="none")
    (gh,) = torch.autograd.grad((losses * g).sum(), (h,))
    ignored = t == -1
    assert torch.all(losses[ignored] == 0) and torch.all(losses[~ignored] > 0)
    assert torch.all(gh[ignored] == 0) and torch.all(gh[~ignored].abs().sum(-1) > 0)
    everything_ignored = linear_cross_entropy(h, w, torch.full_like(t, -1), reduction="none")
    (gw,) = torch.autograd.grad(everything_ignored.sum(), (w,))
    assert torch.all(everything_ignored == 0) and torch.all(gw == 0)


def test_batched_shape_gradient_of_h_only_and_no_grad_path():
    h, w, t, g = _inputs(rows=2 * 37)
    hb, tb, gb = h.detach().view(2, 37, 16).requires_grad_(), t.view(2, 37), g.view(2, 37)
    wd = w.detach()  # the weight needs no gradient: only dh comes back
    losses = linear_cross_entropy(hb, wd, tb, chunk=5, reduction="none")
    (gh,) = torch.autograd.grad((losses * gb).sum(), (hb,))
    ref_h = hb.detach().clone().requires_grad_()
    ref = reference(ref_h.view(-1, 16), wd, t).view(2, 37)
    (rh,) = torch.autograd.grad((ref * gb).sum(), (ref_h,))
    assert losses.shape == (2, 37)
    torch.testing.assert_close(losses, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hb, wd, tb, chunk=3, reduction="none"), ref.detach(),
                                   rtol=1e-12, atol=1e-12)


def test_per_token_mean_equals_the_mean_path():
    h, w, t, _ = _inputs()
    per_token = linear_cross_entropy(h, w, t, chunk=9, reduction="none")
    mean = linear_cross_entropy(h, w, t, chunk=9)
    torch.testing.assert_close(per_token.sum() / (t != -1).sum(), mean, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, t, reduction="sum")


def test_per_token_under_bf16_autocast_runs_and_is_close():
    torch.manual_seed(0)
    h = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(300, 32, requires_grad=True)
    t = torch.randint(0, 300, (64,))
    t[3] = -1
    g = torch.rand(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = linear_cross_entropy(h, w, t, chunk=16, reduction="none")
    (losses * g).sum().backward()
    assert losses.dtype == torch.float32 and h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert losses[3].item() == 0.0 and torch.all(h.grad[3] == 0)
    hr, wr = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = reference(hr, wr, t)
    (ref * g).sum().backward()
    torch.testing.assert_close(losses, ref.detach(), rtol=0.02, atol=0.1)
    cos = F.cosine_similarity(h.grad.flatten(), hr.grad.flatten(), dim=0)
    assert cos > 0.99 and F.cosine_similarity(w.grad.flatten(), wr.grad.flatten(), dim=0) > 0.99
