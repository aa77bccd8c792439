"""The heavy-tail Poisson recurrent-depth model (Huginn) against its equations written out by hand in float64."""
import math

import pytest
import torch
from scipy import integrate
from scipy import stats

from pipeline.eval.exit_losses import exit_curve
from pipeline.model import build_model
from pipeline.model.configs import PoissonConfig
from pipeline.model.layers import KVCache
from pipeline.model.poisson import PoissonDepth
from pipeline.model.registry import count_params
from pipeline.train.parallelize import checkpoint_module


# ------------------------------------------------------------------------------ an independent, by-hand reference
def ln(x, m):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * m.weight + m.bias


def linear(x, layer):
    return x @ layer.weight.T + (layer.bias if layer.bias is not None else 0)


def block(blk, x):
    B, T, C = x.shape
    nh = blk.attn.n_head
    q, k, v = linear(ln(x, blk.ln_1), blk.attn.c_attn).split(C, dim=2)
    q, k, v = (t.reshape(B, T, nh, C // nh).permute(0, 2, 1, 3) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(C // nh)).masked_fill(
        torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    y = torch.softmax(scores, -1) @ v
    x = x + linear(y.permute(0, 2, 1, 3).reshape(B, T, C), blk.attn.c_proj)
    hid = linear(ln(x, blk.ln_2), blk.mlp.c_fc)
    return x + linear(0.5 * hid * (1 + torch.erf(hid / math.sqrt(2))), blk.mlp.c_proj)


def reference_loss(m, idx, targets, p, h0, truncate_after=0):
    """h_pre = prelude(embed); h^(i) = core(A [h^(i-1), h_pre]) for i = 1..p; CE of W_e LN(coda(h^(p))).
    The first ``truncate_after`` steps are cut from the graph (detached)."""
    h_pre = m.embed.wte.weight[idx] + m.embed.wpe.weight[torch.arange(idx.shape[1])]
    for b in m.prelude:
        h_pre = block(b, h_pre)
    h = h0
    for i in range(p):
        h = linear(torch.cat([h, h_pre], -1), m.recur.adapter)
        for b in m.recur.blocks:
            h = block(b, h)
        if i < truncate_after:
            h = h.detach()
    for b in m.coda:
        h = block(b, h)
    logits = ln(h, m.ln_f) @ m.embed.wte.weight.T
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    return logits, -logp.gather(-1, targets.unsqueeze(-1)).mean()


def trunc_normal_state(shape, std):
    """Huginn's initial state: trunc_normal_(std, a=-3 std, b=3 std), from the global RNG."""
    return torch.nn.init.trunc_normal_(torch.empty(shape, dtype=torch.float64), 0.0, std, -3 * std, 3 * std)


def mixture_pmf(m, r, sigma):
    """P(Poisson(lambda) = m), lambda ~ LogNormal(log r - sigma^2/2, sigma), by adaptive quadrature (scipy)."""
    mu = math.log(r) - sigma ** 2 / 2
    return integrate.quad(lambda z: stats.norm.pdf(z) * stats.poisson.pmf(m, math.exp(mu + sigma * z)),
                          -12, 12, limit=200)[0]


# ---------------------------------------------------------------------------------------------------------- setup
def small(**kw):
    torch.manual_seed(0)
    cfg = PoissonConfig(**{**dict(vocab_size=96, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2,
                                  n_coda=1, n_recurrence=3, backprop_steps=2), **kw})
    m = build_model(cfg).double()
    with torch.no_grad():  # off the init's symmetric values (LN at 1/0, zero biases)
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def batch(m, B=2, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, m.cfg.vocab_size, (B, T), generator=g),
            torch.randint(0, m.cfg.vocab_size, (B, T), generator=g))


def default_std(m):
    return math.sqrt(2 / (5 * m.cfg.d_model))


# ---------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("n", [0, 1, 3, 5])
def test_eval_forward_is_the_adapter_loop_from_zeros(n):
    m = small().eval()
    idx, tgt = batch(m)
    h0 = torch.zeros(*idx.shape, m.cfg.d_model, dtype=torch.float64)
    ref_logits, ref_loss = reference_loss(m, idx, tgt, n, h0)
    logits, _ = m(idx, n_steps=n)
    _, loss = m(idx, tgt, n_steps=n)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
    if n == 3:  # n_steps=None means r
        torch.testing.assert_close(m(idx, tgt)[1], ref_loss, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("init_std", [None, 0.3])
def test_training_forward_reproduces_the_trunc_normal_initial_state(init_std):
    m = small(init_std=init_std).train()
    idx, tgt = batch(m)
    std = default_std(m) if init_std is None else init_std
    torch.manual_seed(123)
    _, loss = m(idx, tgt, n_steps=4)
    torch.manual_seed(123)
    h0 = trunc_normal_state((*idx.shape, m.cfg.d_model), std)
    torch.testing.assert_close(loss, reference_loss(m, idx, tgt, 4, h0)[1], rtol=1e-10, atol=1e-10)
    # the noise matters (a different seed, a different loss) and evaluation does not draw it
    torch.manual_seed(124)
    assert abs(m(idx, tgt, n_steps=4)[1].item() - loss.item()) > 1e-6
    m.eval()
    zeros = torch.zeros(*idx.shape, m.cfg.d_model, dtype=torch.float64)
    torch.testing.assert_close(m(idx, tgt, n_steps=4)[1], reference_loss(m, idx, tgt, 4, zeros)[1])


def test_initial_state_is_truncated_normal_at_sqrt_2_over_5d_and_zero_in_eval():
    m = small(d_model=64)
    h_pre = torch.zeros(64, 64, 64, dtype=torch.float64)
    s = math.sqrt(2 / (5 * 64))
    x = m.initial_state(h_pre, noise=True)
    assert x.abs().max().item() <= 3 * s
    # variance of N(0, s^2) truncated at +-3s: s^2 (1 - 2 * 3 phi(3) / (2 Phi(3) - 1))
    trunc_sd = s * math.sqrt(1 - 6 * stats.norm.pdf(3) / (2 * stats.norm.cdf(3) - 1))
    assert x.std().item() == pytest.approx(trunc_sd, rel=0.01)
    assert abs(x.mean().item()) < 0.01 * s
    assert x.abs().max().item() > 2.9 * s  # truncated at 3s, not earlier
    assert not m.initial_state(h_pre, noise=False).any()
    assert not small(init_std=0.0).initial_state(h_pre, noise=True).any()
    assert m.initial_state(h_pre.float(), noise=True).dtype == torch.float32


def grads(loss, m):
    return torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)


@pytest.mark.parametrize("p", [5, 2, 1])
def test_gradients_come_only_from_the_last_k_steps(p):
    m = small().train()  # k = 2
    idx, tgt = batch(m)
    k = m.cfg.backprop_steps
    torch.manual_seed(7)
    _, loss = m(idx, tgt, n_steps=p)
    got = grads(loss, m)
    torch.manual_seed(7)
    h0 = trunc_normal_state((*idx.shape, m.cfg.d_model), default_std(m))
    _, truncated = reference_loss(m, idx, tgt, p, h0, truncate_after=max(p - k, 0))
    _, full = reference_loss(m, idx, tgt, p, h0)
    torch.testing.assert_close(loss, truncated, rtol=1e-10, atol=1e-10)
    want, full_g = grads(truncated, m), grads(full, m)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    core = [i for i, (name, _) in enumerate(m.named_parameters()) if name.startswith("recur.")]
    differs = max((got[i] - full_g[i]).abs().max().item() / full_g[i].abs().max().item() for i in core)
    if p > k:  # the cut steps' contribution is missing
        assert differs > 1e-3
    else:  # p <= k: nothing is cut
        assert differs < 1e-9


def test_no_grad_steps_call_the_same_modules_in_the_same_order_and_every_parameter_gets_a_gradient():
    m = small().train()
    idx, tgt = batch(m)
    p, k = 5, m.cfg.backprop_steps
    calls = []
    watched = {"recur": m.recur, "adapter": m.recur.adapter,
               **{f"blocks.{i}": b for i, b in enumerate(m.recur.blocks)}}
    hooks = [mod.register_forward_pre_hook(lambda mod, args, name=name: calls.append((name, torch.is_grad_enabled())))
             for name, mod in watched.items()]
    _, loss = m(idx, tgt, n_steps=p)
    for h in hooks:
        h.remove()
    step = ["recur", "adapter", "blocks.0", "blocks.1"]
    assert calls == [(name, i >= p - k) for i in range(p) for name in step]
    loss.backward()
    missing = [n for n, q in m.named_parameters() if q.grad is None or not q.grad.abs().sum() > 0]
    assert missing == []  # DDP without find_unused_parameters


def test_core_step_activation_checkpointing_gives_the_same_gradients():
    m = small().train()
    idx, tgt = batch(m)
    torch.manual_seed(3)
    plain = grads(m(idx, tgt, n_steps=4)[1], m)
    checkpoint_module(m.recur)  # what train.activation_checkpointing=core_step does
    torch.manual_seed(3)
    for a, b in zip(plain, grads(m(idx, tgt, n_steps=4)[1], m)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_train_depth_is_seeded_and_heavy_tailed():
    r, sigma, n = 10, 0.5, 4000
    m = build_model(PoissonConfig(n_recurrence=r, depth_sigma=sigma), device="meta")
    torch.manual_seed(1)
    first = [m.train_depth(0, s) for s in range(n)]
    torch.manual_seed(2)  # the global RNG plays no part
    assert [m.train_depth(0, s) for s in range(50)] == first[:50]
    assert [m.train_depth(1, s) for s in range(50)] != first[:50]
    assert len(set(first[:50])) > 5 and min(first) >= 1
    mean = sum(first) / n
    # Var p = E lambda + Var lambda = r + r^2 (e^{sigma^2} - 1): standard error ~0.1 at n = 4000
    se = math.sqrt((r + r * r * (math.exp(sigma ** 2) - 1)) / n)
    assert abs(mean - (r + 1)) < 4 * se
    # the empirical pmf follows the Poisson-log-normal mixture
    for j in range(1, 3 * r):
        exact = mixture_pmf(j - 1, r, sigma)
        assert abs(first.count(j) / n - exact) < 4 * math.sqrt(exact * (1 - exact) / n) + 1e-3
    # heavy tail: P(p > 2r) = P(N >= 2r) is ~0.075 under the mixture, 0.0035 under a plain Poisson(r) + 1
    tail = 1 - sum(mixture_pmf(i, r, sigma) for i in range(2 * r))
    poisson_tail = stats.poisson.sf(2 * r - 1, r)
    assert tail > 20 * poisson_tail
    observed = sum(q > 2 * r for q in first) / n
    assert abs(observed - tail) < 4 * math.sqrt(tail * (1 - tail) / n)
    assert observed > 10 * poisson_tail
    assert max(first) > 3 * r


def test_train_depth_without_sigma_is_poisson_plus_one():
    m = build_model(PoissonConfig(n_recurrence=6, depth_sigma=0.0), device="meta")
    ps = torch.tensor([m.train_depth(5, s) for s in range(3000)], dtype=torch.float64)
    assert ps.mean().item() == pytest.approx(7.0, abs=4 * math.sqrt(6 / 3000))
    assert ps.var().item() == pytest.approx(6.0, rel=0.1)


def test_expected_grad_steps_and_notes():
    cfg = PoissonConfig(n_recurrence=10, backprop_steps=8, depth_sigma=0.5, d_model=64, block_size=32)
    exact = 8 - sum((8 - j) * mixture_pmf(j - 1, 10, 0.5) for j in range(1, 8))
    assert PoissonDepth.expected_grad_steps(cfg) == pytest.approx(exact, abs=1e-8)
    m = build_model(cfg, device="meta")  # and by Monte Carlo over the sampler itself
    mc = sum(min(8, m.train_depth(0, s)) for s in range(4000)) / 4000
    assert mc == pytest.approx(exact, abs=0.1)
    notes = PoissonDepth.flops_notes(cfg)
    f = PoissonDepth.flops_per_token
    assert len(notes) == 3
    assert "E[p] = 11" in notes[0] and f"{f(cfg, 11):,}" in notes[0] and f"{f(cfg, 11) / f(cfg):.3f}x" in notes[0]
    assert f"{exact:.3f}" in notes[1] and f"{exact / 11:.1%}" in notes[1]
    step = f(cfg, 1) - f(cfg, 0)
    assert f"{3 * f(cfg, 0) + step * (11 + 2 * exact):,.0f}" in notes[2]


def test_exit_states_and_exit_curve_equal_separate_forwards():
    m = small().eval()
    idx, tgt = batch(m)
    with torch.no_grad():
        states = dict(m.exit_states(idx, [5, 0, 2, 1, 2]))
        assert sorted(states) == [0, 1, 2, 5]
        for e, s in states.items():
            torch.testing.assert_close(m.lm_head(s), m(idx, n_steps=e)[0], rtol=1e-10, atol=1e-10)
        curve = exit_curve(m, [(idx, tgt)], [0, 1, 2, 3, 4], 4, torch.device("cpu"))  # eval's pass, fp32 head
        assert curve["exit"] == [0, 1, 2, 3, 4]
        for e, loss in zip(curve["exit"], curve["loss"]):  # fp32 head vs fp64: measured max rel gap 1.9e-8, x10 up
            assert loss == pytest.approx(m(idx, tgt, n_steps=e)[1].item(), rel=1e-6)


@pytest.mark.parametrize("n", [3, 1])
def test_cache_decoding_equals_the_full_forward(n):
    m = small().eval()
    idx, _ = batch(m, T=10)
    with torch.no_grad():
        full, _ = m(idx, n_steps=n)
        cache = KVCache(m.cfg.block_size)
        pieces = [m(idx[:, :4], n_steps=n, cache=cache)[0]]  # a prefill, then one token at a time
        pieces += [m(idx[:, t:t + 1], n_steps=n, cache=cache)[0] for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.n_layer_caches() == m.block_executions(m.cfg, n) and cache.pos == 10


def test_meta_build_parameters_and_accounting():
    cfg = PoissonConfig(vocab_size=96, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                        n_recurrence=10)
    m = build_model(cfg, device="meta")
    assert all(p.is_meta for p in m.parameters())
    assert m.lm_head.weight is m.embed.wte.weight
    d, V, S = 32, 96, 16
    block = 12 * d * d + 13 * d
    want = V * d + S * d + 4 * block + (2 * d * d + d) + 2 * d  # embeddings, blocks, adapter, final LN
    assert count_params(m)["params"] == want
    assert PoissonDepth.shorthand(cfg) == "1+2x10+1"
    assert PoissonDepth.full_depth(cfg) == 10
    assert PoissonDepth.block_executions(cfg) == 22 and PoissonDepth.block_executions(cfg, 3) == 8
    eq1 = 22 * (24 * d * d + 4 * S * d) + 10 * 4 * d * d
    assert PoissonDepth.flops_per_token(cfg) == eq1 == PoissonDepth.flops_per_token(cfg, executed=True)
    assert PoissonDepth.flops_per_token(cfg, with_head=True) == eq1 + 2 * d * V
    assert PoissonDepth.flops_per_token(cfg, n_steps=3, seq_len=8) == 8 * (24 * d * d + 32 * d) + 12 * d * d


def test_gpt2_init_scales_residual_projections_by_the_depth_at_r():
    torch.manual_seed(0)
    cfg = PoissonConfig(vocab_size=96, block_size=16, d_model=64, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                        n_recurrence=10)
    m = build_model(cfg)
    want = 0.02 / math.sqrt(2 * 22)
    assert m.recur.blocks[0].mlp.c_proj.weight.std().item() == pytest.approx(want, rel=0.05)
    assert m.recur.adapter.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert not m.recur.adapter.bias.any()


def test_config_validation_and_depth_errors():
    problems = PoissonConfig(backprop_steps=0, depth_sigma=-0.5, init_std=-1.0, n_recurrence=0).validate()
    assert "model.backprop_steps must be >= 1, got 0" in problems
    assert "model.depth_sigma must be >= 0, got -0.5" in problems
    assert any(p.startswith("model.init_std must be >= 0") for p in problems)
    assert "model.n_recurrence must be >= 1, got 0" in problems
    assert PoissonConfig().validate() == []
    m = small().train()
    idx, tgt = batch(m)
    with pytest.raises(ValueError, match="at least one recurrence step"):
        m(idx, tgt, n_steps=0)
