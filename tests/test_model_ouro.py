"""Ouro against a hand-written float64 implementation of its equations, read straight from the checkpoint keys:
h_t = LN(stack(h_{t-1})), lambda_t = sigmoid(w . h_t + b), p_t = lambda_t prod_{j<t}(1 - lambda_j) (p_T the rest),
training loss = mean over tokens of sum_t p_t CE_t - beta H(p)."""
import math

import pytest
import torch

from pipeline.eval.exit_losses import exit_curve
from pipeline.model import build_model
from pipeline.model.configs import OuroConfig
from pipeline.model.layers import KVCache
from pipeline.model.ouro import Ouro
from pipeline.model.registry import count_params
from pipeline.model.registry import model_info

BETA = 0.3  # not the default 0.1: a wrong coefficient cannot pass by coincidence


# ------------------------------------------------------------------------------ an independent, by-hand reference
def ln(x, P, name, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * P[name + ".weight"] + P[name + ".bias"]


def lin(x, P, name):
    return x @ P[name + ".weight"].T + P[name + ".bias"]


def block(x, P, pre, n_head):
    B, T, C = x.shape
    q, k, v = lin(ln(x, P, pre + ".ln_1"), P, pre + ".attn.c_attn").split(C, dim=2)
    q, k, v = (t.reshape(B, T, n_head, C // n_head).permute(0, 2, 1, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(C // n_head)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    a = torch.exp(scores - scores.amax(-1, keepdim=True))
    y = (a / a.sum(-1, keepdim=True)) @ v
    x = x + lin(y.permute(0, 2, 1, 3).reshape(B, T, C), P, pre + ".attn.c_proj")
    hid = lin(ln(x, P, pre + ".ln_2"), P, pre + ".mlp.c_fc")
    return x + lin(0.5 * hid * (1 + torch.erf(hid / math.sqrt(2))), P, pre + ".mlp.c_proj")  # exact GELU


def reference_states(P, cfg, idx, depth):
    """[LN(embeddings), h_1, ..., h_depth] with h_t = LN(blocks(h_{t-1})), h_0 = the embeddings."""
    h = P["embed.wte.weight"][idx] + P["embed.wpe.weight"][torch.arange(idx.shape[1])]
    states = [ln(h, P, "recur.ln_f")]
    for _ in range(depth):
        for i in range(cfg.n_layer):
            h = block(h, P, f"recur.blocks.{i}", cfg.n_head)
        h = ln(h, P, "recur.ln_f")
        states.append(h)
    return states


def reference_exit_probs(P, states):
    """p_t over loops 1..n from lambda_t = sigmoid(w . h_t + b), as products (no log space)."""
    lam = [torch.sigmoid(lin(h, P, "exit_gate").squeeze(-1)) for h in states[1:]]
    n, p, remaining = len(lam), [], torch.ones_like(lam[0])
    for t in range(n):
        p.append(lam[t] * remaining if t < n - 1 else remaining)
        remaining = remaining * (1 - lam[t])
    return torch.stack(p, -1)


def token_ce(logits, targets):
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    return -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def reference_training_loss(P, cfg, idx, targets, depth):
    states = reference_states(P, cfg, idx, depth)
    p = reference_exit_probs(P, states)
    ce = torch.stack([token_ce(h @ P["embed.wte.weight"].T, targets) for h in states[1:]], -1)
    entropy = -(p * torch.log(p)).sum(-1)
    per_token = (p * ce).sum(-1) - BETA * entropy
    valid = targets != -1
    return per_token[valid].mean(), p, ce


# ---------------------------------------------------------------------------------------------------------- tests
def small_ouro(T=3, **kw):
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=97, block_size=16, d_model=32, n_head=4, n_layer=2, n_recurrence=T,
                     entropy_beta=BETA, **kw)
    m = build_model(cfg).double()
    with torch.no_grad():  # off the init: LN affine != identity, gate bias != 0, larger gate weights
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
        m.exit_gate.weight.normal_(0.0, 0.3)
        m.exit_gate.bias.fill_(-0.4)
    return m


def params(m):
    return dict(m.named_parameters())


def batch(n_ignored=3):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 97, (2, 12), generator=g)
    targets = torch.randint(0, 97, (2, 12), generator=g)
    targets[0, :n_ignored] = -1
    return idx, targets


@pytest.mark.parametrize("depth", [1, 3, 5])  # 5 > T: extrapolation
def test_eval_forward_and_loss_equal_the_reference_at_any_depth(depth):
    m = small_ouro().eval()
    idx, targets = batch()
    ref = reference_states(params(m), m.cfg, idx, depth)[-1] @ m.embed.wte.weight.T
    logits, none = m(idx, n_steps=depth)
    assert none is None
    torch.testing.assert_close(logits, ref, rtol=1e-10, atol=1e-10)
    _, loss = m(idx, targets, n_steps=depth)  # eval mode: the plain next-token loss at this depth
    valid = targets != -1
    torch.testing.assert_close(loss, token_ce(ref, targets)[valid].mean(), rtol=1e-10, atol=1e-12)
    if depth == 3:  # the default depth is T
        torch.testing.assert_close(m(idx)[0], logits, rtol=0, atol=0)


@pytest.mark.parametrize("n_loops", [1, 3, 6])
def test_exit_distribution_matches_the_products_and_sums_to_one(n_loops):
    m = small_ouro().eval()
    idx, _ = batch()
    p = m.exit_distribution(idx, n_loops)
    ref = reference_exit_probs(params(m), reference_states(params(m), m.cfg, idx, n_loops))
    assert p.shape == (2, 12, n_loops)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 12, dtype=p.dtype), rtol=0, atol=1e-12)
    if n_loops == 3:
        assert (p.min() > 0.001) and (p.std() > 0.01)  # a distribution that exercises every term, not a corner case
        torch.testing.assert_close(m.exit_distribution(idx), p)  # default: T loops


