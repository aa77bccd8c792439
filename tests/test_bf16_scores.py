"""Scores and logits under bf16 autocast (train.dtype=bfloat16) computed in fp32, as meant (issue #23 item 8): the
self-KV attention's partials, RecurTrace's loop-memory attention, GRT's gate logit (with both gate-op backends),
MoR's router scores and its top-k, Ouro's exit gate and RecurTrace's halting head.

Each test runs one site under CPU bf16 autocast on the inputs the model hands it there (bf16 where an autocast
projection made them, fp32 where the residual stream or the recurrent state did) and compares its outputs and
gradients with an fp64 computation of the same function on the same input values, written out here (parameters
copied to fp64, no autocast). The measured errors and the tolerances derived from them are stated at each test;
"before" is the code before this fix (commit c4734ea), where autocast ran these scores and logits in bf16.

Errors are norm-wise: ||got - want|| / ||want|| over a whole tensor. A gradient that lands on a bf16 tensor is itself
rounded to bf16 whatever the precision of the arithmetic before it: relative error at most 2^-8 (bf16's unit
roundoff, 8 significant bits) per element, so at most 2^-8 = 3.9e-3 norm-wise for one rounding (measured 1.3e-3 ..
1.8e-3); those gradients get a tolerance of that size, the others one of fp32's. Every tolerance is a few times the
largest error measured here and below the smallest error measured before.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ops
from ops import gate as gate_ops
from pipeline.model.configs import GRTConfig
from pipeline.model.configs import MoRConfig
from pipeline.model.configs import OuroConfig
from pipeline.model.configs import RecurTraceConfig
from pipeline.model.registry import build_model
from pipeline.model.self_kv_attention import attend_reference
from pipeline.model.self_kv_attention import attend_tiled

BF16 = torch.bfloat16
BF16_GRAD_TOL = 4e-3  # a gradient computed in fp32 and rounded once to bf16: <= 2^-8 + ~1e-6


def autocast():
    return torch.autocast("cpu", dtype=BF16)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in fp64."""
    return ((got.double() - want).norm() / want.norm()).item()


def errors(got: dict, want: dict) -> dict:
    return {k: rel(got[k], want[k]) for k in want}


# ------------------------------------------------------------------------------------------------ self-KV attention
def self_kv_run(attend, dtype, **kw):
    """One attention pass and its gradients. Queries and own keys/values are bf16 in the autocast run (the block's
    c_attn hands them so) and the same values in fp64 for the reference; the layer's rest (``reveal``) is
    elementwise, so it adds no rounding of its own and the difference to fp64 is the attention's arithmetic. Scores
    of a few units (|s| up to ~8), where bf16's 8 significant bits lose ~1e-2 of a probability."""
    g = torch.Generator().manual_seed(0)
    B, H, N, hd = 1, 2, 12, 8
    base = [torch.randn(B, H, N, hd, generator=g) for _ in range(3)]
    base[0] = base[0] * 3
    q, k_own, v_own = (t.to(BF16).to(BF16 if dtype != torch.float64 else dtype).requires_grad_() for t in base)
    a, c = (torch.randn(hd, generator=g).to(dtype).requires_grad_() for _ in range(2))  # reveal's own weights
    x = torch.randn(B, H, N, hd, generator=g).to(dtype)
    w_out = torch.randn(B, H, N, hd, generator=g).to(dtype)

    def reveal(t0, t1, o):  # o in its own dtype (fp32 after the fix, bf16 before): elementwise, no autocast
        y = x[..., t0:t1, :] + torch.tanh(o)
        return y * a, y * c

    ctx = autocast() if dtype != torch.float64 else torch.autocast("cpu", enabled=False)
    with ctx:
        o = attend(q, k_own, v_own, reveal, **kw)
    (o * w_out).sum().backward()
    return {"o": o.detach(), "dq": q.grad, "dk_own": k_own.grad, "dv_own": v_own.grad, "da": a.grad, "dc": c.grad}


