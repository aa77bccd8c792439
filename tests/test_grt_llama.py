"""GRT with the Llama-style block (``model.block: llama``, grouped-query attention, QK-norm) against the paper's step
equations written by hand from the parameter tensors (float64 plain tensor ops, no model code): RMSNorm, rotary
positions (restarting at each document under document masking), SwiGLU and GQA, at every exit depth."""
import math

import pytest
import torch

from pipeline.model import build_model
from pipeline.model.configs import GRTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops run faster on one thread

V, D, H, KV, THETA = 61, 32, 4, 2, 500.0
CFG = dict(vocab_size=V, vocab_multiple=32, block_size=24, d_model=D, n_head=H, n_prelude=1, n_core=2, n_coda=1,
           n_recurrence=3, block="llama", bias=False, n_kv_head=KV, qk_norm=True, mlp_multiple=16, rope_theta=THETA)


# ------------------------------------------------------------------------------ an independent, by-hand reference
def rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ln(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps) * w
    return y + b if b is not None else y


def linear(x, layer):
    y = x @ layer.weight.T
    return y + layer.bias if layer.bias is not None else y


def silu(x):
    return x / (1 + torch.exp(-x))


def positions_of(docs):
    """Each token's position in its own document: the count of earlier tokens of that document in the window."""
    B, T = docs.shape
    return torch.tensor([[sum(int(docs[b, s] == docs[b, t]) for s in range(t)) for t in range(T)] for b in range(B)])


