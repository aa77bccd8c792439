"""RecurTrace (model.type=recurtrace): loop memory attention against an explicit per-token reference, the oracle's
targets on a hand table and its losses against the full logits' cross-entropy, halting at thresholds 0 and 1, decode
with a cache equal to one pass (fixed depth, and halting at a threshold between 0 and 1), `grt generate`'s batched
loop, the lm-eval adapter, `grt eval`'s halting report, training with the halting loss."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.configs import RecurTraceConfig
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


def attention_by_hand(attn, x, memory, mode="union"):
    """Token t, head h: softmax over [q.k_s for s <= t] + [q.k^(j)_t for earlier iterations j] (union), or the
    causal softmax plus a second softmax over the earlier iterations alone, added (separate); with explicit loops;
    returns the attention output before c_proj's residual add (after c_proj)."""
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
                causal = ([k[b, s, sl] for s in range(t + 1)], [v[b, s, sl] for s in range(t + 1)])
                loop = ([mk[b, h, t] for mk, _ in memory], [mv[b, h, t] for _, mv in memory])
                groups = [(causal[0] + loop[0], causal[1] + loop[1])] if mode == "union" else [causal, loop]
                for keys, vals in groups:
                    if not keys:
                        continue
                    s_ = torch.stack([(q[b, t, sl] * kk).sum() / math.sqrt(hd) for kk in keys])
                    p = torch.softmax(s_, 0)
                    out[b, t, sl] += sum(p[j] * vals[j] for j in range(len(keys)))
    return out @ attn.c_proj.weight.T + attn.c_proj.bias


@pytest.mark.parametrize("mode", ["union", "separate"])
def test_loop_memory_attention_equals_the_per_token_reference(mode):
    m = make(loop_memory=mode)
    attn = m.recur.blocks[0].attn
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    memory = [(torch.randn(2, 2, 5, 8, dtype=torch.float64), torch.randn(2, 2, 5, 8, dtype=torch.float64))
              for _ in range(2)]
    got, _ = attn(x, memory)
    torch.testing.assert_close(got, attention_by_hand(attn, x, memory, mode), rtol=0, atol=1e-12)
    plain, _ = attn(x, [])
    torch.testing.assert_close(plain, attention_by_hand(attn, x, [], mode), rtol=0, atol=1e-12)


def test_oracle_marks_where_one_more_iteration_lowers_the_loss():
    losses = torch.tensor([[3.0, 2.0], [2.5, 2.0], [2.6, 1.0], [2.6, 1.5]])  # 4 iterations x 2 tokens
    assert oracle_targets(losses).tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]


def test_oracle_losses_and_training_loss_equal_cross_entropy_of_the_full_logits():
    """The oracle's per-token losses (fused chunked head) against F.cross_entropy on the full [B, T, V] logits, and
    the training loss against LM CE + halt_coef x BCE(halting logits, targets from those losses), ignored targets
    included."""
    m = make(halt_coef=0.5).train()
    idx, tgt = torch.randint(0, 61, (2, 7)), torch.randint(0, 61, (2, 7))
    tgt[0, 2] = tgt[1, 6] = -1
    states = list(m.iterate(m.encode(idx), 3))
    full_logits = [m.readout(s) @ m.lm_head.weight.T for s in states]
    want = torch.stack([F.cross_entropy(lg.flatten(0, 1), tgt.flatten(), ignore_index=-1, reduction="none")
                        .view_as(tgt) for lg in full_logits]).detach()
    torch.testing.assert_close(m.oracle_losses(states, tgt), want, rtol=0, atol=1e-12)
    valid = tgt >= 0
    halt_logits = torch.stack([m.halt(m.ln_halt(s)).squeeze(-1) for s in states[:2]])
    bce = F.binary_cross_entropy_with_logits(halt_logits[:, valid].float(), (want[1:] < want[:-1])[:, valid].float())
    lm = want[-1][valid].mean()
    torch.testing.assert_close(m(idx, tgt)[1], lm + 0.5 * bce, rtol=0, atol=1e-6)