# Measured against fp64 (this code / before), tiled | reference: o 1.5e-7 / 5.6e-3 | 1.3e-7 / 3.2e-3; the reveal
# weights' gradients da, dc (fp32 leaves, reached through the revealed keys/values) 6.7e-7, 1.4e-7 / 5.1e-2, 1.6e-2 |
# 7.3e-7, 1.8e-7 / 9.4e-3, 7.2e-3; the bf16 leaves' gradients dq, dk_own, dv_own 2.6e-3, 1.7e-3, 1.5e-3 / 2.1e-2,
# 1.3e-2, 9.3e-3 | 1.5e-3, 1.7e-3, 1.5e-3 / 9.2e-3, 7.8e-3, 6.3e-3. Tolerances: 4e-6 for o, da, dc (5x the worst
# fp32 error); 5e-3 for the bf16 leaves, not BF16_GRAD_TOL: the tiled dq is a sum of several partials' gradients,
# each rounded to bf16 and summed in bf16 on the leaf, more than one rounding (2.6e-3 against one rounding's 1.5e-3
# .. 1.7e-3); 5e-3 is 2x that and below the 6.3e-3 and more of before.
SELF_KV_FP32_TOL, SELF_KV_BF16_GRAD_TOL = 4e-6, 5e-3


@pytest.mark.parametrize("attend,kw", [(attend_tiled, {"tile": 4}), (attend_reference, {})], ids=["tiled", "reference"])
def test_self_kv_attention_under_bf16_autocast_is_the_fp32_function(attend, kw):
    """Before, the forward's scores and softmax partials were bf16 while the recomputing backward used fp32, so the
    gradient was not that of the forward computed (da 5.1e-2 from fp64's). Now both are fp32: outputs and
    gradients within fp32 error of the fp64 function at the same inputs (tile 4 of 12 positions: two levels of the
    recursion, cross partials recomputed in backward, in-tile merges)."""
    got, want = self_kv_run(attend, torch.float32, **kw), self_kv_run(attend, torch.float64, **kw)
    err = errors(got, want)
    for name in ("o", "da", "dc"):
        assert err[name] < SELF_KV_FP32_TOL, (name, err)
    for name in ("dq", "dk_own", "dv_own"):
        assert err[name] < SELF_KV_BF16_GRAD_TOL, (name, err)
    assert got["o"].dtype == torch.float32 and got["dq"].dtype == BF16  # fp32 attention, gradients in q's dtype


# ------------------------------------------------------------------------------------------- RecurTrace loop memory
class Fixed(nn.Module):
    """c_attn's stand-in: hands the attention the given [B, T, 3C] queries/keys/values whatever its input."""

    def __init__(self, qkv: torch.Tensor):
        super().__init__()
        self.qkv = qkv

    def forward(self, x):
        return self.qkv


def loop_attention_by_hand(q, k, v, memory, mode):
    """fp64: token t attends over positions s <= t and its own keys of the earlier iterations, one softmax (union)
    or two added (separate); q, k, v [B, H, T, hd], memory [(k, v) [B, H, T, hd]] per earlier iteration."""
    T, hd = q.shape[2], q.shape[3]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    mk, mv = torch.stack([m for m, _ in memory], 3), torch.stack([m for _, m in memory], 3)  # [B, H, T, M, hd]
    sl = (q[:, :, :, None, :] * mk).sum(-1) / math.sqrt(hd)
    if mode == "union":
        p = torch.softmax(torch.cat([s, sl], -1), -1)
        return p[..., :T] @ v + (p[..., T:, None] * mv).sum(-2)
    return torch.softmax(s, -1) @ v + (torch.softmax(sl, -1)[..., None] * mv).sum(-2)


