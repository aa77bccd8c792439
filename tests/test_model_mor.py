"""MoR (expert-choice Mixture-of-Recursions) against the method written out by hand in float64: per-row Python
selection, explicit attention masks, the BCE formula. No model code in the references."""
import math

import pytest
import torch

from pipeline.eval.exit_losses import exit_curve
from pipeline.model import build_model
from pipeline.model import model_info
from pipeline.model.configs import MoRConfig
from pipeline.model.layers import KVCache
from test_model import block
from test_model import embed
from test_model import head_loss
from test_model import linear
from test_model import ln


def small_mor(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2, n_coda=1, n_recurrence=3)
    cfg.update(kw)
    m = build_model(MoRConfig(**cfg)).double()
    with torch.no_grad():  # off the GPT-2 init so that every block and router matters (router logits of both signs)
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.eval()


def sigmoid(z):
    return 1 / (1 + torch.exp(-z))


def masked_block(blk, x, allowed):
    """Pre-LN block whose attention lets query i see key j where allowed[b, i, j] (an explicit mask)."""
    B, T, C = x.shape
    nh = blk.attn.n_head
    q, k, v = linear(ln(x, blk.ln_1.weight, blk.ln_1.bias), blk.attn.c_attn).split(C, dim=2)
    q, k, v = (t.reshape(B, T, nh, C // nh).permute(0, 2, 1, 3) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(C // nh)).masked_fill(~allowed[:, None], float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    x = x + linear(y.permute(0, 2, 1, 3).reshape(B, T, C), blk.attn.c_proj)
    hid = linear(ln(x, blk.ln_2.weight, blk.ln_2.bias), blk.mlp.c_fc)
    return x + linear(0.5 * hid * (1 + torch.erf(hid / math.sqrt(2))), blk.mlp.c_proj)


def prelude(m, idx):
    h = embed(m, idx)
    for b in m.prelude:
        h = block(b, h)
    return h


def ref_topk_recursion(m, h, r, candidates):
    """Recursion r by hand, row by row: scores a = alpha sigmoid(w . h) of the candidates, the k_r = int((N-r)/N T)
    largest (Python sort), in causal order, the core on those tokens only, h_i += a_i core(h)_i; the BCE between the
    candidates' logits and their membership. Returns (h, chosen per row, BCE averaged over all candidates)."""
    cfg = m.cfg
    N, (B, T, _) = cfg.n_recurrence, h.shape
    k = max(1, int((N - r) / N * T))
    w = m.recur.routers[r].weight[0]
    out, chosen, bce_terms = h.clone(), [], []
    for b in range(B):
        z = {i: (h[b, i] @ w) for i in candidates[b]}
        a = {i: cfg.router_alpha * sigmoid(z[i]) for i in candidates[b]}
        sel = sorted(sorted(candidates[b], key=lambda i: -a[i].item())[:k])
        o = h[b, sel][None]
        for blk in m.recur.blocks:
            o = block(blk, o)
        for j, i in enumerate(sel):
            out[b, i] = h[b, i] + a[i] * o[0, j]
        for i in candidates[b]:
            t = 1.0 if i in sel else 0.0
            bce_terms.append(-(t * torch.log(sigmoid(z[i])) + (1 - t) * torch.log(1 - sigmoid(z[i]))))
        chosen.append(sel)
    return out, chosen, torch.stack(bce_terms).mean()


def ref_topk(m, idx, n):
    h = prelude(m, idx)
    chosen, bces = [list(range(idx.shape[1]))] * idx.shape[0], []
    for r in range(n):
        h, chosen, bce = ref_topk_recursion(m, h, r, chosen)
        bces.append(bce)
    return h, bces


def ref_threshold(m, idx, n):
    """Causal routing by hand: token i takes recursion r iff it took r-1 and sigmoid(z_i) >= 0.5 (every token takes
    recursion 0, capacity 1); query i sees key j <= i when j took r, and itself; only takers are updated."""
    h = prelude(m, idx)
    B, T, _ = h.shape
    take = torch.ones(B, T, dtype=torch.bool)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    fractions = []
    for r in range(n):
        z = h @ m.recur.routers[r].weight[0]
        if r > 0:
            take = take & (sigmoid(z) >= 0.5)
        allowed = causal & (take[:, None, :] | torch.eye(T, dtype=torch.bool))
        o = h
        for blk in m.recur.blocks:
            o = masked_block(blk, o, allowed)
        h = h + (take.double() * m.cfg.router_alpha * sigmoid(z))[..., None] * o
        fractions.append(take.double().mean().item())
    return h, fractions


# ---------------------------------------------------------------------------------------------------------- tests
def test_selection_and_update_match_the_hand_written_recursions():
    m = small_mor()
    idx = torch.randint(0, 97, (3, 16))
    with torch.no_grad():
        h = m.encode(idx)
        want = prelude(m, idx)
        torch.testing.assert_close(h, want, rtol=1e-12, atol=1e-12)
        cand, chosen = [list(range(16))] * 3, None
        for r, k in enumerate([16, 10, 5]):  # capacities 1, 2/3, 1/3 of T = 16
            h_in = h
            h, chosen, _ = m.recur(h, r, chosen)
            want, cand, _ = ref_topk_recursion(m, want, r, cand)
            assert chosen.tolist() == cand and chosen.shape == (3, k)
            torch.testing.assert_close(h, want, rtol=1e-10, atol=1e-12)
            unchosen = torch.ones(3, 16, dtype=torch.bool).scatter(1, chosen, False)
            assert torch.equal(h[unchosen], h_in[unchosen])  # identity on the tokens not chosen
    h, chosen_sets = m.encode(idx), []  # hierarchy and causal order, on the model's own output
    with torch.no_grad():
        chosen = None
        for r in range(3):
            h, chosen, _ = m.recur(h, r, chosen)
            chosen_sets.append([set(row) for row in chosen.tolist()])
            assert (chosen.diff(dim=1) > 0).all()  # causal (sorted) order
    for r in range(1, 3):
        assert all(b <= a for a, b in zip(chosen_sets[r - 1], chosen_sets[r]))  # chosen(r) within chosen(r-1)


def test_update_equation_residual_inside_block():
    """h <- h + a block(h) = (1 + a) h + a f(h) with f = block - identity, on recursion 0 where every token is
    chosen (n_core = 1: f is one block's attention + MLP)."""
    m = small_mor(n_core=1)
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        h = prelude(m, idx)
        a = m.cfg.router_alpha * sigmoid(h @ m.recur.routers[0].weight[0])[..., None]
        f = block(m.recur.blocks[0], h) - h
        got, chosen, _ = m.recur(h, 0, None)
    assert chosen.shape == (2, 16)
    torch.testing.assert_close(got, (1 + a) * h + a * f, rtol=1e-10, atol=1e-12)


def test_attention_is_restricted_to_the_chosen_tokens():
    """At recursion 1 (10 of 16 chosen) change an unchosen token's state along a direction the router does not see:
    the selection stays, the chosen tokens' new states do not move at all. The same change on a chosen token moves
    the chosen tokens after it (so the check can fail)."""
    m = small_mor()
    idx = torch.randint(0, 97, (1, 16))
    w = m.recur.routers[1].weight[0].detach()
    with torch.no_grad():
        h, chosen, _ = m.recur(m.encode(idx), 0, None)
        h1, chosen1, _ = m.recur(h, 1, chosen)
        sel = chosen1[0].tolist()
        off = [i for i in range(16) if i not in sel][0]
        delta = torch.randn(32, dtype=torch.float64)
        delta -= (delta @ w) / (w @ w) * w  # router-orthogonal: the scores do not change
        for token, moves in ((off, False), (sel[0], True)):
            hp = h.clone()
            hp[0, token] += delta
            h2, chosen2, _ = m.recur(hp, 1, chosen)
            assert torch.equal(chosen2, chosen1)
            later = [i for i in sel if i > token]
            assert torch.allclose(h2[0, later], h1[0, later], rtol=0, atol=1e-12) is not moves
            if not moves:
                assert torch.equal(h2[0, off], hp[0, off])  # the unchosen token itself: identity


def test_forward_and_training_loss_match_reference_with_aux_bce():
    m = small_mor()
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    h, bces = ref_topk(m, idx, 3)
    want_logits, want_ce = head_loss(m, h, targets)
    with torch.no_grad():
        logits, _ = m(idx)
        _, eval_loss = m(idx, targets)
    torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(eval_loss, want_ce, rtol=1e-9, atol=1e-9)  # evaluation: plain CE
    m.train()
    _, loss = m(idx, targets)
    want = want_ce + m.cfg.aux_loss_coef * torch.stack(bces).sum()  # summed over recursions
    torch.testing.assert_close(loss.detach(), want, rtol=1e-9, atol=1e-12)
    hh, chosen, bce_terms = m.encode(idx), None, []
    for r in range(3):
        hh, chosen, bce = m.recur(hh, r, chosen)
        bce_terms.append(bce)
    torch.testing.assert_close(torch.stack(bce_terms).detach(), torch.stack(bces), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("aux_loss_coef", [0.001, 0.0])
def test_gradient_reaches_every_router(aux_loss_coef):
    """Through a * block(h) on the chosen tokens (and the BCE when on): every router, every recursion."""
    m = small_mor(aux_loss_coef=aux_loss_coef).train()
    idx = torch.randint(0, 97, (2, 16))
    _, loss = m(idx, torch.randint(0, 97, (2, 16)))
    loss.backward()
    for r, router in enumerate(m.recur.routers):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0, f"router {r}"


def test_threshold_routing_matches_reference_and_is_causal():
    m = small_mor()
    m.routing = "threshold"
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        logits, _ = m(idx)
        stats = m.routing_statistics(idx)
        h, fractions = ref_threshold(m, idx, 3)
        later = idx.clone()
        later[:, 9:] = torch.randint(0, 97, (2, 7))
        logits_later, _ = m(later)
    torch.testing.assert_close(logits, head_loss(m, h, idx)[0], rtol=1e-9, atol=1e-9)
    assert stats["fraction"] == pytest.approx(fractions, rel=1e-12)
    assert 0 < fractions[2] <= fractions[1] < 1 and fractions[0] == 1  # the routers drop some tokens, not all
    torch.testing.assert_close(logits_later[:, :9], logits[:, :9], rtol=0, atol=1e-12)
    assert not torch.allclose(logits_later[:, 9:], logits[:, 9:])


def test_topk_statistics_are_the_capacities():
    m = small_mor()
    assert m.routing_statistics(torch.randint(0, 97, (2, 16)))["fraction"] == [1.0, 10 / 16, 5 / 16]


@pytest.mark.parametrize("chunks", [[1] * 16, [5, 1, 4, 6]])
def test_cache_decoding_equals_full_threshold_forward(chunks):
    """Token by token (or in chunks) with a KV cache, whatever ``routing`` says: the full threshold forward."""
    m = small_mor()
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        m.routing = "threshold"
        full, _ = m(idx)
        m.routing = "topk"  # a cache always routes by threshold
        cache, parts, start = KVCache(m.cfg.block_size), [], 0
        for n in chunks:
            parts.append(m(idx[:, start:start + n], cache=cache)[0])
            start += n
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("routing", ["topk", "threshold"])
def test_exit_states_equal_forward_at_every_depth(routing):
    m = small_mor()
    m.routing = routing
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        states = dict(m.exit_states(idx, [3, 0, 2, 1]))
        assert sorted(states) == [0, 1, 2, 3]
        for e, s in states.items():
            torch.testing.assert_close(m.lm_head(s), m(idx, n_steps=e)[0], rtol=1e-12, atol=1e-12)
    curve = exit_curve(m, [(idx, targets)], [0, 1, 2, 3], 3, torch.device("cpu"))  # eval's one pass, fp32 head
    assert curve["exit"] == [0, 1, 2, 3]
    # exit_curve's head runs in fp32 (on fp64 states), the forward's and head_loss's in fp64: measured max rel gap
    # 1.7e-8 (both routings, both references), x10 rounded up
    assert curve["loss"] == pytest.approx([m(idx, targets, n_steps=e)[1].item() for e in range(4)], rel=1e-6)
    if routing == "topk":
        want = [head_loss(m, ref_topk(m, idx, e)[0], targets)[1].item() for e in range(4)]
        assert curve["loss"] == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="n_recurrence"):
        list(m.exit_states(idx, [4]))


def test_tiny_sequences_choose_at_least_one_token():
    m = small_mor()
    for T, ks in ((1, [1, 1, 1]), (2, [2, 1, 1]), (3, [3, 2, 1])):
        idx = torch.randint(0, 97, (2, T))
        with torch.no_grad():
            h, chosen = m.encode(idx), None
            for r, k in enumerate(ks):
                h, chosen, _ = m.recur(h, r, chosen)
                assert chosen.shape == (2, k)
            torch.testing.assert_close(m(idx)[0], head_loss(m, ref_topk(m, idx, 3)[0], idx)[0], rtol=1e-9,
                                       atol=1e-9)


def test_threshold_routing_and_cache_refuse_training():
    m = small_mor().train()
    m.routing = "threshold"
    with pytest.raises(ValueError, match="model.eval"):
        m(torch.randint(0, 97, (1, 8)))
    m.routing = "topk"
    with pytest.raises(ValueError, match="model.eval"):
        m(torch.randint(0, 97, (1, 8)), cache=KVCache(m.cfg.block_size))


def test_meta_build_and_accounting():
    cfg = MoRConfig(vocab_size=50257, block_size=1024, d_model=768, n_head=12, n_prelude=1, n_core=1, n_coda=1,
                    n_recurrence=3)
    meta = build_model(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    d, S = 768, 1024
    info = model_info(cfg)
    block = 12 * d * d + 13 * d
    assert info["params"] == 50257 * d + S * d + 3 * block + 3 * d + 2 * d  # 3 blocks, 3 routers, final LN
    assert info["shorthand"] == "1+1x3+1" and info["block_executions"] == 5
    eq1 = 5 * (24 * d * d + 4 * S * d) + 3 * 2 * d
    assert info["flops_per_token"] == eq1
    assert info["flops_per_token_with_head"] == eq1 + 2 * d * 50257
    # executed: recursion r on k = 1024, 682, 341 tokens; routers on 1024, 1024, 682 candidates
    ks, cands = [1024, 682, 341], [1024, 1024, 682]
    run = 2 * (24 * d * d + 4 * S * d) + sum(k / S * 24 * d * d + 4 * k * k / S * d for k in ks) \
        + sum(2 * d * c / S for c in cands)
    assert info["executed_flops_per_token"] == round(run)
    notes = type(meta).flops_notes(cfg)
    assert "1024, 682, 341" in notes[0] and f"{round(run) / eq1:.3f} x Eq. 1" in notes[0]


LLAMA = dict(block="llama", bias=False, n_kv_head=2, qk_norm=True, mlp_multiple=16)


@pytest.mark.parametrize("block_kind", ["gpt2", "llama"])
def test_topk_routes_within_each_document(block_kind):
    """Top-k with documents, by hand row by row and document by document: a document of L tokens chooses the
    max(1, floor((N - r) L / N)) best of its candidates (Python sort), and the core runs on each document's chosen
    tokens alone at their own positions in the document; BCE over every candidate. Two recursions (the second
    choosing among the first's choices)."""
    from pipeline.model.layers import token_layout
    from pipeline.model.layout import RotaryAngles
    from pipeline.model.layout import TokenLayout
    from pipeline.model.layout import documents_from_eos

    m = small_mor(block_size=32, **(LLAMA if block_kind == "llama" else {})).train()  # dropout 0: train = eval
    cfg, N = m.cfg, m.cfg.n_recurrence
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(0, 90, (2, 24), generator=g)
    idx[0, [3, 13]], idx[1, 16] = 95, 95  # row 0: documents of 4, 10, 10 tokens; row 1: 17 and 7
    docs = documents_from_eos(idx, 95)
    h = torch.randn(2, 24, cfg.d_model, generator=g, dtype=torch.float64)
    layout = token_layout(cfg, idx, docs=docs)
    capacity = m._capacity(layout, threshold=False)
    got, chosen = h, None
    want, candidates = h.clone(), torch.ones(2, 24, dtype=torch.bool)
    for r in range(2):
        got, chosen, bce = m.recur(got, r, chosen, layout=layout, capacity=capacity)
        w = m.recur.routers[r].weight[0]
        before, take, bces = want.clone(), torch.zeros(2, 24, dtype=torch.bool), []
        for b in range(2):
            for d in docs[b].unique().tolist():
                where = (docs[b] == d).nonzero().flatten().tolist()
                k = max(1, (N - r) * len(where) // N)
                z = {t: (before[b, t] @ w).item() for t in where if candidates[b, t]}
                pick = sorted(sorted(z, key=lambda t: -z[t])[:k])
                take[b, pick] = True
                positions = torch.tensor([[t - where[0] for t in pick]])
                rope = RotaryAngles(positions, cfg.d_model // cfg.n_head, cfg.rope_theta) if cfg.block == "llama" \
                    else None
                o = before[b, pick][None]
                for blk in m.recur.blocks:
                    o = blk(o, layout=TokenLayout(positions, None, rope) if rope is not None else None)
                a = cfg.router_alpha * sigmoid(before[b, pick] @ w)
                want[b, pick] = before[b, pick] + a[:, None] * o[0]
                zs = torch.stack([before[b, t] @ w for t in where if candidates[b, t]])
                member = torch.tensor([float(take[b, t]) for t in where if candidates[b, t]], dtype=torch.float64)
                bces.append(-(member * torch.log(sigmoid(zs)) + (1 - member) * torch.log(1 - sigmoid(zs))))
        assert torch.equal(chosen, take), r
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(bce, torch.cat(bces).mean(), rtol=1e-10, atol=1e-12)
        candidates = take


@pytest.mark.parametrize("block_kind", ["gpt2", "llama"])
def test_threshold_routing_with_documents_equals_each_document_alone(block_kind):
    """Threshold routing (causal, per token) under document masking: each document's states at every depth are
    those of the document run alone."""
    from pipeline.model.layout import documents_from_eos

    m = small_mor(block_size=32, **(LLAMA if block_kind == "llama" else {}))
    m.routing = "threshold"
    idx = torch.randint(0, 90, (2, 24), generator=torch.Generator().manual_seed(5))
    idx[0, [3, 13]], idx[1, 16] = 95, 95
    docs = documents_from_eos(idx, 95)
    with torch.no_grad():
        masked = dict(m.exit_states(idx, [0, 1, 2, 3], docs=docs))
        for b in range(2):
            for d in docs[b].unique().tolist():
                where = (docs[b] == d).nonzero().flatten()
                for e, alone in m.exit_states(idx[b:b + 1, where], [0, 1, 2, 3]):
                    torch.testing.assert_close(masked[e][b, where], alone[0], rtol=0, atol=1e-10)
        frac = m.routing_statistics(idx, docs=docs)["fraction"]
    assert frac[0] == 1.0 and 0 < frac[2] <= frac[1] < 1  # routers of both signs: some tokens stop


def test_llama_accounting():
    cfg = MoRConfig(vocab_size=97, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=1, n_coda=1,
                    n_recurrence=3, **LLAMA)
    d, S, f, d_kv = 32, 16, 96, 16  # SwiGLU 8/3 d = 85.3 -> 96 (multiple of 16); 2 kv heads of 8
    weights = d * (2 * d + 2 * d_kv) + 3 * d * f
    info = model_info(cfg)
    assert info["params"] == 97 * d + 3 * (weights + 2 * d + 2 * 8) + 3 * d + d  # no wpe; QK-norm; routers; RMSNorm
    assert info["flops_per_token"] == 5 * (2 * weights + 4 * S * d) + 3 * 2 * d
    ks, cands = [16, 10, 5], [16, 16, 10]
    run = 2 * (2 * weights + 4 * S * d) + sum(k / S * 2 * weights + 4 * k * k / S * d for k in ks) \
        + sum(2 * d * c / S for c in cands)
    assert info["executed_flops_per_token"] == round(run)
