"""The Recurrent Transformer (model.type=recurrent_transformer): the model against a hand-written token-by-token
loop of its definition, tiled prefill equal to the reference in outputs and gradients, decode with a KV cache equal
to one full pass, the parameter count of GPT-2 with the same layers, and the own_key switch."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.configs import RecurrentTransformerConfig
from pipeline.model.kv_cache import KVCache
from pipeline.model.registry import build_model
from pipeline.model.registry import count_params

SMALL = dict(vocab_size=61, block_size=32, d_model=16, n_head=2, n_layer=2)


def make(**kw):
    torch.manual_seed(0)
    m = build_model(RecurrentTransformerConfig(**{**SMALL, **kw})).double()
    with torch.no_grad():  # no zero biases or unit LN weights: every term of the definition must matter
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def by_hand(m, idx, own_key=True):
    """Logits of the definition, position by position and layer by layer, with explicit heads and softmax."""
    cfg = m.cfg
    C, H = cfg.d_model, cfg.n_head
    hd = C // H
    x = m.embed.wte.weight[idx] + m.embed.wpe.weight[: idx.shape[1]]
    for blk in m.blocks:
        W, b = blk.c_attn.weight, blk.c_attn.bias
        ln1 = lambda z: F.layer_norm(z, (C,), blk.ln_1.weight, blk.ln_1.bias, 1e-5)  # noqa: E731
        ln2 = lambda z: F.layer_norm(z, (C,), blk.ln_2.weight, blk.ln_2.bias, 1e-5)  # noqa: E731
        mem_k, mem_v, ys = [], [], []
        for t in range(idx.shape[1]):
            qkv = ln1(x[:, t]) @ W.T + b
            q, k, v = qkv[:, :C], qkv[:, C:2 * C], qkv[:, 2 * C:]
            keys = ([k] if own_key else []) + mem_k
            vals = ([v] if own_key else []) + mem_v
            heads = []
            for h in range(H):
                sl = slice(h * hd, (h + 1) * hd)
                if not keys:
                    heads.append(torch.zeros_like(q[:, sl]))
                    continue
                s = torch.stack([(q[:, sl] * kk[:, sl]).sum(-1) / math.sqrt(hd) for kk in keys], -1)
                p = torch.softmax(s, -1)
                heads.append(sum(p[:, j:j + 1] * vals[j][:, sl] for j in range(len(keys))))
            a = torch.cat(heads, -1) @ blk.c_proj.weight.T + blk.c_proj.bias
            y = x[:, t] + a
            y = y + (F.gelu(ln2(y) @ blk.mlp.c_fc.weight.T + blk.mlp.c_fc.bias) @ blk.mlp.c_proj.weight.T
                     + blk.mlp.c_proj.bias)
            mk = ln1(y) @ W[C:].T + b[C:]
            mem_k.append(mk[:, :C]), mem_v.append(mk[:, C:])
            ys.append(y)
        x = torch.stack(ys, 1)
    h = F.layer_norm(x, (C,), m.ln_f.weight, m.ln_f.bias, 1e-5)
    return h @ m.embed.wte.weight.T


@pytest.mark.parametrize("prefill,tile", [("reference", 64), ("tiled", 1), ("tiled", 4), ("tiled", 64)])
@pytest.mark.parametrize("own_key", ["input", "none"])
def test_logits_equal_the_hand_written_definition(prefill, tile, own_key):
    m = make(prefill=prefill, tile=tile, own_key=own_key)
    idx = torch.randint(0, 61, (2, 11))
    logits, _ = m(idx)
    torch.testing.assert_close(logits, by_hand(m, idx, own_key == "input"), rtol=0, atol=1e-10)


def test_tiled_and_reference_give_the_same_loss_and_gradients():
    a, b = make(prefill="reference"), make(prefill="tiled", tile=3)
    idx, tgt = torch.randint(0, 61, (2, 20)), torch.randint(0, 61, (2, 20))
    la, lb = a(idx, tgt)[1], b(idx, tgt)[1]
    la.backward(), lb.backward()
    assert abs(la.item() - lb.item()) < 1e-12
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-11, msg=n)


def test_a_position_reads_the_layers_earlier_outputs():
    """What separates it from GPT-2: changing a later layer's output at position 0 (through its MLP) changes what
    position 1 attends to in that same layer; in GPT-2 position 1 of layer l reads only layer l's inputs."""
    m = make()
    idx = torch.randint(0, 61, (1, 4))
    before = m(idx)[0]
    with torch.no_grad():
        m.blocks[1].mlp.c_fc.bias[0] += 3.0  # changes layer 2's outputs, not its inputs
    after = m(idx)[0]
    assert not torch.allclose(before[0, 1], after[0, 1])