def loop_attention_run(mode, dtype, B=2, T=8, C=16, H=2, M=2):
    """LoopMemoryAttention.forward with c_attn handing bf16 q/k/v (as autocast's Linear does) and c_proj the
    identity, so its output is the attention's; the loop memory is bf16 too (earlier iterations' k/v). Scores of up
    to ~15. Returns the output and the gradients of every input (all bf16 leaves: their gradients are bf16)."""
    g = torch.Generator().manual_seed(1)
    hd = C // H
    qkv = torch.randn(B, T, 3 * C, generator=g)
    qkv[..., :C] *= 4
    if mode == "separate":
        # its positional softmax is SDPA's, as in GPT's blocks (fp32 scores inside the kernel, bf16 probabilities
        # and output): zero positional values make that term exactly 0, so what is compared is the loop softmax
        qkv[..., 2 * C:] = 0
    memory = [tuple(torch.randn(B, H, T, hd, generator=g) for _ in range(2)) for _ in range(M)]
    w_out = torch.randn(B, T, C, generator=g).to(dtype)
    qkv = qkv.to(BF16).to(dtype if dtype == torch.float64 else BF16).requires_grad_()
    memory = [tuple(t.to(BF16).to(qkv.dtype).requires_grad_() for t in kv) for kv in memory]
    if dtype == torch.float64:
        q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in qkv.split(C, 2))
        y = loop_attention_by_hand(q, k, v, memory, mode).transpose(1, 2).reshape(B, T, C)
    else:
        cfg = RecurTraceConfig(vocab_size=11, block_size=T, d_model=C, n_head=H, n_prelude=0, n_core=1, n_coda=0,
                               n_recurrence=M + 1, loop_memory=mode)
        attn = build_model(cfg).recur.blocks[0].attn
        attn.c_attn, attn.c_proj = Fixed(qkv), nn.Identity()
        with autocast():
            y, _ = attn(torch.zeros(B, T, C), memory)
    (y * w_out).sum().backward()
    out = {"y": y.detach(), "dqkv": qkv.grad}
    for j, (mk, mv) in enumerate(memory):
        out[f"dmk{j}"], out[f"dmv{j}"] = mk.grad, mv.grad
    return out


# Measured against fp64 (this code / before): union y 8.2e-8 / 4.4e-3 (fp32 now, bf16 scores and output before),
# its gradients 1.3e-3 .. 1.8e-3 (their one bf16 rounding) / 4.4e-3 .. 3.6e-2; separate y 6.0e-8 / 2.6e-3, its
# gradients 1.7e-3 .. 2.5e-3 (dqkv holds SDPA's bf16 dv) / 2.5e-3 .. 1.4e-2. Tolerances: y 1e-6 (12x the fp32
# error), gradients BF16_GRAD_TOL (4e-3, one bf16 rounding's bound; union's before all exceed it, separate's dmk,
# 9.7e-3 and 1.4e-2, do).
@pytest.mark.parametrize("mode", ["union", "separate"])
def test_loop_memory_attention_under_bf16_autocast_is_the_fp32_function(mode):
    """Loop memory attention (union: one softmax over positions and the token's earlier iterations; separate: the
    loop memory's own softmax added) under autocast against the fp64 formula at the same bf16 inputs."""
    got, want = loop_attention_run(mode, torch.float32), loop_attention_run(mode, torch.float64)
    err = errors(got, want)
    assert err.pop("y") < 1e-6, err
    for name in err:
        assert err[name] < BF16_GRAD_TOL, (name, err)
    assert got["y"].dtype == torch.float32 and got["dqkv"].dtype == BF16