def test_exit_distribution_stays_finite_when_the_gate_saturates():
    m = small_ouro().eval()
    idx, targets = batch()
    with torch.no_grad():
        m.exit_gate.weight.zero_()
        m.exit_gate.bias.fill_(60.0)  # lambda = 1 - 1e-26: everything exits at t = 1
    p = m.exit_distribution(idx)
    torch.testing.assert_close(p[..., 0], torch.ones_like(p[..., 0]))
    m.train()
    _, loss = m(idx, targets)
    ce1 = token_ce(reference_states(params(m), m.cfg, idx, 1)[1] @ m.embed.wte.weight.T, targets)
    assert torch.isfinite(loss) and abs(loss.item() - ce1[targets != -1].mean().item()) < 1e-9


@pytest.mark.parametrize("depth", [None, 1])
def test_training_loss_is_the_expected_per_loop_loss_minus_beta_entropy(depth):
    m = small_ouro().train()
    idx, targets = batch()
    P = params(m)
    _, loss = m(idx, targets, n_steps=depth)
    want, p, ce = reference_training_loss(P, m.cfg, idx, targets, depth or m.cfg.n_recurrence)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    if depth is None:  # the token-wise expectation, not the loss of the p-weighted logits
        states = reference_states(P, m.cfg, idx, 3)
        mixed = sum(p[..., t, None] * (states[t + 1] @ P["embed.wte.weight"].T) for t in range(3))
        assert abs(loss.item() - token_ce(mixed, targets)[targets != -1].mean().item()) > 1e-3


def test_training_gradients_equal_the_reference_and_reach_the_exit_gate():
    m = small_ouro().train()
    idx, targets = batch()
    P = params(m)
    names = list(P)
    _, loss = m(idx, targets)
    got = torch.autograd.grad(loss, [P[k] for k in names])
    want = torch.autograd.grad(reference_training_loss(P, m.cfg, idx, targets, 3)[0], [P[k] for k in names])
    for k, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-11, msg=lambda s, k=k: f"{k}: {s}")
    grads = dict(zip(names, got))
    assert grads["exit_gate.weight"].abs().sum() > 1e-4 and grads["exit_gate.bias"].abs() > 1e-6
    # the entropy term alone moves the gate: with beta = 0 the gate's gradient changes
    m.cfg.entropy_beta = 0.0
    _, loss0 = m(idx, targets)
    (g0,) = torch.autograd.grad(loss0, [P["exit_gate.bias"]])
    assert abs(g0.item() - grads["exit_gate.bias"].item()) > 1e-6


def test_exit_states_equal_forward_at_each_depth():
    m = small_ouro().eval()
    idx, _ = batch()
    P = params(m)
    ref = reference_states(P, m.cfg, idx, 4)
    got = dict(m.exit_states(idx, [4, 0, 2, 1, 2]))
    assert sorted(got) == [0, 1, 2, 4]
    for e, states in got.items():
        torch.testing.assert_close(states, ref[e], rtol=1e-10, atol=1e-10)  # e = 0: LN(embeddings)
        torch.testing.assert_close(m.lm_head(states), m(idx, n_steps=e)[0], rtol=1e-12, atol=1e-12)
    tgt = batch(n_ignored=0)[1]  # eval's validation tokens all count: no ignored targets
    curve = exit_curve(m, [(idx, tgt)], [1, 2, 3], 3, torch.device("cpu"))  # eval's one pass, its fp32 head
    assert curve["exit"] == [1, 2, 3]
    for e, loss in zip(curve["exit"], curve["loss"]):  # fp32 head vs fp64 forward: measured max rel gap 1.3e-8, x10 up
        assert loss == pytest.approx(m(idx, tgt, n_steps=e)[1].item(), rel=1e-6)


@pytest.mark.parametrize("depth", [None, 2])
def test_cache_decode_equals_the_full_forward(depth):
    m = small_ouro().eval()
    idx, _ = batch()
    full, _ = m(idx, n_steps=depth)
    cache = KVCache(m.cfg.block_size)
    parts = [m(idx[:, :5], n_steps=depth, cache=cache)[0]]  # a prefill of 5, then token by token
    for i in range(5, idx.shape[1]):
        parts.append(m(idx[:, i:i + 1], n_steps=depth, cache=cache)[0])
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.n_layer_caches() == m.cfg.n_layer * (depth or m.cfg.n_recurrence)  # one slot per block per loop
    assert cache.pos == idx.shape[1]


