"""RRT against a hand-written float64 implementation of its equations: the strictly shared core applied N_r times,
each recursion r's projections W x + b + (alpha / rank) B_r A_r x, read straight from the checkpoint keys."""
import math

import pytest
import torch

from pipeline.eval.exit_losses import exit_curve
from pipeline.model import build_model
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import RRTConfig
from pipeline.model.layers import KVCache
from pipeline.model.registry import count_params
from pipeline.model.registry import model_class
from pipeline.model.registry import model_info
from pipeline.model.rrt import RRT
from pipeline.train.parallelize import apply_activation_checkpointing

PROJECTIONS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


# ------------------------------------------------------------------------------ an independent, by-hand reference
def ln(x, P, name, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps) * P[name + ".weight"]
    return y + P[name + ".bias"] if name + ".bias" in P else y


def proj(x, P, name, r=None, scale=None):
    """W x + b, plus (alpha / rank) B_r A_r x when a recursion r is given."""
    y = x @ P[name + ".weight"].T
    if name + ".bias" in P:
        y = y + P[name + ".bias"]
    if r is not None:
        y = y + scale * (x @ P[f"{name}.lora_A.{r}.weight"].T) @ P[f"{name}.lora_B.{r}.weight"].T
    return y


def block(x, P, pre, n_head, r=None, scale=None):
    B, T, C = x.shape
    q, k, v = proj(ln(x, P, pre + ".ln_1"), P, pre + ".attn.c_attn", r, scale).split(C, dim=2)
    q, k, v = (t.reshape(B, T, n_head, C // n_head).permute(0, 2, 1, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(C // n_head)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    y = (p / p.sum(-1, keepdim=True)) @ v
    x = x + proj(y.permute(0, 2, 1, 3).reshape(B, T, C), P, pre + ".attn.c_proj", r, scale)
    hid = proj(ln(x, P, pre + ".ln_2"), P, pre + ".mlp.c_fc", r, scale)
    hid = 0.5 * hid * (1 + torch.erf(hid / math.sqrt(2)))  # exact GELU
    return x + proj(hid, P, pre + ".mlp.c_proj", r, scale)


def reference_logits(P, cfg, idx, depth, lora=True):
    """prelude -> depth recursions of the core (recursion r with its own LoRA, or none: the strictly shared
    model) -> coda -> final LN -> tied head."""
    scale = cfg.lora_alpha / cfg.lora_rank
    h = P["embed.wte.weight"][idx] + P["embed.wpe.weight"][torch.arange(idx.shape[1])]
    for i in range(cfg.n_prelude):
        h = block(h, P, f"prelude.{i}", cfg.n_head)
    for r in range(depth):
        for i in range(cfg.n_core):
            h = block(h, P, f"recur.blocks.{i}", cfg.n_head, r if lora else None, scale)
    for i in range(cfg.n_coda):
        h = block(h, P, f"coda.{i}", cfg.n_head)
    return ln(h, P, "ln_f") @ P["embed.wte.weight"].T


def ce(logits, targets):
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    return -logp.gather(-1, targets.unsqueeze(-1)).mean()


# ---------------------------------------------------------------------------------------------------------- setup
def small_cfg(**kw):
    base = dict(vocab_size=97, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                n_recurrence=3, lora_rank=4, lora_alpha=8.0)
    return RRTConfig(**{**base, **kw})


def small_rrt(lora_b=True, **kw):
    """The model in float64, every shared weight perturbed off its init; the LoRA B's random too unless told."""
    torch.manual_seed(0)
    m = build_model(small_cfg(**kw)).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".lora_B." in name and not lora_b:
                continue
            p.add_((0.2 if ".lora_" in name else 0.05) * torch.randn_like(p))
    return m.eval()


def params(m):
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def batch(cfg, B=2, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (B, T), generator=g),
            torch.randint(0, cfg.vocab_size, (B, T), generator=g))


# ---------------------------------------------------------------------------------------------------------- tests
def test_init_lora_b_zero_and_keys():
    torch.manual_seed(0)
    m = build_model(small_cfg())
    P = dict(m.named_parameters())
    cfg, L = m.cfg, 1 + 2 * 3 + 1
    for i in range(cfg.n_core):
        for name in PROJECTIONS:
            W = P[f"recur.blocks.{i}.{name}.weight"]
            std = 0.02 / math.sqrt(2 * L) if name.endswith("c_proj") else 0.02
            assert W.std().item() == pytest.approx(std, rel=0.25)  # tight: test_init_std_at_the_sampling_error
            for r in range(cfg.n_recurrence):
                A, B = P[f"recur.blocks.{i}.{name}.lora_A.{r}.weight"], P[f"recur.blocks.{i}.{name}.lora_B.{r}.weight"]
                assert A.shape == (cfg.lora_rank, W.shape[1]) and B.shape == (W.shape[0], cfg.lora_rank)
                assert torch.count_nonzero(B) == 0
    a = torch.cat([p.flatten() for k, p in P.items() if ".lora_A." in k])
    assert a.std().item() == pytest.approx(0.02, rel=0.05)  # not the residual scaling of c_proj's own weight
    assert set(m.state_dict()) == set(P) | {"lm_head.weight"}  # every tensor a parameter: nothing hidden from counts


def assert_std(x: torch.Tensor, want: float, what: str, margin: float = 0.01) -> None:
    """The sample std of n draws of N(0, want) is off by about want / sqrt(2n) (1 sigma); allow 4 sigma plus a
    stated 1% margin, so a residual scale one recursion off (sqrt(8/10): -10.6%) cannot pass."""
    rel = 4 / math.sqrt(2 * x.numel()) + margin
    got = x.std().item()
    assert got == pytest.approx(want, rel=rel), f"{what}: std {got:.6f}, want {want:.6f} +- {rel:.1%}"


def test_init_std_at_the_sampling_error():
    """Each kind of weight, pooled over every block, against the GPT-2 rule written out here: N(0, 0.02), residual
    projections N(0, 0.02 / sqrt(2 L)) with L = block executions at N_r = prelude + core x N_r + coda."""
    cfg = small_cfg(d_model=64, vocab_size=500)
    m = build_model(cfg, seed=3)
    L = cfg.n_prelude + cfg.n_core * cfg.n_recurrence + cfg.n_coda  # 1 + 2 x 3 + 1 = 8
    resid = 0.02 / math.sqrt(2 * L)
    P = dict(m.named_parameters())
    for suffix, want in [("attn.c_proj.weight", resid), ("mlp.c_proj.weight", resid), ("attn.c_attn.weight", 0.02),
                         ("mlp.c_fc.weight", 0.02)]:
        pooled = torch.cat([p.flatten() for k, p in P.items() if k.endswith(suffix)])
        assert pooled.numel() >= 4 * 64 * 64, suffix  # every block's, so the tolerance is a few percent
        assert_std(pooled, want, suffix)
    assert_std(torch.cat([p.flatten() for k, p in P.items() if ".lora_A." in k]), 0.02, "lora_A")
    assert_std(P["embed.wte.weight"], 0.02, "wte")


def test_lora_b_zero_equals_strictly_shared_model():
    m = small_rrt(lora_b=False)
    idx, _ = batch(m.cfg)
    P = params(m)
    assert all(torch.count_nonzero(v) == 0 for k, v in P.items() if ".lora_B." in k)
    for e in range(m.cfg.n_recurrence + 1):
        logits, _ = m(idx, n_steps=e)
        torch.testing.assert_close(logits, reference_logits(P, m.cfg, idx, e, lora=False), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bias", [True, False])
def test_forward_equals_per_recursion_lora_reference(bias):
    m = small_rrt(bias=bias)
    idx, tgt = batch(m.cfg)
    P = params(m)
    for e in range(m.cfg.n_recurrence + 1):
        logits, _ = m(idx, n_steps=e)
        ref = reference_logits(P, m.cfg, idx, e)
        torch.testing.assert_close(logits, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(m(idx, tgt, n_steps=e)[1], ce(ref, tgt), rtol=1e-10, atol=1e-10)
    # the LoRAs matter: nonzero B changes the output (the test above is not the shared model in disguise)
    assert (m(idx)[0] - reference_logits(P, m.cfg, idx, m.cfg.n_recurrence, lora=False)).abs().max() > 1e-3
    m.train()  # training objective = the plain next-token loss at N_r (dropout 0)
    torch.testing.assert_close(m(idx, tgt)[1], ce(reference_logits(P, m.cfg, idx, 3), tgt), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("exit_depth", [1, 2, 3])
def test_each_recursions_lora_gets_gradient_only_from_its_recursion(exit_depth):
    m = small_rrt()
    idx, tgt = batch(m.cfg)
    m.zero_grad()
    m(idx, tgt, n_steps=exit_depth)[1].backward()
    P = {k: v.requires_grad_() for k, v in params(m).items()}
    ce(reference_logits(P, m.cfg, idx, exit_depth), tgt).backward()
    for name, p in m.named_parameters():
        if ".lora_" not in name:
            continue
        r = int(name.split(".")[-2])
        if r >= exit_depth:  # recursion r + 1 did not run: its LoRA gets no gradient
            assert p.grad is None or torch.count_nonzero(p.grad) == 0, name
        else:
            assert p.grad is not None and p.grad.abs().max() > 0, name
            torch.testing.assert_close(p.grad, P[name].grad, rtol=1e-8, atol=1e-12)


def test_lora_gradient_against_finite_differences():
    m = small_rrt()
    idx, tgt = batch(m.cfg, B=1, T=6)
    m.zero_grad()
    m(idx, tgt)[1].backward()
    P = params(m)
    for name in ("recur.blocks.0.attn.c_attn.lora_B.0.weight", "recur.blocks.1.mlp.c_proj.lora_A.2.weight",
                 "recur.blocks.1.attn.c_proj.lora_B.1.weight"):
        for pos in [(0, 1), (3, 2)]:
            eps = 1e-6
            plus, minus = dict(P), dict(P)
            plus[name], minus[name] = P[name].clone(), P[name].clone()
            plus[name][pos] += eps
            minus[name][pos] -= eps
            fd = (ce(reference_logits(plus, m.cfg, idx, 3), tgt) - ce(reference_logits(minus, m.cfg, idx, 3), tgt))
            assert dict(m.named_parameters())[name].grad[pos].item() == pytest.approx(fd.item() / (2 * eps),
                                                                                      rel=1e-5, abs=1e-9)


def test_changing_lora_r_leaves_earlier_exits_unchanged():
    m = small_rrt()
    idx, _ = batch(m.cfg)
    before = {e: s.clone() for e, s in m.exit_states(idx, range(4))}
    with torch.no_grad():
        m.recur.blocks[1].mlp.c_fc.lora_B[1].weight.add_(1.0)  # recursion 2 (0-based index 1)
    after = dict(m.exit_states(idx, range(4)))
    for e in (0, 1):
        torch.testing.assert_close(after[e], before[e], rtol=0, atol=0)
    for e in (2, 3):
        assert (after[e] - before[e]).abs().max() > 1e-3


def test_exit_states_equal_forward_at_each_depth():
    m = small_rrt()
    idx, tgt = batch(m.cfg)
    states = dict(m.exit_states(idx, [3, 0, 2, 1, 2]))
    assert sorted(states) == [0, 1, 2, 3]
    for e, s in states.items():
        torch.testing.assert_close(m.lm_head(s), m(idx, n_steps=e)[0], rtol=1e-12, atol=1e-12)
    curve = exit_curve(m, [(idx, tgt)], [0, 1, 2, 3], 3, torch.device("cpu"))  # eval's one pass, its fp32 head
    assert curve["exit"] == [0, 1, 2, 3]
    for e, loss in zip(curve["exit"], curve["loss"]):  # fp32 head vs fp64 forward: measured max rel gap 1.9e-8, x10 up
        assert loss == pytest.approx(m(idx, tgt, n_steps=e)[1].item(), rel=1e-6)


@pytest.mark.parametrize("depth", [0, 2, 3])
def test_cache_decode_equals_full_forward(depth):
    m = small_rrt()
    idx, _ = batch(m.cfg, T=10)
    full, _ = m(idx, n_steps=depth)
    cache = KVCache(m.cfg.block_size)
    steps = [m(idx[:, :4], n_steps=depth, cache=cache)[0]]  # a prompt, then token by token
    steps += [m(idx[:, t:t + 1], n_steps=depth, cache=cache)[0] for t in range(4, 10)]
    assert cache.n_layer_caches() == m.block_executions(m.cfg, depth)  # one slot per block execution
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


def test_core_step_checkpointing_keeps_loss_and_grads():
    m = small_rrt()
    idx, tgt = batch(m.cfg)
    m.train()
    m(idx, tgt)[1].backward()
    grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    apply_activation_checkpointing(m, "core_step")
    m(idx, tgt)[1].backward()
    assert grads.keys() == {k for k, p in m.named_parameters() if p.grad is not None}
    for k, p in m.named_parameters():
        if k in grads:
            torch.testing.assert_close(p.grad, grads[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bias", [True, False])
def test_meta_build_and_parameter_count(bias):
    cfg = small_cfg(bias=bias, n_recurrence=4, lora_rank=3)
    m = build_model(cfg, device="meta")
    assert all(p.is_meta for p in m.parameters())
    # the strictly shared model: the same layout with neither re-injection nor gate (GRT's code, no LoRA)
    shared = GRTConfig(vocab_size=97, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                       n_recurrence=4, bias=bias, reinject=False, gate="none")
    d, rank = 32, 3
    lora = 4 * 2 * (rank * (d + 3 * d) + rank * (d + d) + rank * (d + 4 * d) + rank * (4 * d + d))
    n = count_params(build_model(shared, device="meta"))["params"] + lora
    assert count_params(m)["params"] == n == model_info(cfg)["params"]
    assert RRT.lora_params(cfg) == lora
    assert f"{lora:,}" in RRT.flops_notes(cfg)[1] and f"{n:,}" in RRT.flops_notes(cfg)[1]
    assert model_class("rrt") is RRT and m.train_depth(0, 5) is None


def test_accounting():
    cfg = RRTConfig(vocab_size=50257, block_size=1024, d_model=768, n_prelude=1, n_core=1, n_coda=1,
                    n_recurrence=10, lora_rank=64)
    d, S = 768, 1024
    assert RRT.shorthand(cfg) == "1+1x10+1" and RRT.block_executions(cfg) == 12 and RRT.full_depth(cfg) == 10
    lora = 10 * 1 * 2 * 64 * (4 * d + 2 * d + 5 * d + 5 * d)
    assert RRT.flops_per_token(cfg) == 12 * (24 * d * d + 4 * S * d) + lora
    assert RRT.flops_per_token(cfg, 3, with_head=True) == 5 * (24 * d * d + 4 * S * d) + 3 * lora // 10 + 2 * d * 50257
    assert RRT.flops_per_token(cfg, executed=True) == RRT.flops_per_token(cfg)
    assert f"{lora:,}" in RRT.flops_notes(cfg)[0]


def test_depth_past_the_last_lora_is_refused():
    m = small_rrt()
    idx, _ = batch(m.cfg)
    with pytest.raises(ValueError, match="n_recurrence"):
        m(idx, n_steps=4)
    with pytest.raises(ValueError, match="n_recurrence"):
        list(m.exit_states(idx, [5]))


LLAMA = dict(block="llama", bias=False, n_kv_head=2, qk_norm=True, mlp_multiple=16)
LLAMA_PROJECTIONS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                     "mlp.down_proj")


@pytest.mark.parametrize("with_docs", [False, True])
def test_llama_core_equals_the_dense_llama_model_with_each_recursions_lora_merged(with_docs):
    """With the llama block, exit e is the dense llama model of prelude, the core with recursion r's LoRA merged
    into its weights (W + (alpha / rank) B_r A_r) for r = 0..e-1, and coda: every one of the seven projections
    relaxed, the LoRAs of recursions past e unused; under document masking too."""
    from pipeline.model.configs import GPTConfig
    from pipeline.model.layout import documents_from_eos

    m = small_rrt(n_core=1, **LLAMA)
    cfg = m.cfg
    P, scale = params(m), cfg.lora_alpha / cfg.lora_rank
    idx, _ = batch(cfg)
    docs = {"docs": documents_from_eos(idx, 7)} if with_docs else {}
    for e in range(1, cfg.n_recurrence + 1):
        dense = build_model(GPTConfig(**{k: getattr(cfg, k) for k in ("vocab_size", "block_size", "d_model",
                                                                        "n_head", *LLAMA)}, n_layer=e + 2)).double()
        merged = {"embed.wte.weight": P["embed.wte.weight"], "lm_head.weight": P["embed.wte.weight"],
                  "ln_f.weight": P["ln_f.weight"]}
        layers = ["prelude.0"] + [f"recur.blocks.0@{r}" for r in range(e)] + ["coda.0"]
        for j, layer in enumerate(layers):
            src, _, r = layer.partition("@")
            for name in dense.blocks[j].state_dict():
                w = P[f"{src}.{name}"]
                lora = f"{src}.{name.removesuffix('.weight')}.lora_"
                if r and name.removesuffix(".weight") in LLAMA_PROJECTIONS:
                    w = w + scale * P[f"{lora}B.{r}.weight"] @ P[f"{lora}A.{r}.weight"]
                merged[f"blocks.{j}.{name}"] = w
        dense.load_state_dict(merged)
        torch.testing.assert_close(m(idx, n_steps=e, **docs)[0], dense.eval()(idx, **docs)[0], rtol=1e-10,
                                   atol=1e-10)


def test_llama_parameter_count_and_accounting():
    """LoRA on the seven llama projections: rank (d_in + d_out) each, per recursion and core block; the shared
    model is GRT's strictly shared llama model (no re-injection, no gate); FLOPs written out by hand."""
    cfg = small_cfg(n_recurrence=4, lora_rank=3, vocab_multiple=128, **LLAMA)
    m = build_model(cfg, device="meta")
    d, rank, d_kv, f, S, V = 32, 3, 16, 96, 16, 97  # 2 kv heads of 8; SwiGLU 8/3 d = 85.3 -> 96
    dims = 2 * d + 2 * (d + d_kv) + 2 * d + 3 * (d + f)  # q, k, v, o; gate, up, down
    lora = 4 * 2 * rank * dims
    assert sum(p.numel() for k, p in m.named_parameters() if ".lora_" in k) == lora == RRT.lora_params(cfg)
    shared = GRTConfig(vocab_size=V, block_size=S, d_model=d, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                       n_recurrence=4, reinject=False, gate="none", vocab_multiple=128, **LLAMA)
    n = count_params(build_model(shared, device="meta"))["params"]
    assert count_params(m)["params"] == n + lora == model_info(cfg)["params"] and RRT.shared_params(cfg) == n
    assert f"{lora:,}" in RRT.flops_notes(cfg)[1] and f"{n + lora:,}" in RRT.flops_notes(cfg)[1]
    per_block = 2 * (d * (2 * d + 2 * d_kv) + 3 * d * f) + 4 * S * d
    # exit 2: 1 + 2 x 2 + 1 blocks; 2 recursions x 2 core blocks of LoRA matmuls, 2 rank (d_in + d_out) each
    assert RRT.flops_per_token(cfg, 2, with_head=True) == 6 * per_block + 2 * 2 * 2 * rank * dims + 2 * d * V
    assert "7 projections" in RRT.flops_notes(cfg)[0]