def test_union_attention_keeps_no_square_score_matrix_for_backward():
    """The union softmax over positions and loop memory saves for backward its inputs, output and row logsumexps
    (O(T (hd + M hd)) per head), never a [T, T] score or probability matrix: the plain formulation kept the
    [B, H, T, T + M] probabilities of every looped layer and iteration. T = 64, hd = 4, M = 2: the largest tensor
    saved must be below T^2 per head (the memory's k/v are T M hd = 512 per head, the scores 4,096)."""
    B, T, C, H, M = 1, 64, 8, 2, 2
    cfg = RecurTraceConfig(vocab_size=11, block_size=T, d_model=C, n_head=H, n_prelude=0, n_core=1, n_coda=0,
                           n_recurrence=M + 1, loop_memory="union")
    attn = build_model(cfg).recur.blocks[0].attn
    x = torch.randn(B, T, C, requires_grad=True)
    memory = [tuple(torch.randn(B, H, T, C // H, requires_grad=True) for _ in range(2)) for _ in range(M)]
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = attn(x, memory)
    y.sum().backward()
    assert max(saved) < B * H * T * T, sorted(saved)[-3:]
    assert x.grad is not None and all(t.grad is not None for kv in memory for t in kv)


# ------------------------------------------------------------------------------------------------------ GRT's gate
def gate_run(dtype, backend, B=2, T=4, d=16, tau=0.7):
    """The gate's logit z = fc2(silu(fc1_x LN(h) + anchor)) and the update h' = o + sigmoid(z / tau) (h - o) through
    ops.gate_update on ``backend``, with z as Gate.forward hands it. fc2's input u is captured as autocast computes
    it (bf16); the fp64 reference applies fc2 and the update to those same values (the first layer's own bf16
    rounding is not this site's). h (the recurrent state) is fp32, o (the core's output) bf16, as in training."""
    g = torch.Generator().manual_seed(2)
    gate = build_model(GRTConfig(vocab_size=11, block_size=T, d_model=d, n_head=2, n_prelude=0, n_core=1, n_coda=0,
                                 n_recurrence=1), seed=3).recur.gate
    h = torch.randn(B, T, d, generator=g)
    o = torch.randn(B, T, d, generator=g).to(BF16)
    anchor = torch.randn(B, T, d, generator=g).to(BF16)
    w_out = torch.randn(B, T, d, generator=g)
    with torch.no_grad():  # a trained gate: weights of N(0, 0.3) so that W u is not negligible beside the +4 bias
        gate.fc2.weight.normal_(0, 0.3, generator=g)
    captured = {}
    gate.fc2.register_forward_pre_hook(lambda m, args: captured.update(u=args[0].detach()))
    h = h.requires_grad_()
    with autocast():
        z = gate(h, anchor)
    if dtype == torch.float64:
        u = captured["u"].double()
        w, b = (p.detach().double().requires_grad_() for p in (gate.fc2.weight, gate.fc2.bias))
        hh = h.detach().double().requires_grad_()
        z = u @ w.T + b
        gg = torch.sigmoid(z / tau)
        y = o.double() + gg * (hh - o.double())
        (y * w_out.double()).sum().backward()
        return {"z": z.detach(), "y": y.detach(), "dw": w.grad, "db": b.grad, "dh_direct": hh.grad}
    gate_ops.set_backend(backend)
    try:
        hd = h.detach().requires_grad_()  # the state's own gradient (g dy), not the one through LN(h) in f_g
        y = ops.gate_update(z, hd, o, 1 / tau, 0.0, torch.tensor(0))
        (y * w_out).sum().backward()
    finally:
        gate_ops.set_backend("auto")
    return {"z": z.detach(), "y": y.detach(), "dw": gate.fc2.weight.grad, "db": gate.fc2.bias.grad,
            "dh_direct": hd.grad, "z_dtype": z.dtype}


# Measured against fp64 (this code / before), both backends alike: z 2.9e-8 / 1.9e-3 (the bf16 rounding of logits
# of 2.6 .. 6.3: up to 2^-6 = 0.016 at +4, 0.018 measured), h' 6.5e-8 / 6.3e-5, the state's own gradient g dy
# 4.4e-8 / 3.5e-5, fc2's weight and bias gradients 6.8e-6, 7.0e-6 / 7.0e-3 .. 8.9e-3 (dz = dy (h - o) g (1 - g) / tau:
# 1 - g at g ~ 0.99 keeps ~1e-5 of fp32's precision; before, g came from the rounded z and dW = dz^T u was a bf16
# matmul). Tolerances: 1e-6 for z, h', g dy (15x the fp32 error), 5e-5 for dW, db (7x).
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gate_logit_is_fp32_under_bf16_autocast(backend):
    """``train.fused_ops`` both ways (the Triton kernels run in the interpreter on a CPU; they take an fp32 z as
    they took a bf16 one and return dz in z's dtype)."""
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it where there is no GPU
            pytest.skip("the Triton kernels take these CPU tensors only in Triton's interpreter")
    got, want = gate_run(torch.float32, backend), gate_run(torch.float64, backend)
    err = errors(got, want)
    for name, tol in (("z", 1e-6), ("y", 1e-6), ("dw", 5e-5), ("db", 5e-5), ("dh_direct", 1e-6)):
        assert err[name] < tol, (name, err)
    assert got["z_dtype"] == torch.float32  # what the gate op (and the Triton kernels) receive


def test_fp32_linear_keeps_fp32_with_bf16_held_parameters():
    """DeepSpeed's bf16 engine holds the parameters in bf16: the gate's logit is still computed in fp32 (from the
    bf16 weight cast up), and its weight's gradient reaches the bf16 parameter."""
    gate = build_model(GRTConfig(vocab_size=11, block_size=4, d_model=8, n_head=2, n_prelude=0, n_core=1, n_coda=0,
                                 n_recurrence=1), seed=3).recur.gate
    for p in gate.parameters():
        p.data = p.data.to(BF16)
    u = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(8)).to(BF16)
    with autocast():
        z = gate.fc2(u)
    z.sum().backward()
    want = u.double() @ gate.fc2.weight.detach().double().T + gate.fc2.bias.detach().double()
    assert rel(z.detach(), want) < 1e-6  # measured 2.6e-8; 1.8e-3 before (a bf16 z)
    assert z.dtype == torch.float32 and gate.fc2.weight.grad.dtype == BF16


# ------------------------------------------------------------------------------------ MoR router, Ouro and halt heads
HEAD_TOL = 5e-6  # the heads' fp32 errors are <= 5.0e-7 (a bias gradient summing 16 signed terms); 4.1e-5 and up before


def mor_recursion(d=16, n_recurrence=2, seed=4):
    cfg = MoRConfig(vocab_size=11, block_size=8, d_model=d, n_head=2, n_prelude=0, n_core=1, n_coda=0,
                    n_recurrence=n_recurrence)
    return build_model(cfg, seed=seed).recur


def mor_router_errors() -> dict:
    """Recursion 0 of a training MoR under autocast: its router logits and the router weight's gradient through
    the aux BCE, against fp64 written out: z = h w, d/dw mean BCE(z, member) = mean over tokens of
    (sigmoid(z) - member) h."""
    g = torch.Generator().manual_seed(5)
    rec = mor_recursion().train()
    h = torch.randn(2, 8, 16, generator=g)  # the residual stream: fp32 under autocast
    with autocast():
        _, index, aux = rec(h, 0, None)
        logits = rec.routers[0](h).squeeze(-1)
    aux.backward()
    w = rec.routers[0].weight.detach().double()
    z = h.double() @ w[0]
    member = torch.zeros_like(z).scatter(1, index, 1.0)  # r = 0 chooses every token
    dw = ((torch.sigmoid(z) - member)[..., None] * h.double()).mean((0, 1))
    return {"dtype": logits.dtype, "logits": rel(logits.detach(), z),
            "aux": rel(aux.detach(), F.binary_cross_entropy_with_logits(z, member)),
            "dw": rel(rec.routers[0].weight.grad[0], dw)}


# Measured against fp64 (this code / before): router logits 6.5e-8 / 2.6e-3 (the stream and the weight rounded to
# bf16, then the score), the aux BCE 1.5e-8 / 4.1e-5, the router weight's gradient through it 1.4e-7 / 3.4e-3.
# Tolerance HEAD_TOL.
def test_mor_router_scores_and_aux_gradient_are_fp32():
    err = mor_router_errors()
    dtype = err.pop("dtype")
    assert max(err.values()) < HEAD_TOL, err
    assert dtype == torch.float32


# (the first two stream coordinates of 4 tokens, the 2 of them fp64's top-k chooses); router w = (1, -1, 0, ...)
NEAR_TIES = {
    # scores 3.0, 0.985 (= 7.985 - 7.0), 0.99, -2.0. Before, autocast rounded the stream to bf16 first (7.985 -> 8.0,
    # 0.99 -> 0.9883), so token 1 scored 1.0 over token 2's 0.9883, and top-k ran on the bf16 weights alpha
    # sigmoid(z), where the two tie anyway (0.0732): it chose tokens 0 and 1
    "bf16 stream": ([(3.0, 0.0), (7.985, 7.0), (0.99, 0.0), (0.0, 2.0)], [0, 2]),
    # scores 30, 18, 20, -1: sigmoid is 1.0 in fp32 from z ~ 17, so the weights of tokens 0..2 tie and top-k on the
    # weights chose by position (tokens 0 and 1); top-k on the logits keeps their order
    "saturated sigmoid": ([(30.0, 0.0), (18.0, 0.0), (20.0, 0.0), (0.0, 1.0)], [0, 2]),
}


@pytest.mark.parametrize("case", list(NEAR_TIES))
def test_mor_top_k_chooses_as_fp64_on_a_near_tie(case):
    """4 candidates at recursion 1 of 2 (capacity 2), scores apart by less than bf16 (or a saturated sigmoid) can
    tell: the tokens chosen are fp64's."""
    rows, chosen = NEAR_TIES[case]
    rec = mor_recursion().eval()
    h = torch.zeros(1, 4, 16)  # the residual stream: fp32
    h[0, :, :2] = torch.tensor(rows)
    with torch.no_grad():
        rec.routers[1].weight.zero_()
        rec.routers[1].weight[0, 0], rec.routers[1].weight[0, 1] = 1.0, -1.0
        want = (h.double() @ rec.routers[1].weight.double()[0]).topk(2, dim=1).indices.sort(dim=1).values
        with autocast():
            _, index, _ = rec(h, 1, torch.arange(4)[None])
    assert want.tolist() == [chosen]
    assert index.tolist() == [chosen]


def ouro_gate_errors() -> dict:
    """Ouro's exit-gate logit w . h + b under autocast (h: the loop's norm output, fp32) and its weight and bias
    gradients through sum(z c), against fp64 written out."""
    g = torch.Generator().manual_seed(6)
    m = build_model(OuroConfig(vocab_size=11, block_size=8, d_model=16, n_head=2, n_layer=1, n_recurrence=2), seed=3)
    with torch.no_grad():
        m.exit_gate.weight.normal_(0, 0.5, generator=g)
        m.exit_gate.bias.fill_(0.3)
    h = torch.randn(2, 8, 16, generator=g)
    c = torch.randn(2, 8, generator=g)
    with autocast():
        z = m._gate_logit(h)
    (z * c).sum().backward()
    w, b = m.exit_gate.weight.detach().double(), m.exit_gate.bias.detach().double()
    return {"dtype": z.dtype, "z": rel(z.detach(), h.double() @ w[0] + b),
            "dw": rel(m.exit_gate.weight.grad[0], (c.double()[..., None] * h.double()).sum((0, 1))),
            "db": rel(m.exit_gate.bias.grad, c.double().sum()[None])}


def halt_errors() -> dict:
    """RecurTrace's halting logit w . LN(h) + b under autocast (h: the loop state, fp32; CPU autocast leaves the
    LayerNorm in fp32) and the head's gradients through sum(z c), against fp64 written out."""
    g = torch.Generator().manual_seed(7)
    m = build_model(RecurTraceConfig(vocab_size=11, block_size=8, d_model=16, n_head=2, n_prelude=0, n_core=1,
                                     n_coda=0, n_recurrence=2), seed=3)
    with torch.no_grad():
        m.halt.weight.normal_(0, 0.5, generator=g)
        m.halt.bias.fill_(1.5)
    h = torch.randn(2, 8, 16, generator=g)
    c = torch.randn(2, 8, generator=g)
    with autocast():
        z = m.halt_logit(h)
    (z * c).sum().backward()
    hd = h.double()
    x = (hd - hd.mean(-1, keepdim=True)) / torch.sqrt(hd.var(-1, unbiased=False, keepdim=True) + 1e-5)
    x = x * m.ln_halt.weight.detach().double() + m.ln_halt.bias.detach().double()
    w, b = m.halt.weight.detach().double(), m.halt.bias.detach().double()
    return {"dtype": z.dtype, "z": rel(z.detach(), x @ w[0] + b),
            "dw": rel(m.halt.weight.grad[0], (c.double()[..., None] * x).sum((0, 1))),
            "db": rel(m.halt.bias.grad, c.double().sum()[None])}


# Measured against fp64 (this code / before): Ouro's exit-gate logit 7.2e-8 / 2.6e-3, its weight and bias
# gradients 7.2e-8, 5.0e-7 / 2.7e-3, 8.5e-3 (before: the bf16 Linear's backward); RecurTrace's halting logit
# 7.8e-8 / 2.5e-3, its gradients 8.9e-8, 1.0e-8 / 3.1e-3, 6.2e-4. Tolerance HEAD_TOL.
@pytest.mark.parametrize("site", ["ouro exit gate", "recurtrace halting head"])
def test_gate_and_halting_logits_are_fp32(site):
    err = (ouro_gate_errors if site.startswith("ouro") else halt_errors)()
    dtype = err.pop("dtype")
    assert max(err.values()) < HEAD_TOL, err
    assert dtype == torch.float32


def test_union_attention_backward_is_the_gradient_of_its_forward():
    """The union softmax's hand-written backward (recomputed per chunk of query rows) against finite differences in
    fp64 (torch.autograd.gradcheck), over three chunks of query rows and a left-padded key mask."""
    from pipeline.model import recurtrace

    g = torch.Generator().manual_seed(9)
    B, H, T, hd, M = 2, 1, 5, 3, 2
    q, k, v = (torch.randn(B, H, T, hd, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mk, mv = (torch.randn(B, H, T, M, hd, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    key_mask = torch.tensor([[False, True, True, True, True], [True] * 5])
    pos = torch.arange(T)
    allowed = (pos[None, :] <= pos[:, None]) & (key_mask[:, None, None, :] | (pos[None, :] == pos[:, None]))
    old = recurtrace._ROWS_BYTES
    recurtrace._ROWS_BYTES = 4 * B * H * T * 2  # 2 query rows per chunk
    try:
        assert torch.autograd.gradcheck(lambda *t: recurtrace._UnionAttention.apply(0.7, allowed, *t),
                                        (q, k, v, mk, mv))
    finally:
        recurtrace._ROWS_BYTES = old


def test_fp32_linear_backward_is_exact_and_keeps_a_bf16_input_as_it_came():
    """FP32Linear's written-out backward against finite differences (fp64 gradcheck, bias and no bias), and what it
    saves for backward under autocast: the bf16 input itself and the weight, no fp32 copy of the input (autograd of
    F.linear(x.float(), ...) would keep one: 4 bytes per element of the GRT gate's hidden layer, every step)."""
    from pipeline.model.fp32_linear import FP32Linear

    g = torch.Generator().manual_seed(10)
    for bias in (True, False):
        lin = FP32Linear(5, 3, bias=bias).double()
        x = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, *p: torch.func.functional_call(
            lin, dict(zip([n for n, _ in lin.named_parameters()], p)), (x,)), (x, *lin.parameters()))
    lin = FP32Linear(16, 16)
    u = torch.randn(2, 4, 16, generator=g).to(BF16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t), autocast():
        z = lin(u)
    assert z.dtype == torch.float32 and sorted(map(str, saved)) == ["torch.bfloat16", "torch.float32"], saved
    z.sum().backward()
    assert u.grad.dtype == BF16 and lin.weight.grad.dtype == torch.float32