def test_meta_build_structure_and_accounting():
    cfg = OuroConfig(vocab_size=97, block_size=16, d_model=32, n_head=4, n_layer=2, n_recurrence=3)
    m = build_model(cfg, device="meta")
    assert all(p.is_meta for p in m.parameters())
    assert len(m.prelude) == 0 and len(m.coda) == 0 and len(m.recur.blocks) == 2
    assert m.lm_head.weight is m.embed.wte.weight and m.train_depth(0, 5) is None
    d, V, S = 32, 97, 16
    block_params = 12 * d * d + 13 * d
    assert count_params(m)["params"] == V * d + S * d + 2 * block_params + 2 * d + (d + 1)  # + loop norm + gate
    assert Ouro.shorthand(cfg) == "2Lx3" and Ouro.block_executions(cfg) == 6 and Ouro.block_executions(cfg, 5) == 10
    per_block = 24 * d * d + 4 * S * d
    assert Ouro.flops_per_token(cfg) == 6 * per_block + 3 * 2 * d
    assert Ouro.flops_per_token(cfg, 4, with_head=True) == 8 * per_block + 4 * 2 * d + 2 * d * V
    assert Ouro.flops_per_token(cfg, executed=True) == Ouro.flops_per_token(cfg)  # nothing saved or added
    info = model_info(cfg)
    assert info["shorthand"] == "2Lx3" and info["block_executions"] == 6
    notes = " ".join(info["flops_notes"])
    one_head, t_heads = 6 * per_block + 6 * d + 2 * d * V, 6 * per_block + 6 * d + 3 * 2 * d * V
    assert f"{3 * 2 * d * V:,}" in notes and f"{t_heads / one_head:.3f}x" in notes


def test_init_scales_residual_projections_for_one_loop_and_starts_the_gate_near_one_half():
    cfg = OuroConfig(vocab_size=97, block_size=16, d_model=64, n_head=4, n_layer=2, n_recurrence=4)
    torch.manual_seed(0)
    m = build_model(cfg)
    std = m.recur.blocks[0].mlp.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * 2), rel=0.05)  # 2 layers per residual stream, not 2 x 4
    assert m.exit_gate.bias.abs().max() == 0 and m.exit_gate.weight.std().item() == pytest.approx(0.02, rel=0.2)


LLAMA = dict(block="llama", bias=False, n_kv_head=2, qk_norm=True, mlp_multiple=16, vocab_multiple=128)


def test_llama_block_one_loop_is_the_dense_llama_model_and_accounting():
    """With the llama block one loop is the dense model of the same blocks (its final norm the loop's RMSNorm, the
    padded vocabulary never predicted), also under document masking; parameters and FLOPs written out by hand."""
    from pipeline.model.configs import GPTConfig
    from pipeline.model.layout import documents_from_eos

    kw = dict(vocab_size=97, block_size=16, d_model=32, n_head=4, **LLAMA)
    cfg = OuroConfig(**kw, n_layer=2, n_recurrence=3, entropy_beta=BETA)
    m = build_model(cfg, seed=1).double().eval()
    dense = build_model(GPTConfig(**kw, n_layer=2), seed=2).double().eval()
    own = {k.replace("recur.", "", 1): v for k, v in m.state_dict().items()}
    dense.load_state_dict({k: own[k] for k in dense.state_dict()})
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    docs = documents_from_eos(idx, 5)
    for kwargs in ({}, {"docs": docs}):
        torch.testing.assert_close(m(idx, n_steps=1, **kwargs)[0], dense(idx, **kwargs)[0], rtol=0, atol=0)
    assert type(m.recur.ln_f).__name__ == "RMSNorm"
    # the training loss (every loop's head) never predicts the padding: that of the same model without padding
    unpadded = build_model(OuroConfig(**{**kw, "vocab_multiple": 1}, n_layer=2, n_recurrence=3, entropy_beta=BETA))
    unpadded.load_state_dict({k: v[:97] if k.endswith(("wte.weight", "lm_head.weight")) else v
                              for k, v in m.state_dict().items()})
    targets = torch.roll(idx, -1, 1)
    torch.testing.assert_close(m.train()(idx, targets)[1], unpadded.double().train()(idx, targets)[1])
    d, V, S, f, d_kv = 32, 97, 16, 96, 16  # SwiGLU 8/3 d = 85.3 -> 96 (multiple of 16); 2 kv heads of 8
    block_params = d * (2 * d + 2 * d_kv) + 3 * d * f + 2 * d + 2 * 8  # projections, two RMSNorms, QK-norm
    assert count_params(m)["params"] == 128 * d + 2 * block_params + d + (d + 1)  # padded embeddings, no wpe
    per_block = 2 * (d * (2 * d + 2 * d_kv) + 3 * d * f) + 4 * S * d
    assert Ouro.flops_per_token(cfg, 2, with_head=True) == 4 * per_block + 2 * 2 * d + 2 * d * V
