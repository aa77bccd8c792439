"""The llama block (``model.block: llama``) against hand-written references: rotary positions as complex
multiplication, grouped-query attention as plain multi-head attention with repeated key/value heads, RMSNorm, the
SwiGLU MLP and its hidden-size rule, the dense model's parameter count, and the padded vocabulary that never shows
in a prediction. Every reference here is plain tensor code, none calls the module under test."""
import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.infer.early_exit import EarlyExit
from pipeline.infer.generate import generate
from pipeline.model import build_model
from pipeline.model.configs import MODEL_CONFIGS
from pipeline.model.configs import GPTConfig
from pipeline.model.configs import swiglu_hidden
from pipeline.model.layers import transformer_block
from pipeline.model.layout import TokenLayout
from pipeline.model.llama import LlamaAttention
from pipeline.model.llama import RMSNorm
from pipeline.model.llama import apply_rotary
from pipeline.model.registry import count_params

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops run faster on one thread

LLAMA = dict(block="llama", bias=False, mlp_multiple=16)


def rotate_by_hand(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, H, T, hd] rotated as complex numbers: pair (i, i + hd/2) is z_i = x_i + j x_{i+hd/2}, multiplied by
    exp(j p theta^(-2i/hd)) at position p (Hugging Face Llama's half-split layout)."""
    hd = x.shape[-1]
    half = hd // 2
    freqs = torch.tensor([theta ** (-2 * i / hd) for i in range(half)], dtype=torch.float64)
    angle = positions.to(torch.float64)[:, None, :, None] * freqs  # [B, 1, T, hd/2]
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def attention_by_hand(attn: LlamaAttention, x: torch.Tensor, positions: torch.Tensor, theta: float,
                      docs: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head attention written out: every query head h reads key/value head h // (n_head / n_kv_head) (the
    K/V heads repeated), QK-norm over each head, the rotation by hand, a causal (within-document) softmax."""
    B, T, _ = x.shape
    H, Hkv, hd = attn.n_head, attn.n_kv_head, attn.head_dim
    q = (x @ attn.q_proj.weight.T).view(B, T, H, hd).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(B, T, Hkv, hd).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(B, T, Hkv, hd).transpose(1, 2)
    if attn.q_norm is not None:
        q = rms_by_hand(q, attn.q_norm.weight)
        k = rms_by_hand(k, attn.k_norm.weight)
    q, k = rotate_by_hand(q, positions, theta), rotate_by_hand(k, positions, theta)
    k = torch.stack([k[:, h // (H // Hkv)] for h in range(H)], dim=1)  # repeated K/V heads
    v = torch.stack([v[:, h // (H // Hkv)] for h in range(H)], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    if docs is not None:
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    y = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ v
    return y.transpose(1, 2).reshape(B, T, H * hd) @ attn.o_proj.weight.T


def rms_by_hand(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def moved(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """float64, every parameter (norm weights included) moved off its init so that each one matters."""
    torch.manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return module


# ------------------------------------------------------------------------------------------------- rotary positions
def test_rope_equals_complex_multiplication_at_restarting_and_left_padded_positions():
    B, H, T, hd, theta = 2, 3, 9, 8, 500.0
    x = torch.randn(B, H, T, hd, dtype=torch.float64)
    idx = torch.zeros(B, T, dtype=torch.long)
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2, 3]])
    layout = TokenLayout.build(idx, docs=docs, rope=(hd, theta))
    want_pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 0, 0]])
    assert torch.equal(layout.positions, want_pos)
    torch.testing.assert_close(apply_rotary(x, layout.rope.cos, layout.rope.sin), rotate_by_hand(x, want_pos, theta),
                               rtol=1e-6, atol=1e-6)  # the angles are held in fp32
    # a left-padded batch (per-row start, negative over the pads) and a cached decode (start = tokens cached)
    start = torch.tensor([-3, 0])
    layout = TokenLayout.build(idx, start=start, rope=(hd, theta))
    want_pos = (start[:, None] + torch.arange(T)).clamp(min=0)
    torch.testing.assert_close(apply_rotary(x, layout.rope.cos, layout.rope.sin), rotate_by_hand(x, want_pos, theta),
                               rtol=1e-6, atol=1e-6)
    layout = TokenLayout.build(idx[:, :1], start=41, rope=(hd, theta))
    torch.testing.assert_close(apply_rotary(x[:, :, :1], layout.rope.cos, layout.rope.sin),
                               rotate_by_hand(x[:, :, :1], torch.full((B, 1), 41), theta), rtol=1e-6, atol=1e-6)


def test_rope_makes_scores_depend_on_the_offset_only():
    """The property RoPE exists for: <R(p) q, R(p') k> depends on p - p' alone."""
    hd = 16
    q, k = torch.randn(1, 1, 1, hd, dtype=torch.float64), torch.randn(1, 1, 1, hd, dtype=torch.float64)

    def score(p, pk):
        rq = TokenLayout.build(torch.zeros(1, 1, dtype=torch.long), start=p, rope=(hd, 10000.0)).rope
        rk = TokenLayout.build(torch.zeros(1, 1, dtype=torch.long), start=pk, rope=(hd, 10000.0)).rope
        return (apply_rotary(q, rq.cos, rq.sin) * apply_rotary(k, rk.cos, rk.sin)).sum().item()

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


# --------------------------------------------------------------------------------------- grouped-query attention
@pytest.mark.parametrize("n_kv_head,qk_norm", [(4, False), (2, False), (1, False), (2, True)],
                         ids=["mha", "gqa2", "mqa", "gqa2-qknorm"])
def test_attention_equals_mha_with_repeated_kv_heads_written_by_hand(n_kv_head, qk_norm):
    B, T, d, H, theta = 2, 10, 32, 4, 10000.0
    attn = moved(LlamaAttention(d, H, n_kv_head, 0.0, qk_norm)).eval()
    assert attn.k_proj.out_features == n_kv_head * d // H  # only n_kv_head key/value heads are computed
    x = torch.randn(B, T, d, dtype=torch.float64)
    layout = TokenLayout.build(x[..., 0].long(), rope=(d // H, theta))
    torch.testing.assert_close(attn(x, layout=layout),
                               attention_by_hand(attn, x, torch.arange(T).expand(B, T), theta),
                               rtol=1e-6, atol=1e-6)
    docs = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    layout = TokenLayout.build(x[..., 0].long(), docs=docs, rope=(d // H, theta))
    torch.testing.assert_close(attn(x, layout=layout),
                               attention_by_hand(attn, x, layout.positions, theta, docs), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------- RMSNorm, SwiGLU
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rmsnorm_by_hand(dtype):
    norm = moved(RMSNorm(24)).to(dtype)
    x = 3.0 * torch.randn(5, 7, 24, dtype=dtype)
    torch.testing.assert_close(norm(x), rms_by_hand(x.double(), norm.weight.double()).to(dtype))


def test_swiglu_hidden_size_rule_and_forward_by_hand():
    assert swiglu_hidden(4096, 8 / 3, 256) == 11008  # Llama 7B
    assert swiglu_hidden(2048, 8 / 3, 256) == 5632  # TinyLlama 1.1B
    assert swiglu_hidden(768, 4.0, 1) == 3072
    with torch.device("meta"):
        block = transformer_block(GPTConfig(d_model=4096, n_head=32, **LLAMA | {"mlp_multiple": 256}))
    assert (block.mlp.gate_proj.out_features, block.mlp.up_proj.out_features, block.mlp.down_proj.in_features) == (
        11008, 11008, 11008)
    cfg = GPTConfig(d_model=32, n_head=4, mlp_ratio=3.0, **LLAMA)
    mlp = moved(transformer_block(cfg).mlp)
    assert mlp.gate_proj.out_features == 96
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    g, u = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    torch.testing.assert_close(mlp(x), (g * torch.sigmoid(g) * u) @ mlp.down_proj.weight.T)


def test_block_equals_its_equations_by_hand():
    cfg = GPTConfig(d_model=32, n_head=4, n_kv_head=2, qk_norm=True, rope_theta=1000.0, **LLAMA)
    block = moved(transformer_block(cfg)).eval()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    layout = TokenLayout.build(x[..., 0].long(), rope=(8, 1000.0))
    h = x + attention_by_hand(block.attn, rms_by_hand(x, block.ln_1.weight), torch.arange(6).expand(2, 6), 1000.0)
    n2 = rms_by_hand(h, block.ln_2.weight)
    mlp = block.mlp
    want = h + (F.silu(n2 @ mlp.gate_proj.weight.T) * (n2 @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    torch.testing.assert_close(block(x, layout=layout), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- the dense model
@pytest.mark.parametrize("n_kv_head,qk_norm,vocab_multiple", [(None, False, 1), (2, True, 128)])
def test_dense_llama_param_count_equals_the_formula(n_kv_head, qk_norm, vocab_multiple):
    d, H, L, V = 64, 8, 3, 1000
    cfg = GPTConfig(vocab_size=V, d_model=d, n_head=H, n_layer=L, n_kv_head=n_kv_head, qk_norm=qk_norm,
                    vocab_multiple=vocab_multiple, **LLAMA)
    hd, kv = d // H, n_kv_head or H
    f = 16 * math.ceil(8 / 3 * d / 16)  # 176
    rows = -(-V // vocab_multiple) * vocab_multiple
    per_block = d * H * hd + 2 * d * kv * hd + H * hd * d + 3 * d * f + 2 * d + (2 * hd if qk_norm else 0)
    want = rows * d + L * per_block + d  # tied embedding/head (no position embeddings), blocks, final RMSNorm
    counted = count_params(build_model(cfg, device="meta"))
    assert counted == {"params": want, "params_without_position": want}


def test_padded_vocabulary_never_shows_in_logits_loss_or_sampling():
    V = 50
    cfg = GPTConfig(vocab_size=V, vocab_multiple=128, block_size=32, d_model=32, n_head=4, n_layer=2, **LLAMA)
    model = build_model(cfg, seed=0).double().eval()
    assert model.embed.wte.weight.shape[0] == 128
    with torch.no_grad():  # padding rows that would win every argmax and take the softmax if the head read them
        model.embed.wte.weight[V:] = 100.0 * model.ln_f.weight
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(idx)[0]
        assert logits.shape[-1] == V
        want = model.lm_head.weight[:V] @ model.ln_f(hidden_of(model, idx)).transpose(1, 2)
        torch.testing.assert_close(logits, want.transpose(1, 2))
        targets = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
        loss = model(idx, targets)[1]
        torch.testing.assert_close(loss, F.cross_entropy(want.transpose(1, 2).reshape(-1, V), targets.reshape(-1)),
                                   rtol=1e-6, atol=1e-6)
    out = generate(model, [[1, 2, 3], [4]], 20, cfg.block_size).tokens
    assert all(0 <= t < V for row in out for t in row)


EXIT_SHAPES = {"grt": ("kl", {}), "poisson": ("latent", {}), "mor": ("entropy", {}), "rrt": ("kl", {"lora_rank": 4}),
               "ouro": ("kl", {"n_layer": 2})}


@pytest.mark.parametrize("model_type", list(EXIT_SHAPES))
@torch.no_grad()
def test_early_exit_runs_llama_blocks_and_never_predicts_padding(model_type):
    """Early exit drives the recurrence a step at a time and reads the head itself: with llama blocks (rotary angles
    at the decoded token's position) and a padded vocabulary whose padding rows would win every argmax, threshold 0
    (never exits early) gives the tokens of plain decoding at full depth, none of them a padding row."""
    V = 50
    criterion, shape = EXIT_SHAPES[model_type]
    layout = {} if model_type == "ouro" else {"n_prelude": 1, "n_core": 1, "n_coda": 1}
    cfg = MODEL_CONFIGS[model_type](type=model_type, vocab_size=V, vocab_multiple=128, block_size=32, d_model=32,
                                    n_head=4, n_kv_head=2, n_recurrence=3, **layout, **shape, **LLAMA)
    model = moved(build_model(cfg, seed=0)).eval()
    if model_type == "mor":
        model.routing = "threshold"
    norm = model.ln_f if hasattr(model, "ln_f") else model.recurrent_core().ln_f  # Ouro: the loop's norm
    model.embed.wte.weight[V:] = 100.0 * norm.weight
    got = generate(model, [[1, 2, 3]], 10, cfg.block_size, early_exit=EarlyExit(model, criterion, 0.0))
    assert got.steps == [3] * 9
    assert got.tokens == generate(model, [[1, 2, 3]], 10, cfg.block_size, n_steps=3).tokens
    assert all(0 <= t < V for t in got.tokens[0])


def hidden_of(model, idx):
    """The residual stream after the last block, by running the blocks directly."""
    layout = TokenLayout.build(idx, rope=(model.cfg.d_model // model.cfg.n_head, model.cfg.rope_theta))
    h = model.embed.wte(idx)
    for block in model.blocks:
        h = block(h, layout=layout)
    return h


def test_block_keys_are_checked_together():
    """The llama block's own keys are refused on a gpt2 block (each named: a silently ignored rope_theta or
    mlp_multiple is a run that is not what its recipe says); the llama block's rules are collected in one list."""
    gpt2 = GPTConfig(n_layer=2, rope_theta=500000.0, mlp_multiple=64, n_kv_head=2, qk_norm=True, mlp_ratio=3.0)
    problems = gpt2.validate()
    assert len(problems) == 1 and "model.block=gpt2" in problems[0] and "set model.block: llama" in problems[0]
    for key in ("n_kv_head", "rope_theta", "mlp_ratio", "mlp_multiple", "qk_norm"):
        assert f"model.{key}" in problems[0]
    assert GPTConfig(n_layer=2, rope_theta=10000.0, mlp_multiple=256).validate() == []  # the defaults: nothing set
    llama = GPTConfig(n_layer=2, block="llama", d_model=36, n_head=4, n_kv_head=3, rope_theta=0.0, mlp_ratio=-1.0)
    problems = llama.validate()
    assert len(problems) == 5
    for words in ("model.bias=true", "n_kv_head=3 must be >= 1 and divide model.n_head=4", "is odd",
                  "rope_theta must be > 0", "mlp_ratio must be > 0"):
        assert any(words in p for p in problems), words
