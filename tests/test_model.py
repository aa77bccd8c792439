"""The models against hand-written computations of the paper's equations (plain tensor ops, no model code)."""
import math

import pytest
import torch

from pipeline.eval.exit_losses import exit_curve
from pipeline.model import build_model
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import GRTConfig


# ------------------------------------------------------------------------------ an independent, by-hand reference
def ln(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def linear(x, layer):
    y = x @ layer.weight.T
    return y + layer.bias if layer.bias is not None else y


def block(blk, x):
    B, T, C = x.shape
    nh = blk.attn.n_head
    q, k, v = linear(ln(x, blk.ln_1.weight, blk.ln_1.bias), blk.attn.c_attn).split(C, dim=2)
    q, k, v = (t.reshape(B, T, nh, C // nh).permute(0, 2, 1, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(C // nh)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    y = (torch.exp(scores - scores.amax(-1, keepdim=True)) / torch.exp(scores - scores.amax(-1, keepdim=True))
         .sum(-1, keepdim=True)) @ v
    x = x + linear(y.permute(0, 2, 1, 3).reshape(B, T, C), blk.attn.c_proj)
    hid = linear(ln(x, blk.ln_2.weight, blk.ln_2.bias), blk.mlp.c_fc)
    hid = 0.5 * hid * (1 + torch.erf(hid / math.sqrt(2)))  # exact GELU
    return x + linear(hid, blk.mlp.c_proj)


def grt_step(m, h, h_pre, eps_x, eps_g):
    """h~ = W_proj([h + eps_x, h_pre]); o = core(h~); g = sigmoid(f_g([LN h, LN h_pre]) / tau + eps_g);
    h' = g h + (1 - g) o."""
    rs, cfg = m.recur, m.cfg
    x = (h + eps_x) if cfg.state_noise == "every_step" else h
    h_tilde = linear(torch.cat([x, h_pre], -1), rs.proj) if cfg.reinject else x
    o = h_tilde
    for b in rs.blocks:
        o = block(b, o)
    if cfg.gate == "none":
        return o, None
    gt = rs.gate
    u = torch.cat([ln(h, gt.ln_h.weight, gt.ln_h.bias), ln(h_pre, gt.ln_pre.weight, gt.ln_pre.bias)], -1)
    a = linear(u, gt.fc1)
    z = linear(a * (1 / (1 + torch.exp(-a))), gt.fc2)
    g = 1 / (1 + torch.exp(-(z / cfg.tau + eps_g)))
    return g * h + (1 - g) * o, g


def embed(m, idx):
    return m.embed.wte.weight[idx] + m.embed.wpe.weight[torch.arange(idx.shape[1])]


def head_loss(m, h, targets):
    for b in getattr(m, "coda", []):
        h = block(b, h)
    logits = ln(h, m.ln_f.weight, m.ln_f.bias) @ m.embed.wte.weight.T  # tied head
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    return logits, -logp.gather(-1, targets.unsqueeze(-1)).mean()


# ---------------------------------------------------------------------------------------------------------- tests
def small_grt(**kw):
    torch.manual_seed(0)
    cfg = GRTConfig(vocab_size=97, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=3, **kw)
    m = build_model(cfg).double()
    with torch.no_grad():  # move the gate off saturation so that both branches of the update matter
        m.recur.gate.fc2.bias.normal_(0.0, 1.0) if m.recur.gate is not None else None
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_step_matches_hand_written_equations_noise_off(tau):
    m = small_grt(tau=tau).eval()
    h, h_pre = torch.randn(2, 16, 32, dtype=torch.double), torch.randn(2, 16, 32, dtype=torch.double)
    got, g, _ = m.recur(h, h_pre, noise=False, need_gate=True)
    fast, none, _ = m.recur(h, h_pre, noise=False)  # the training path: the fused op, anchor halves computed once
    assert none is None
    want, g_want = grt_step(m, h, h_pre, 0.0, 0.0)
    torch.testing.assert_close(fast, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g, g_want, rtol=1e-10, atol=1e-10)
    assert 0.05 < g.mean() < 0.95  # both branches really contribute in this test


def test_step_noise_enters_where_the_equations_put_it():
    m = small_grt().train()
    h, h_pre = torch.randn(2, 16, 32, dtype=torch.double), torch.randn(2, 16, 32, dtype=torch.double)
    torch.manual_seed(123)
    got, _, _ = m.recur(h, h_pre, noise=True)
    torch.manual_seed(123)  # the step draws a seed for eps_x, then one for eps_g, from the global RNG
    seeds = [int(torch.randint(0, 2**31 - 1, ())) for _ in range(2)]
    eps_x, eps_g = (0.1 * torch.randn(h.shape, generator=torch.Generator().manual_seed(s), dtype=h.dtype)
                    for s in seeds)
    want, _ = grt_step(m, h, h_pre, eps_x, eps_g)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    clean, _ = grt_step(m, h, h_pre, 0.0, 0.0)
    assert (got - clean).abs().max() > 1e-3  # and the noise changes the result


@pytest.mark.parametrize("ablation", [{}, {"gate": "none"}, {"reinject": False}, {"reinject": False, "gate": "none"}])
def test_full_forward_matches_hand_written_model(ablation):
    m = small_grt(**ablation).eval()
    idx = torch.randint(0, 97, (2, 16))
    targets = torch.randint(0, 97, (2, 16))
    h_pre = embed(m, idx)
    for b in m.prelude:
        h_pre = block(b, h_pre)
    h = h_pre  # h^(0) = h_pre (Algorithm 1)
    for _ in range(5):  # also beyond the trained R = 3
        h, _ = grt_step(m, h, h_pre, 0.0, 0.0)
    want_logits, want_loss = head_loss(m, h, targets)
    logits, _ = m(idx, n_steps=5)
    _, loss = m(idx, targets, n_steps=5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-9)


def test_one_pass_exit_curve_equals_separate_forwards():
    m = small_grt().eval()
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    curve = exit_curve(m, [(idx, targets)], list(range(7)), 6, torch.device("cpu"))  # eval's one pass, fp32 head
    assert curve["exit"] == [0, 1, 2, 3, 4, 5, 6]
    for r, loss in zip(curve["exit"], curve["loss"]):
        # exit_curve's head runs in fp32 (on fp64 states), the forward's in fp64: measured max rel gap 6.3e-9, x10
        assert loss == pytest.approx(m(idx, targets, n_steps=r)[1].item(), rel=1e-7)
    assert curve["gate_mean"][0] is None and len([g for g in curve["gate_mean"] if g is not None]) == 6


def test_gate_starts_near_sigmoid_4():
    torch.manual_seed(0)
    m = build_model(GRTConfig(vocab_size=500, block_size=64, d_model=128, n_head=4, n_prelude=1, n_core=1, n_coda=1,
                              n_recurrence=4)).eval()
    batch = (torch.randint(0, 500, (4, 64)), torch.randint(0, 500, (4, 64)))
    curve = exit_curve(m, [batch], [1, 2, 3, 4], 4, torch.device("cpu"))
    sigma4 = 1 / (1 + math.exp(-4))  # 0.98201
    for g in curve["gate_mean"]:
        assert g == pytest.approx(sigma4, abs=0.003)


def test_noise_only_in_training():
    m = small_grt()
    idx = torch.randint(0, 97, (2, 16))
    m.eval()
    a, b = m(idx)[0], m(idx)[0]
    assert torch.equal(a, b)
    m.train()
    assert not torch.allclose(m(idx)[0], m(idx)[0])


def test_depth_sampling_is_seeded_uniform_and_ignores_global_rng():
    m = build_model(GRTConfig(vocab_size=97, block_size=8, d_model=16, n_head=2, n_recurrence=4, n_prelude=1,
                              n_core=1, n_coda=1))
    draws = []
    for step in range(4000):
        torch.manual_seed(step % 3)  # global RNG state must not matter
        draws.append(m.train_depth(seed=1, step=step))
    assert draws[:50] == [m.train_depth(seed=1, step=s) for s in range(50)]
    assert draws[:50] != [m.train_depth(seed=2, step=s) for s in range(50)]
    counts = [draws.count(r) for r in (1, 2, 3, 4)]
    assert set(draws) == {1, 2, 3, 4}
    chi2 = sum((c - 1000) ** 2 / 1000 for c in counts)
    assert chi2 < 16.27  # p = 0.001 for 3 degrees of freedom


def test_dense_gpt_matches_hand_written_gpt2():
    torch.manual_seed(0)
    m = build_model(GPTConfig(vocab_size=97, block_size=16, d_model=32, n_head=4, n_layer=3)).double().eval()
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    h = embed(m, idx)
    exits = []
    for b in m.blocks:
        h = block(b, h)
        exits.append(head_loss(m, h, targets)[1].item())
    want_logits, want_loss = head_loss(m, h, targets)
    logits, _ = m(idx)
    _, loss = m(idx, targets)
    torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-9)
    with torch.no_grad():
        assert [m(idx, targets, n_steps=k)[1].item() for k in (1, 2, 3)] == pytest.approx(exits, rel=1e-9)
    # exit_curve's head runs in fp32 (on fp64 states), the reference's in fp64: measured max rel gap 9.8e-9, x10
    assert exit_curve(m, [(idx, targets)], [1, 2, 3], 3, torch.device("cpu"))["loss"] == pytest.approx(exits, rel=1e-7)


def test_gpt2_initialisation():
    torch.manual_seed(0)
    L = 12
    m = build_model(GPTConfig(vocab_size=5000, block_size=64, d_model=256, n_head=4, n_layer=L))
    assert m.lm_head.weight is m.embed.wte.weight
    assert m.blocks[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert m.blocks[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * L), rel=0.03)
    assert m.blocks[0].attn.c_attn.bias.abs().max().item() == 0.0
