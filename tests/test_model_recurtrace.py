"""RecurTrace (model.type=recurtrace): loop memory attention against an explicit per-token reference, the oracle's
targets on a hand table, halting at thresholds 0 and 1, decode with a cache equal to one pass, training with the
halting loss."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import RecurTraceConfig
from pipeline.model.kv_cache import KVCache
from pipeline.model.recurtrace import oracle_targets
from pipeline.model.registry import build_model

SMALL = dict(vocab_size=61, block_size=32, d_model=16, n_head=2, n_prelude=1, n_core=2, n_coda=1, n_recurrence=3)


def make(**kw):
    torch.manual_seed(0)
    m = build_model(RecurTraceConfig(**{**SMALL, **kw})).double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def attention_by_hand(attn, x, memory):
    """Token t, head h: softmax over [q.k_s for s <= t] + [q.k^(j)_t for earlier iterations j] (union), with
    explicit loops; returns the attention output before c_proj's residual add (after c_proj)."""
    B, T, C = x.shape
    H = attn.n_head
    hd = C // H
    qkv = x @ attn.c_attn.weight.T + attn.c_attn.bias
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    out = torch.zeros_like(x)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                sl = slice(h * hd, (h + 1) * hd)
                keys = [k[b, s, sl] for s in range(t + 1)] + [mk[b, h, t] for mk, _ in memory]
                vals = [v[b, s, sl] for s in range(t + 1)] + [mv[b, h, t] for _, mv in memory]
                s_ = torch.stack([(q[b, t, sl] * kk).sum() / math.sqrt(hd) for kk in keys])
                p = torch.softmax(s_, 0)
                out[b, t, sl] = sum(p[j] * vals[j] for j in range(len(keys)))
    return out @ attn.c_proj.weight.T + attn.c_proj.bias


def test_loop_memory_attention_equals_the_per_token_reference():
    m = make()
    attn = m.recur.blocks[0].attn
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    memory = [(torch.randn(2, 2, 5, 8, dtype=torch.float64), torch.randn(2, 2, 5, 8, dtype=torch.float64))
              for _ in range(2)]
    got, _ = attn(x, memory)
    torch.testing.assert_close(got, attention_by_hand(attn, x, memory), rtol=0, atol=1e-12)
    plain, _ = attn(x, [])
    torch.testing.assert_close(plain, attention_by_hand(attn, x, []), rtol=0, atol=1e-12)


def test_oracle_marks_where_one_more_iteration_lowers_the_loss():
    losses = torch.tensor([[3.0, 2.0], [2.5, 2.0], [2.6, 1.0], [2.6, 1.5]])  # 4 iterations x 2 tokens
    assert oracle_targets(losses).tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_threshold_zero_runs_every_loop_and_one_stops_after_the_first(mode):
    idx = torch.randint(0, 61, (2, 7))
    never = make(halt_threshold=0.0, halt_mode=mode).eval()
    torch.testing.assert_close(never(idx)[0], never(idx, n_steps=3)[0], rtol=0, atol=0)
    assert never.last_mean_loops == 3.0
    always = make(halt_threshold=1.0, halt_mode=mode).eval()
    torch.testing.assert_close(always(idx)[0], always(idx, n_steps=1)[0], rtol=0, atol=0)
    assert always.last_mean_loops == 1.0


def test_decode_with_a_cache_equals_one_full_pass():
    m = make().eval()
    idx = torch.randint(0, 61, (2, 9))
    full = m(idx, n_steps=3)[0]
    cache = KVCache(max_len=9)
    got = [m(idx[:, :4], n_steps=3, cache=cache)[0]] + [m(idx[:, t:t + 1], n_steps=3, cache=cache)[0]
                                                         for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=0, atol=1e-10)


def test_training_loss_adds_the_halting_bce_and_trains_the_head_only_through_it():
    m = make(halt_coef=0.5).train()
    idx, tgt = torch.randint(0, 61, (2, 7)), torch.randint(0, 61, (2, 7))
    loss = m(idx, tgt)[1]
    loss.backward()
    assert m.halt.weight.grad is not None and m.halt.weight.grad.abs().sum() > 0
    m0 = make(halt_coef=0.0).train()
    lm = m0(idx, tgt)[1]
    assert loss.item() > lm.item()  # BCE > 0 added
    m0.zero_grad()
    lm.backward()
    torch.testing.assert_close(m0.recur.blocks[0].mlp.c_fc.weight.grad, m.recur.blocks[0].mlp.c_fc.weight.grad)