def rotate(x, pos):
    """x [B, heads, T, hd] rotated by the angles pos * theta^(-2i/hd), pairing dimension i with i + hd/2."""
    hd = x.shape[-1]
    half = hd // 2
    freq = torch.tensor([THETA ** (-2 * i / hd) for i in range(half)], dtype=torch.float64)
    ang = pos[:, None, :, None].double() * freq
    # cos and sin held in fp32, as Hugging Face's rotary embedding holds them (the only fp32 rounding in the model)
    c, s = torch.cos(ang).float().double(), torch.sin(ang).float().double()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def block(blk, x, pos, docs):
    """x + o_proj(softmax(q k^T / sqrt(hd) + mask) v), then + down(silu(gate n) * up n); query head h reads key/value
    head h // (H / KV); query t sees keys s <= t of its own document."""
    B, T, _ = x.shape
    hd, a = D // H, blk.attn
    n1 = rms(x, blk.ln_1.weight)
    q = linear(n1, a.q_proj).reshape(B, T, H, hd).permute(0, 2, 1, 3)
    k = linear(n1, a.k_proj).reshape(B, T, KV, hd).permute(0, 2, 1, 3)
    v = linear(n1, a.v_proj).reshape(B, T, KV, hd).permute(0, 2, 1, 3)
    q, k = rms(q, a.q_norm.weight), rms(k, a.k_norm.weight)  # QK-norm, before the rotation
    q, k = rotate(q, pos), rotate(k, pos)
    group = H // KV
    k, v = (torch.stack([t[:, h // group] for h in range(H)], 1) for t in (k, v))
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None] & (docs[:, :, None] == docs[:, None, :])
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~allowed[:, None], float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    y = (p / p.sum(-1, keepdim=True)) @ v
    x = x + linear(y.permute(0, 2, 1, 3).reshape(B, T, D), a.o_proj)
    n2 = rms(x, blk.ln_2.weight)
    m = blk.mlp
    return x + linear(silu(linear(n2, m.gate_proj)) * linear(n2, m.up_proj), m.down_proj)


def grt_step(m, h, h_pre, pos, docs):
    """h~ = W_proj([h + eps_x, h_pre]); o = core(h~); g = sigmoid(f_g([LN h, LN h_pre]) / tau + eps_g);
    h' = g h + (1 - g) o, with eps_x = eps_g = 0 (evaluation)."""
    rs = m.recur
    o = linear(torch.cat([h, h_pre], -1), rs.proj)
    for b in rs.blocks:
        o = block(b, o, pos, docs)
    gt = rs.gate
    u = torch.cat([ln(h, gt.ln_h.weight, gt.ln_h.bias), ln(h_pre, gt.ln_pre.weight, gt.ln_pre.bias)], -1)
    z = linear(silu(linear(u, gt.fc1)), gt.fc2)
    g = 1 / (1 + torch.exp(-z / m.cfg.tau))
    return g * h + (1 - g) * o


def reference(m, idx, docs, depth):
    """The final-normed states after the coda at every exit 0..depth, and the logits at ``depth``."""
    pos = positions_of(docs)
    h_pre = m.embed.wte.weight[idx]  # no learned positions: rotary only
    for b in m.prelude:
        h_pre = block(b, h_pre, pos, docs)
    h, states = h_pre, []  # h^(0) = h_pre (Algorithm 1)
    for r in range(depth + 1):
        if r > 0:
            h = grt_step(m, h, h_pre, pos, docs)
        x = h
        for b in m.coda:
            x = block(b, x, pos, docs)
        states.append(rms(x, m.ln_f.weight))
    return states, states[-1] @ m.embed.wte.weight[:V].T  # tied head over the real vocabulary only


# ---------------------------------------------------------------------------------------------------------- tests
def llama_grt(**kw):
    cfg = GRTConfig(**{**CFG, **kw})
    assert not cfg.validate(), cfg.validate()
    m = build_model(cfg, seed=1).double()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # off the init: gate away from saturation, norms' weights away from 1
        m.recur.gate.fc2.bias.normal_(0.0, 1.0, generator=gen)
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return m.eval()


def window():
    """Two rows of 24 tokens; with documents, row 0 holds three (lengths 7, 9, 8) and row 1 two (10, 14)."""
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(3))
    docs = torch.tensor([[0] * 7 + [1] * 9 + [2] * 8, [0] * 10 + [1] * 14])
    return idx, docs


@pytest.mark.parametrize("documents", [False, True])
def test_llama_grt_matches_the_hand_written_step_equations_at_every_exit(documents):
    m = llama_grt()
    assert m.recur.blocks[0].attn.k_proj.out_features == KV * (D // H)  # GQA: fewer key/value heads
    assert m.embed.wte.weight.shape[0] == 64  # the padded vocabulary
    idx, docs = window()
    depth = 5  # beyond the trained R = 3 too
    want, want_logits = reference(m, idx, docs if documents else torch.zeros_like(docs), depth)
    kw = dict(docs=docs) if documents else {}
    with torch.no_grad():
        got = dict(m.exit_states(idx, list(range(depth + 1)), **kw))
        logits, _ = m(idx, n_steps=depth, **kw)
    for r in range(depth + 1):
        torch.testing.assert_close(got[r], want[r], rtol=1e-10, atol=1e-10, msg=lambda s: f"exit {r}: {s}")
    torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-9)
    assert (want[depth] - want[1]).abs().max() > 1e-2  # the steps really change the state


def test_llama_grt_loss_and_gradients_flow_with_documents():
    """The loss at each depth is the reference's cross-entropy, and every parameter gets a gradient."""
    m = llama_grt()
    idx, docs = window()
    targets = torch.roll(idx, -1, dims=1)
    _, want_logits = reference(m, idx, docs, 3)
    want = torch.nn.functional.cross_entropy(want_logits.reshape(-1, V), targets.reshape(-1))
    _, loss = m(idx, targets, docs=docs)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in m.parameters())


def test_hyper_connected_llama_core_at_init_is_the_plain_llama_core():
    """Hyper-connections around the llama block: at Eq. 14's init (all streams equal) the core is the plain one, so
    the same block weights give the same exit states, with documents too."""
    cfg = {k: v for k, v in CFG.items()}
    plain = build_model(GRTConfig(**cfg), seed=1).double().eval()
    hyper = build_model(GRTConfig(**cfg, hyper_streams=2), seed=1).double().eval()
    idx, docs = window()
    with torch.no_grad():
        a = dict(plain.exit_states(idx, [1, 3], docs=docs))
        b = dict(hyper.exit_states(idx, [1, 3], docs=docs))
    for r in (1, 3):
        torch.testing.assert_close(b[r], a[r], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_hyper_connected_core_off_init_keeps_each_document_to_itself(block):
    """The hyper-connected core (random A_m, A_r, B: streams differ) under document masking: each document's exit
    states equal that document run alone, at every exit."""
    cfg = CFG if block == "llama" else {k: CFG[k] for k in ("vocab_size", "block_size", "d_model", "n_head",
                                                           "n_prelude", "n_core", "n_coda", "n_recurrence")}
    m = build_model(GRTConfig(**cfg, hyper_streams=2), seed=1).double().eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".hc_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    idx, docs = window()
    exits = [0, 1, 2, 3]
    with torch.no_grad():
        masked = dict(m.exit_states(idx, exits, docs=docs))
        for b in range(2):
            for d in docs[b].unique().tolist():
                where = (docs[b] == d).nonzero().flatten()
                alone = dict(m.exit_states(idx[b:b + 1, where], exits))
                for e in exits:
                    torch.testing.assert_close(masked[e][b, where], alone[e][0], rtol=0, atol=1e-10)