@pytest.mark.parametrize("grad", [True, False])
def test_fused_mean_loss_hands_over_per_token_losses(grad):
    """ops.linear_cross_entropy(token_losses=buf), what the training loss shares with the oracle: buf = F.cross_entropy
    (reduction='none') of the full logits, the mean and its gradient unchanged, across chunks and ignored targets."""
    from ops import linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(2, 11, 8, dtype=torch.float64, requires_grad=grad)
    w = torch.randn(29, 8, dtype=torch.float64, requires_grad=grad)
    t = torch.randint(0, 29, (2, 11))
    t[0, 3] = t[1, 10] = -1
    with torch.set_grad_enabled(grad):
        buf = torch.full(t.shape, float("nan"), dtype=torch.float64)
        mean = linear_cross_entropy(h, w, t, chunk=4, token_losses=buf)
        plain = linear_cross_entropy(h, w, t, chunk=4)
    ref = F.cross_entropy((h @ w.T).flatten(0, 1), t.flatten(), ignore_index=-1, reduction="none").view_as(t)
    torch.testing.assert_close(buf, ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(mean, plain, rtol=0, atol=0)
    assert not buf.requires_grad
    if grad:
        g = torch.autograd.grad(mean, (h, w))
        torch.testing.assert_close(g, torch.autograd.grad(plain, (h, w)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="token_losses"):
        linear_cross_entropy(h, w, t, reduction="none", token_losses=buf)


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("bias", [0.0, 40.0, -40.0])
def test_threshold_zero_runs_every_loop_and_one_stops_after_the_first(mode, bias):
    """Also with a saturated head (halt bias +-40: P(continue) is exactly 1.0 or 0.0 in floating point), where a test
    on the probability would keep looping at threshold 1 or stop at threshold 0."""
    idx = torch.randint(0, 61, (2, 7))
    never = make(halt_threshold=0.0, halt_mode=mode).eval()
    always = make(halt_threshold=1.0, halt_mode=mode).eval()
    with torch.no_grad():
        never.halt.bias.fill_(bias)
        always.halt.bias.fill_(bias)
    torch.testing.assert_close(never(idx)[0], never(idx, n_steps=3)[0], rtol=0, atol=0)
    assert never.last_mean_loops == 3.0
    torch.testing.assert_close(always(idx)[0], always(idx, n_steps=1)[0], rtol=0, atol=0)
    assert always.last_mean_loops == 1.0


def test_a_token_continues_exactly_when_its_p_continue_reaches_the_threshold():
    """Between 0 and 1 the per-token rule is P(continue) >= threshold, by hand from the sigmoid (float64)."""
    m = make(halt_threshold=0.3).eval()
    logit = torch.linspace(-3, 3, 61, dtype=torch.float64)[None]
    assert torch.equal(m.continues(logit), torch.sigmoid(logit) >= 0.3)


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


def test_halting_decode_with_a_cache_equals_the_full_forward_at_the_same_threshold():
    """A threshold between 0 and 1 (midway between the two middle P(continue) after loops 1 and 2), so tokens stop
    after 1, 2 or 3 loops: a prefill, then one token at a time, must give the full forward's logits and loop counts
    (a stopped token offers its last K/V at later iterations in both). Midway, not the median itself: a token whose
    P is the threshold would stop or go on by the last bit, and the two paths' attention kernels (SDPA over a
    causal prefill vs over a cache) need not agree to the last bit."""
    m = make().eval()
    torch.manual_seed(0)
    idx = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        p = torch.sigmoid(torch.stack([m.halt_logit(s) for s in m.iterate(m.encode(idx), 2)])).flatten().sort().values
        m.cfg.halt_threshold = float(p[len(p) // 2 - 1:len(p) // 2 + 1].mean())
        full = m(idx)[0]
        loops = m.last_loops.clone()
        cache = KVCache(max_len=12)
        got, got_loops = [m(idx[:, :3], cache=cache)[0]], [m.last_loops]
        for t in range(3, 12):
            got.append(m(idx[:, t:t + 1], cache=cache)[0])
            got_loops.append(m.last_loops)
    assert loops.min() == 1 and loops.max() == 3 and len(loops.unique()) == 3  # every depth occurs
    assert torch.equal(torch.cat(got_loops, 1), loops)
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=0, atol=1e-10)


def test_generate_with_halting_equals_uncached_greedy_decoding():
    """`grt generate`'s loop (left-padded batch of prompts of different lengths, KV cache, halting at a threshold
    between 0 and 1) against re-running the whole sequence without a cache for every new token."""
    from pipeline.infer.generate import generate

    m = make().eval()
    m.cfg.halt_threshold = 0.78  # tokens stop after 1, 2 or 3 loops (asserted below)
    prompts = [[5, 17, 3, 44, 9], [30, 2]]
    got = generate(m, prompts, 8, 32).tokens
    loops = []
    with torch.no_grad():
        for p, g in zip(prompts, got):
            seq = list(p)
            for _ in range(8):
                seq.append(m(torch.tensor([seq]))[0][0, -1].argmax().item())
                loops.append(int(m.last_loops[0, -1]))
            assert g == seq[len(p):]
    assert set(loops) == {1, 2, 3}


def test_lm_eval_loglikelihood_equals_the_forward_log_probs_at_n_steps():
    """The lm-eval adapter scores RecurTrace at ``n_steps`` loops (default R) for every token: its log-likelihoods
    against log_softmax of the model's own forward at that depth, by hand."""
    from conftest import tiny_recipe
    from pipeline.config import from_dict
    from pipeline.eval.lm_eval.harness import GRTLM
    from pipeline.tokenize.bpe import gpt2_encoding

    enc = gpt2_encoding()
    cfg = from_dict(tiny_recipe(Path("/tmp"), Path("/tmp"), {**SMALL, "type": "recurtrace", "vocab_size": 50257}))
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    pairs = [("The loop decides", " how far"), ("one two three", " four five")]
    for n_steps in (None, 2):
        lm = GRTLM(model=model, cfg=cfg, n_steps=n_steps, batch_size=2)
        got = lm.loglikelihood([Req(c, t) for c, t in pairs], disable_tqdm=True)
        for (ctx, cont), (ll, greedy) in zip(pairs, got):
            ctx_ids = enc.encode_ordinary(ctx)
            cont_ids = enc.encode_ordinary(ctx + cont)[len(ctx_ids):]
            seq = ctx_ids + cont_ids
            with torch.no_grad():
                logits = model(torch.tensor([seq[:-1]]), n_steps=n_steps or 3)[0][0]
            logp = torch.log_softmax(logits.double(), -1)[len(ctx_ids) - 1:]
            assert ll == pytest.approx(sum(logp[i, t].item() for i, t in enumerate(cont_ids)), abs=1e-4)
            assert greedy == all(logp[i].argmax().item() == t for i, t in enumerate(cont_ids))


def test_eval_report_loss_mean_loops_and_flops_per_threshold(capsys):
    """`grt eval`'s halting report over two batches (the second with ignored targets) against token-weighted sums
    by hand; at thresholds 0 and 1 the closed forms (every loop / one loop); the console line and MLflow names."""
    from pipeline.eval.analyses.methods import method_metrics
    from pipeline.eval.analyses.methods import print_method_report
    from pipeline.eval.analyses.methods import recurtrace_report
    from pipeline.model.recurtrace import RecurTrace

    m = make(halt_threshold=0.78).eval()
    torch.manual_seed(1)
    data = [(torch.randint(0, 61, (2, 9)), torch.randint(0, 61, (2, 9))) for _ in range(2)]
    data[1][1][0, 4:] = -1
    report = recurtrace_report(m, m.cfg, lambda: iter(data), "cpu")
    rows = {r["threshold"]: r for r in report["halting"]}
    assert sorted(rows) == [0.0, 0.25, 0.5, 0.75, 0.78, 1.0] and m.cfg.halt_threshold == 0.78
    for th, row in rows.items():
        loss, loops, flops, n = 0.0, 0.0, 0.0, 0
        with torch.no_grad():
            for x, y in data:
                m.cfg = dataclasses.replace(m.cfg, halt_threshold=th)
                logits = m(x)[0]
                loss += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").item()
                ran = m.last_loops[y >= 0]
                loops += ran.sum().item()
                flops += sum(RecurTrace.flops_per_token(m.cfg, int(k), with_head=True) for k in ran)
                n += int((y >= 0).sum())
        assert row["loss"] == pytest.approx(loss / n, rel=1e-12) and row["mean_loops"] == pytest.approx(loops / n)
        assert row["flops_per_token"] == int(flops / n) and row["recipe"] == (th == 0.78)
    assert rows[0.0]["mean_loops"] == 3 and rows[1.0]["mean_loops"] == 1 and 1 < rows[0.78]["mean_loops"] < 3
    with torch.no_grad():
        for th, k in ((0.0, 3), (1.0, 1)):
            ce = [F.cross_entropy(m(x, n_steps=k)[0].flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
                  for x, y in data]
            assert rows[th]["loss"] == pytest.approx(sum(ce).item() / (2 * 18 - 5), rel=1e-12)
            assert rows[th]["flops_per_token"] == RecurTrace.flops_per_token(m.cfg, k, with_head=True)
    print_method_report({"recurtrace": report})
    out = capsys.readouterr().out
    assert "at most 3 loops; 31 validation tokens" in out and "each token stops once P(continue) < threshold" in out
    line = next(ln for ln in out.splitlines() if "threshold 0.78" in ln)
    assert f"mean loops per token {rows[0.78]['mean_loops']:.2f} of 3" in line and "the recipe's" in line
    metrics = method_metrics({"recurtrace": report})
    assert ({"eval.recurtrace_loss": rows[0.78]["loss"], "eval.recurtrace_mean_loops": rows[0.78]["mean_loops"]},
            0) in metrics
    assert ({"eval.recurtrace_halt_loss": rows[0.25]["loss"],
             "eval.recurtrace_halt_mean_loops": rows[0.25]["mean_loops"]}, 25) in metrics


class Req:  # the part of lm-eval's Instance the adapter reads
    def __init__(self, *args):
        self.args = args


def test_training_flops_add_the_oracles_readouts():
    """3 x the forward (head included) plus, for loops 1..R-1, the coda blocks (24d^2 + 4Sd each) and the head (2dV),
    by hand for 1+1x4+2 at d 16, S 8, V 61."""
    from pipeline.model.recurtrace import RecurTrace

    cfg = RecurTraceConfig(vocab_size=61, block_size=8, d_model=16, n_head=2, n_prelude=1, n_core=1, n_coda=2,
                           n_recurrence=4)
    d, S, V = 16, 8, 61
    readout = 2 * (24 * d * d + 4 * S * d) + 2 * d * V
    assert RecurTrace.training_flops_per_token(cfg, 4) == 3 * RecurTrace.flops_per_token(cfg, 4, with_head=True) \
        + 3 * readout
    assert f"{3 * readout:,} FLOPs/token" in RecurTrace.flops_notes(cfg)[0]


def test_a_head_that_could_not_learn_is_refused():
    """halt_coef 0 (the head's only signal is its BCE: untrained, no gradient, DDP fails) and one loop (nothing for
    the oracle to compare) are recipe errors naming the fix."""
    problems = RecurTraceConfig(halt_coef=0.0, n_recurrence=1).validate()
    assert any(p.startswith("model.halt_coef must be > 0 (default 0.1), got 0.0") for p in problems), problems
    assert any(p.startswith("model.n_recurrence must be >= 2 for recurtrace, got 1") for p in problems), problems


# ---- the llama block (model.block: llama) and document masking
LLAMA = dict(block="llama", bias=False, n_head=4, n_kv_head=2, qk_norm=True, mlp_multiple=16, rope_theta=500.0)


def rotate(z, pos, theta):
    """Rotary of one head's vector z [hd] at position ``pos``: dimension i paired with i + hd/2, in float64."""
    hd = z.shape[-1]
    ang = pos * theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    z1, z2 = z[: hd // 2], z[hd // 2:]
    return torch.cat([z1 * ang.cos() - z2 * ang.sin(), z2 * ang.cos() + z1 * ang.sin()])


def llama_attention_by_hand(attn, x, memory, mode, theta):
    """:func:`attention_by_hand` for the llama projections: QK-norm, q and k rotated at their positions (the loop
    memory holds keys already rotated at the token's own position), query head h reading kv head h // group."""
    B, T, C = x.shape
    H, Hkv = attn.n_head, attn.n_kv_head
    hd, group = C // H, H // Hkv
    q, k, v = x @ attn.q_proj.weight.T, x @ attn.k_proj.weight.T, x @ attn.v_proj.weight.T
    nq = lambda z: z / torch.sqrt(z.pow(2).mean() + 1e-6) * attn.q_norm.weight  # noqa: E731
    nk = lambda z: z / torch.sqrt(z.pow(2).mean() + 1e-6) * attn.k_norm.weight  # noqa: E731
    out = torch.zeros_like(x)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                g = h // group
                qh = rotate(nq(q[b, t, h * hd:(h + 1) * hd]), t, theta)
                kv_sl = slice(g * hd, (g + 1) * hd)
                causal = ([rotate(nk(k[b, s, kv_sl]), s, theta) for s in range(t + 1)],
                          [v[b, s, kv_sl] for s in range(t + 1)])
                loop = ([mk[b, g, t] for mk, _ in memory], [mv[b, g, t] for _, mv in memory])
                groups = [(causal[0] + loop[0], causal[1] + loop[1])] if mode == "union" else [causal, loop]
                for keys, vals in groups:
                    if not keys:
                        continue
                    p = torch.softmax(torch.stack([(qh * kk).sum() / math.sqrt(hd) for kk in keys]), 0)
                    out[b, t, h * hd:(h + 1) * hd] += sum(p[j] * vals[j] for j in range(len(keys)))
    return out @ attn.o_proj.weight.T


@pytest.mark.parametrize("mode", ["union", "separate"])
def test_llama_loop_memory_attention_equals_the_per_token_reference(mode):
    """Tolerance 1e-6: the layout holds the rotary cos/sin in fp32 (as Hugging Face), the reference in float64."""
    from pipeline.model.layers import token_layout

    m = make(loop_memory=mode, **LLAMA)
    attn = m.recur.blocks[0].attn
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    layout = token_layout(m.cfg, torch.zeros(2, 5, dtype=torch.long))
    memory = [(torch.randn(2, 2, 5, 4, dtype=torch.float64), torch.randn(2, 2, 5, 4, dtype=torch.float64))
              for _ in range(2)]
    got, _ = attn(x, memory, layout=layout)
    torch.testing.assert_close(got, llama_attention_by_hand(attn, x, memory, mode, 500.0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["union", "separate"])
def test_llama_decode_with_a_cache_equals_one_full_pass(mode):
    m = make(loop_memory=mode, **LLAMA).eval()
    idx = torch.randint(0, 61, (2, 9))
    full = m(idx, n_steps=3)[0]
    cache = KVCache(max_len=9)
    got = [m(idx[:, :4], n_steps=3, cache=cache)[0]] + [m(idx[:, t:t + 1], n_steps=3, cache=cache)[0]
                                                         for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("block", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["separate", "none"])
def test_document_masked_forward_equals_each_document_alone(block, mode):
    """Positional attention stays inside each document with the loop memory modes that
    tests/test_document_masking.py does not take (it runs union): logits at a fixed depth equal each document
    alone."""
    m = make(loop_memory=mode, **(LLAMA if block == "llama" else {})).eval()
    idx = torch.randint(0, 61, (2, 12))
    docs = torch.tensor([[0] * 4 + [1] * 3 + [2] * 5, [0] * 7 + [1] * 5])
    with torch.no_grad():
        masked = m(idx, n_steps=3, docs=docs)[0]
        for b in range(2):
            for d in docs[b].unique():
                where = (docs[b] == d).nonzero().flatten()
                torch.testing.assert_close(masked[b, where], m(idx[b:b + 1, where], n_steps=3)[0][0], rtol=0,
                                           atol=1e-10)


def test_sequence_halting_takes_its_mean_per_document():
    """halt_mode=sequence with documents: each document stops when its own tokens' mean P(continue) does, so the
    masked forward's loops and logits equal each document run alone; the threshold is midway between two documents'
    mean P after loop 1 (taken from the separate runs), so the documents stop at different loops."""
    m = make(halt_mode="sequence").eval()
    torch.manual_seed(1)
    idx = torch.randint(0, 61, (2, 12))
    docs = torch.tensor([[0] * 4 + [1] * 3 + [2] * 5, [0] * 7 + [1] * 5])
    parts = [(b, (docs[b] == d).nonzero().flatten()) for b in range(2) for d in docs[b].unique()]
    with torch.no_grad():
        means = sorted(float(torch.sigmoid(m.halt_logit(next(m.iterate(m.encode(idx[b:b + 1, w]), 1)))).mean())
                       for b, w in parts)
        m.cfg.halt_threshold = (means[1] + means[2]) / 2
        masked = m(idx, docs=docs)[0]
        loops = m.last_loops.clone()
        for b, w in parts:
            torch.testing.assert_close(masked[b, w], m(idx[b:b + 1, w])[0][0], rtol=0, atol=1e-10)
            assert torch.equal(loops[b, w], m.last_loops[0])
    assert len(loops.unique()) > 1  # the documents did stop at different loops


def test_llama_flops_count_the_llama_blocks():
    """1+1x4+2 with the llama block at d 16, 4 heads, 1 kv head (d_kv 4), f 48, S 8, V 61: per block
    2 x (d(2d + 2 d_kv) + 3df) + 4Sd; the loop memory 4d per earlier iteration per looped layer, the halting
    head 2d per loop; the oracle's readouts coda + head."""
    from pipeline.model.recurtrace import RecurTrace

    cfg = RecurTraceConfig(vocab_size=61, block_size=8, d_model=16, n_head=4, n_prelude=1, n_core=1, n_coda=2,
                           n_recurrence=4, **{**{k: v for k, v in LLAMA.items() if k != "n_head"}, "n_kv_head": 1})
    d, d_kv, f, S, V = 16, 4, 48, 8, 61
    block = 2 * (d * (2 * d + 2 * d_kv) + 3 * d * f) + 4 * S * d
    fwd = 7 * block + 4 * d * (0 + 1 + 2 + 3) + 2 * d * 4 + 2 * d * V
    assert RecurTrace.flops_per_token(cfg, with_head=True) == fwd
    assert RecurTrace.training_flops_per_token(cfg, 4) == 3 * fwd + 3 * (2 * block + 2 * d * V)