@pytest.mark.parametrize("prefill", ["tiled", "reference"])
def test_decode_with_a_cache_equals_one_full_pass(prefill):
    m = make(prefill=prefill, tile=2).eval()
    idx = torch.randint(0, 61, (2, 12))
    full = m(idx)[0]
    cache = KVCache(max_len=12)
    got = [m(idx[:, :5], cache=cache)[0]]
    for t in range(5, 12):
        got.append(m(idx[:, t:t + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=0, atol=1e-10)
    assert cache.n_layer_caches() == SMALL["n_layer"]  # one memory per layer: a standard transformer's decode cost


def test_parameters_equal_gpt2_with_the_same_layers():
    from pipeline.model.configs import GPTConfig

    rt = count_params(build_model(RecurrentTransformerConfig(**SMALL), device="meta"))
    gpt = count_params(build_model(GPTConfig(**SMALL), device="meta"))
    assert rt == gpt


def test_left_padded_batched_generation_equals_each_prompt_alone():
    """Prompts of 7, 2 and 4 tokens in one left-padded batch: a pad is nobody's memory key, so each row decodes
    what it decodes alone (greedy, float64)."""
    from pipeline.infer.generate import generate

    m = make().eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    batch = generate(m, prompts, 10, SMALL["block_size"]).tokens
    assert batch == [generate(m, [p], 10, SMALL["block_size"]).tokens[0] for p in prompts]


def test_compile_compiles_the_mlp_once_and_keeps_the_position_loop_eager():
    """train.compile on a self-KV block compiles its MLP (one graph for every layer and sequence length: each
    position runs it on [B, 1, C]) and runs the loop over positions eagerly; losses equal the uncompiled model's."""
    from pipeline.train.parallelize import apply_compile
    from pipeline.train.parallelize import compile_targets

    m, ref = make(), make()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    apply_compile(m, backend=recording_backend)
    assert [type(t).__name__ for t in compile_targets(m)] == ["MLP"] * SMALL["n_layer"]
    idx, tgt = torch.randint(0, 61, (2, 20)), torch.randint(0, 61, (2, 20))
    for T in (20, 12, 5):
        assert m(idx[:, :T], tgt[:, :T])[1].item() == ref(idx[:, :T], tgt[:, :T])[1].item()
    assert len(graphs) == 1


def test_flops_count_the_memory_key_value_projection():
    """Per layer GPT-2's 24d^2 + 4Sd plus the memory keys/values of the layer's output (2 x 2d^2), plus the head's
    2dV, by hand at 3 layers, d 16, S 8, V 50; an exit after layer 2 counts 2 layers."""
    from pipeline.model.configs import RecurrentTransformerConfig
    from pipeline.model.recurrent_transformer import RecurrentTransformer

    cfg = RecurrentTransformerConfig(vocab_size=50, block_size=8, d_model=16, n_head=2, n_layer=3)
    layer = 24 * 16 * 16 + 4 * 8 * 16 + 4 * 16 * 16
    assert RecurrentTransformer.flops_per_token(cfg, with_head=True) == 3 * layer + 2 * 16 * 50
    assert RecurrentTransformer.flops_per_token(cfg, 2) == 2 * layer


# ---- the llama block (model.block: llama): RMSNorm, rotary, grouped-query heads, QK-norm, SwiGLU
LLAMA = dict(block="llama", bias=False, n_head=4, n_kv_head=2, qk_norm=True, mlp_multiple=16, rope_theta=500.0)


def rms(z, w):
    return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rotate(z, pos, theta):
    """Rotary of one head's vector z [B, hd] at position ``pos``: dimension i paired with i + hd/2, in float64."""
    hd = z.shape[-1]
    ang = pos * theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    z1, z2 = z[..., : hd // 2], z[..., hd // 2:]
    return torch.cat([z1 * ang.cos() - z2 * ang.sin(), z2 * ang.cos() + z1 * ang.sin()], -1)


def by_hand_llama(m, idx, own_key=True):
    """Logits of the llama self-KV definition: query of the input at t, own key/value of the input at t, memory
    keys/values of the layer's outputs at s < t, each key rotated by its own position, query head h reading kv
    head h // (H / H_kv); explicit loops."""
    cfg = m.cfg
    C, H, Hkv = cfg.d_model, cfg.n_head, cfg.n_kv_head
    hd, group = C // H, H // Hkv
    x = m.embed.wte.weight[idx]
    for blk in m.blocks:
        a = blk.attn

        def keyval(z, pos):
            n = rms(z, blk.ln_1.weight)
            k = [rotate(rms(kk, a.k_norm.weight), pos, cfg.rope_theta) for kk in (n @ a.k_proj.weight.T).split(hd, -1)]
            return k, list((n @ a.v_proj.weight.T).split(hd, -1))

        mem, ys = [], []
        for t in range(idx.shape[1]):
            n = rms(x[:, t], blk.ln_1.weight)
            qs = [rotate(rms(qq, a.q_norm.weight), t, cfg.rope_theta) for qq in (n @ a.q_proj.weight.T).split(hd, -1)]
            keys = ([keyval(x[:, t], t)] if own_key else []) + mem
            heads = []
            for h in range(H):
                if not keys:
                    heads.append(torch.zeros_like(qs[h]))
                    continue
                s = torch.stack([(qs[h] * k[h // group]).sum(-1) / math.sqrt(hd) for k, _ in keys], -1)
                p = torch.softmax(s, -1)
                heads.append(sum(p[:, j:j + 1] * keys[j][1][h // group] for j in range(len(keys))))
            y = x[:, t] + torch.cat(heads, -1) @ a.o_proj.weight.T
            n2 = rms(y, blk.ln_2.weight)
            f = blk.mlp
            y = y + (F.silu(n2 @ f.gate_proj.weight.T) * (n2 @ f.up_proj.weight.T)) @ f.down_proj.weight.T
            mem.append(keyval(y, t))
            ys.append(y)
        x = torch.stack(ys, 1)
    return rms(x, m.ln_f.weight) @ m.embed.wte.weight.T


@pytest.mark.parametrize("prefill,tile", [("reference", 64), ("tiled", 3)])
@pytest.mark.parametrize("own_key", ["input", "none"])
def test_llama_logits_equal_the_hand_written_definition(prefill, tile, own_key):
    """Tolerance 1e-6: the layout holds the rotary cos/sin in fp32 (as Hugging Face), the reference in float64."""
    m = make(prefill=prefill, tile=tile, own_key=own_key, **LLAMA)
    idx = torch.randint(0, 61, (2, 11))
    logits, _ = m(idx)
    torch.testing.assert_close(logits, by_hand_llama(m, idx, own_key == "input"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("prefill", ["tiled", "reference"])
def test_llama_decode_with_a_cache_equals_one_full_pass(prefill):
    """The cache holds the n_kv_head heads of each token's memory keys (rotated at their positions) and values."""
    m = make(prefill=prefill, tile=2, **LLAMA).eval()
    idx = torch.randint(0, 61, (2, 12))
    full = m(idx)[0]
    cache = KVCache(max_len=12)
    got = [m(idx[:, :5], cache=cache)[0]] + [m(idx[:, t:t + 1], cache=cache)[0] for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("block", ["gpt2", "llama"])
@pytest.mark.parametrize("prefill,own_key", [("reference", "input"), ("tiled", "none")])
def test_document_masked_memory_equals_each_document_alone(block, prefill, own_key):
    """The self-KV memory stays inside each document: masked logits equal each document run alone, with the
    prefill and own_key that tests/test_document_masking.py does not take (tile 3: cross-tile and in-tile keys)."""
    m = make(prefill=prefill, tile=3, own_key=own_key, **(LLAMA if block == "llama" else {})).eval()
    idx = torch.randint(0, 61, (2, 14))
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 5, [0] * 9 + [1] * 5])
    with torch.no_grad():
        masked = m(idx, docs=docs)[0]
        for b in range(2):
            for d in docs[b].unique():
                where = (docs[b] == d).nonzero().flatten()
                alone = m(idx[b:b + 1, where])[0]
                torch.testing.assert_close(masked[b, where], alone[0], rtol=0, atol=1e-10)


def test_llama_flops_and_parameters_count_the_grouped_memory_projections():
    """Per layer the llama block's 2 x (d(2d + 2 d_kv) + 3df) + 4Sd plus its memory keys/values 2 x 2 d d_kv, by
    hand at d 16, 4 heads, 1 kv head (d_kv 4), f 48 (8/3 d rounded up to 16), S 8; the parameters equal the dense
    llama model's."""
    from pipeline.model.configs import GPTConfig
    from pipeline.model.recurrent_transformer import RecurrentTransformer

    shape = {**SMALL, "block_size": 8, "vocab_size": 50, **LLAMA, "n_kv_head": 1}
    cfg = RecurrentTransformerConfig(**shape)
    d, d_kv, f = 16, 4, 48
    layer = 2 * (d * (2 * d + 2 * d_kv) + 3 * d * f) + 4 * 8 * d + 4 * d * d_kv
    assert RecurrentTransformer.flops_per_token(cfg, with_head=True) == 2 * layer + 2 * d * 50
    assert f"+{2 * 4 * d * d_kv:,} FLOPs/token" in RecurrentTransformer.flops_notes(cfg)[0]
    dense = GPTConfig(**shape)
    assert count_params(build_model(cfg, device="meta")) == count_params(build_model(dense, device="meta"))
