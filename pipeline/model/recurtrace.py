"""RecurTrace (companion abstract): a looped block of middle layers (GRT's layout: prelude once, the core looped,
coda) with two additions that use the loop's own trajectory.

Loop Memory Attention. At iteration i each looped layer, for each token t, attends over its usual causal keys (the
positions s <= t of this iteration) and over its own keys/values of the same token t at iterations 1..i-1 (the
loop-time axis). The abstract says "attend to its own states from previous iterations": the simplest reading taken
here is the layer's key/value projections of its input at those iterations (what the layer would have offered as
keys then), so no new parameters. ``model.loop_memory``: ``union`` (one softmax over both key sets, the simplest
reading), ``separate`` (two softmaxes, their outputs added), ``none`` (the plain looped model, for ablations).

Halting head. A norm (LayerNorm, or RMSNorm with the llama block) and Linear(d, 1) read the loop state after each
iteration i and predict "continue". Its target comes from an oracle on detached per-iteration losses: continue_i(t)
= 1 if the token's next-token loss after iteration i + 1 is lower than after iteration i (coda + head applied to
each iteration's state), for i = 1..R-1; BCE with weight ``model.halt_coef``. The head reads a detached state
(``halt_detach``, default true), so it learns to read the trunk without steering it (the abstract is silent on
this). Training always runs all R loops. The oracle's per-token losses come from the fused chunked head
(ops.linear_cross_entropy), never the full logits.

Halting at inference (``n_steps`` not given): a token whose P(continue) after an iteration is below
``halt_threshold`` stops; the others go on until all stop or R loops. A stopped token is not run any more: its state
stays as it was, and at every later iteration each looped layer offers the other tokens, as its key and value, the
K/V of the last iteration the token ran (its loop memory is not needed: it asks no more queries). That is the KV
cache's rule for steps a token did not run (``KVCache.advance``, kv=full), so prefill + decode with a cache equals
one forward over the whole sequence, logits and loops alike (tests/test_model_recurtrace.py), and it is causal: a
token's depth and output depend on earlier tokens only. The arithmetic here is dense (every token's block runs, the
stopped tokens' results are dropped), so halting saves no time in this implementation; it is what a decoder that
skips stopped tokens computes. The compact KV strategies (last | first | averaged) compact over all R steps, a
stopped token's repeated K/V included. ``halt_mode: sequence``: a row stops when its tokens' mean P(continue) does,
the mean over the tokens of the forward: the whole prompt at prefill, the new token at decode (so it is per-token
there), and over a whole sequence it lets later tokens decide earlier ones' depth: not causal, and a cached decode
differs from one forward; with documents (``docs``) the mean is per document, so each document stops on its own
tokens' mean, as if alone. ``last_loops`` ([B, T]) and ``last_mean_loops`` hold the loops of the last such forward
(pads of a left-padded batch included). An explicit ``n_steps`` runs exactly that many loops for every token (exit
curves, and the lm-eval adapter, which scores at ``n_steps``, default R: the threshold-0 model).

The llama block (``model.block: llama``): the looped layers take its parts (RMSNorm, q/k/v/o_proj with grouped-query
heads, optional QK-norm, SwiGLU); every key is rotated by its token's position, so a token's loop memory (its own
keys of earlier iterations) sits at relative distance 0 from its query. Document masking (``docs``): the positional
attention stays inside each document and positions restart there; the loop memory is each token's own, so it never
crosses a document.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ops import linear_cross_entropy
from pipeline.model import z_loss
from pipeline.model.attention import causal_attention
from pipeline.model.configs import RecurTraceConfig
from pipeline.model.fp32_linear import FP32Linear
from pipeline.model.fp32_linear import autocast_off
from pipeline.model.layers import KVCache
from pipeline.model.layers import acc_dtype
from pipeline.model.layers import at_step
from pipeline.model.layers import block_flops_per_token
from pipeline.model.layers import cache_slot
from pipeline.model.layers import copy_full
from pipeline.model.layers import feed_forward
from pipeline.model.layers import head_flops_per_token
from pipeline.model.layers import head_output
from pipeline.model.layers import init_gpt2_weights
from pipeline.model.layers import norm_layer
from pipeline.model.layers import predicted_weight
from pipeline.model.layers import token_layout
from pipeline.model.layout import TokenLayout
from pipeline.model.llama import RMSNorm
from pipeline.model.llama import apply_rotary
from pipeline.model.recurrent import RecurrentLM

_ROWS_BYTES = 1 << 26  # fp32 scores of one chunk of query rows in the union attention (64 MiB)


def _up(t: torch.Tensor) -> torch.Tensor:
    return t.to(acc_dtype(t.dtype))


class _UnionAttention(torch.autograd.Function):
    """One softmax per query over its allowed positions' keys and its own loop memory (``union``), with fp32 scores
    (fp64 in an fp64 model) whatever the autocast dtype, as flash attention computes them: over chunks of query
    rows, saving for backward only the inputs, the output and each row's logsumexp, and recomputing the scores and
    probabilities in backward. The plain formulation kept the [B, H, T, T] probabilities of every looped layer and
    iteration for backward (in bf16 scores, rounded to 8 bits); here one chunk's exist at a time. SDPA cannot
    take the loop memory: its keys differ per query.

    q [B, H, T, hd]; k, v [B, H, S, hd]; ``allowed`` (bool, broadcast to [B, H, T, S]): which positions each query
    sees; mk, mv [B, H, T, M, hd]: each token's keys and values of its M earlier iterations. Returns [B, H, T, hd]
    in fp32 (fp64 for fp64 inputs)."""

    @staticmethod
    def forward(ctx, scale, allowed, q, k, v, mk, mv):
        with autocast_off(q.device):
            B, H, T, hd = q.shape
            # [B, T, H, hd] underneath: the caller's transpose back to [B, T, C] is then a view, not a second copy
            out = q.new_empty(B, T, H, hd, dtype=acc_dtype(q.dtype)).transpose(1, 2)
            lse = q.new_empty(B, H, T, dtype=acc_dtype(q.dtype))
            k32, v32 = _up(k), _up(v)
            for a, b, s, sl in _union_scores(scale, allowed, q, k32, mk):
                m = torch.maximum(s.amax(-1), sl.amax(-1))  # finite: each query sees its own position
                p, pl = torch.exp(s - m[..., None]), torch.exp(sl - m[..., None])
                l = p.sum(-1) + pl.sum(-1)
                out[:, :, a:b] = (p @ v32 + (pl[..., None] * _up(mv[:, :, a:b])).sum(-2)) / l[..., None]
                lse[:, :, a:b] = m + torch.log(l)
        ctx.scale = scale
        ctx.save_for_backward(allowed, q, k, v, mk, mv, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        allowed, q, k, v, mk, mv, out, lse = ctx.saved_tensors
        scale = ctx.scale
        with autocast_off(q.device):
            dout = dout.to(out.dtype)
            k32, v32 = _up(k), _up(v)
            dq = torch.empty_like(out)
            dmk, dmv = mk.new_empty(mk.shape, dtype=out.dtype), mv.new_empty(mv.shape, dtype=out.dtype)
            dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
            delta = (dout * out).sum(-1)  # sum over every key of p dp: the softmax backward's row term
            for a, b, s, sl in _union_scores(scale, allowed, q, k32, mk):
                p, pl = torch.exp(s - lse[:, :, a:b, None]), torch.exp(sl - lse[:, :, a:b, None])  # 0 where masked
                do, q32, mk32, mv32 = dout[:, :, a:b], _up(q[:, :, a:b]), _up(mk[:, :, a:b]), _up(mv[:, :, a:b])
                dv += p.transpose(-1, -2) @ do
                dmv[:, :, a:b] = pl[..., None] * do[..., None, :]
                ds = p * (do @ v32.transpose(-1, -2) - delta[:, :, a:b, None]) * scale
                dsl = pl * ((mv32 * do[..., None, :]).sum(-1) - delta[:, :, a:b, None]) * scale
                dq[:, :, a:b] = ds @ k32 + (dsl[..., None] * mk32).sum(-2)
                dk += ds.transpose(-1, -2) @ q32
                dmk[:, :, a:b] = dsl[..., None] * q32[..., None, :]
        return (None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmk.to(mk.dtype), dmv.to(mv.dtype))


def _union_scores(scale, allowed, q, k32, mk):
    """(first row, end row, positional scores [B, H, rows, S] with -inf where not allowed, loop scores [B, H, rows,
    M]) for each chunk of query rows, in fp32 (fp64 kept); call with autocast off."""
    B, H, T, _ = q.shape
    rows = max(1, _ROWS_BYTES // (4 * B * H * k32.shape[2]))
    for a in range(0, T, rows):
        b = min(T, a + rows)
        q32 = _up(q[:, :, a:b])
        s = (q32 @ k32.transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[..., a:b, :], float("-inf"))
        sl = (q32[..., None, :] * _up(mk[:, :, a:b])).sum(-1) * scale
        yield a, b, s, sl


def loop_softmax(q: torch.Tensor, mk: torch.Tensor, mv: torch.Tensor, scale: float) -> torch.Tensor:
    """``separate``'s second softmax, over each token's own loop memory alone (mk, mv [B, H, T, M, hd]), fp32
    scores (fp64 kept); [B, H, T, M] is all there is, so plain autograd."""
    with autocast_off(q.device):
        q32 = _up(q)
        p = torch.softmax((q32[..., None, :] * _up(mk)).sum(-1) * scale, -1)
        return (p[..., None] * _up(mv)).sum(-2)


class LoopMemoryAttention(nn.Module):
    """Attention over the causal positions and each token's own loop memory: GPT-2's projections (c_attn, c_proj)
    or, with ``model.block: llama``, the llama block's (q/k/v/o_proj, grouped-query heads, optional QK-norm, rotary
    angles of each token's position: a token's loop-memory keys sit at its own position, relative distance 0)."""

    def __init__(self, cfg: RecurTraceConfig):
        super().__init__()
        d = cfg.d_model
        self.n_head, self.mode, self.llama = cfg.n_head, cfg.loop_memory, cfg.block == "llama"
        if self.llama:
            hd, kv_heads = cfg.head_dim(), cfg.kv_heads()
            self.n_kv_head = kv_heads
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, kv_heads * hd, bias=False)
            self.v_proj = nn.Linear(d, kv_heads * hd, bias=False)
            self.o_proj = nn.Linear(d, d, bias=False)
            self.o_proj.is_residual_projection = True
            self.q_norm = RMSNorm(hd) if cfg.qk_norm else None
            self.k_norm = RMSNorm(hd) if cfg.qk_norm else None
        else:
            self.c_attn = nn.Linear(d, 3 * d, bias=cfg.bias)
            self.c_proj = nn.Linear(d, d, bias=cfg.bias)
            self.c_proj.is_residual_projection = True
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def qkv(self, x: torch.Tensor, layout: TokenLayout | None):
        """q [B, H, T, hd] and k, v [B, kv heads, T, hd] of ``x`` (rotated by the layout's angles: llama)."""
        B, T, C = x.shape
        hd = C // self.n_head
        if not self.llama:
            return (t.view(B, T, self.n_head, hd).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        if layout is None or layout.rope is None:
            raise ValueError("a llama loop-memory block needs the forward's TokenLayout with rotary angles")
        q = self.q_proj(x).view(B, T, self.n_head, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = layout.rope.cos, layout.rope.sin
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, memory: list, kv=None, halted=None, layout: TokenLayout | None = None):
        """x [B, T, C]; ``memory``: this layer's (k, v) [B, kv heads, T, hd] of the earlier iterations. ``halted``
        (inference): (active [B, T] bool, (k, v) of each token's last iteration run): a halted token offers that K/V
        instead of this iteration's. ``layout``: the forward's (documents, rotary angles). Returns the attention
        output and this iteration's (k, v) as offered."""
        B, T, C = x.shape
        q, k, v = self.qkv(x, layout)
        if halted is not None:
            ran, (k_last, v_last) = halted[0][:, None, :, None], halted[1]
            k, v = torch.where(ran, k, k_last), torch.where(ran, v, v_last)
        keys, values, key_mask = (k, v, None) if kv is None else kv.update(k, v)
        y = self.attend(q, keys, values, key_mask, memory if self.mode != "none" else [], layout)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout((self.o_proj if self.llama else self.c_proj)(y)), (k, v)

    def attend(self, q, keys, values, key_mask, memory: list, layout: TokenLayout | None = None) -> torch.Tensor:
        """q [B, H, T, hd] over ``keys``/``values`` [B, kv heads, past + T, hd] (cached keys, then causal, inside
        each document of the ``layout``; ``key_mask`` [B, past + T]: left pads are no keys, each query still sees
        itself) and each token's loop ``memory`` (a list of (k, v) [B, kv heads, T, hd], one per earlier
        iteration: the token's own, so never across documents). Scores in fp32: SDPA's kernels where no loop
        memory joins the softmax (as GPT's blocks: the scores accumulate in fp32 inside), :class:`_UnionAttention`
        where it does, fp32 by hand over the [B, H, T, iterations] loop scores of ``separate``."""
        if not memory:
            return causal_attention(q, keys, values, key_mask=key_mask, layout=layout)
        scale = 1 / math.sqrt(q.shape[-1])
        mk, mv = torch.stack([m for m, _ in memory], -2), torch.stack([m for _, m in memory], -2)  # [B, H, T, i-1, hd]
        group = q.shape[1] // mk.shape[1]
        if group > 1:  # grouped-query heads: query head h reads kv head h // group (as SDPA's enable_gqa)
            mk, mv = mk.repeat_interleave(group, dim=1), mv.repeat_interleave(group, dim=1)
        if self.mode == "separate":
            return causal_attention(q, keys, values, key_mask=key_mask, layout=layout) + loop_softmax(q, mk, mv, scale)
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        T, past = q.shape[2], keys.shape[2] - q.shape[2]
        query_pos = torch.arange(past, past + T, device=q.device)[:, None]
        key_pos = torch.arange(past + T, device=q.device)[None, :]
        allowed = key_pos <= query_pos  # cached keys, then causal
        if key_mask is not None:
            allowed = allowed & (key_mask[:, None, None, :] | (key_pos == query_pos))
        if layout is not None and layout.docs is not None:  # inside each document (no cache: whole windows)
            allowed = allowed & layout.dense_mask()
        return _UnionAttention.apply(scale, allowed, q, keys, values, mk, mv)


class LoopBlock(nn.Module):
    """A pre-norm block of ``model.block`` whose attention also reads its loop memory."""

    def __init__(self, cfg: RecurTraceConfig):
        super().__init__()
        self.ln_1 = norm_layer(cfg)  # LayerNorm (gpt2) or RMSNorm (llama)
        self.attn = LoopMemoryAttention(cfg)
        self.ln_2 = norm_layer(cfg)
        self.mlp = feed_forward(cfg)

    def forward(self, x, memory, kv=None, halted=None, layout: TokenLayout | None = None):
        a, kv_now = self.attn(self.ln_1(x), memory, kv, halted, layout)
        x = x + a
        return x + self.mlp(self.ln_2(x)), kv_now


class LoopStep(nn.Module):
    """One iteration of the looped core: h <- blocks(h), each block reading its own loop memory. Returns the new
    state and each block's (k, v) of this iteration (the caller keeps them as the next iterations' memory).
    ``halted`` (inference): (active [B, T], each block's (k, v) of the last iteration each token ran); ``layout``:
    the forward's."""

    def __init__(self, cfg: RecurTraceConfig):
        super().__init__()
        self.blocks = nn.ModuleList(LoopBlock(cfg) for _ in range(cfg.n_core))

    def forward(self, h: torch.Tensor, memories: list, cache=None, halted=None, layout: TokenLayout | None = None):
        new = []
        for j, (block, memory) in enumerate(zip(self.blocks, memories)):
            last = None if halted is None else (halted[0], halted[1][j])
            h, kv_now = block(h, memory, cache_slot(cache, block), last, layout)
            new.append(kv_now)
        return h, new


def document_mean(x: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """[B, T] -> each token's mean of ``x`` over the tokens of its document (``docs`` [B, T], non-decreasing)."""
    d = docs - docs[:, :1]  # 0.. in each row
    n = int(d.max()) + 1
    sums = x.new_zeros(x.shape[0], n).scatter_add_(1, d, x)
    counts = x.new_zeros(x.shape[0], n).scatter_add_(1, d, torch.ones_like(x))
    return (sums / counts.clamp(min=1)).gather(1, d)


def oracle_targets(losses: torch.Tensor) -> torch.Tensor:
    """[R, ...] per-iteration losses -> [R - 1, ...] targets: 1.0 where iteration i + 1 lowers the loss of i."""
    return (losses[1:] < losses[:-1]).to(losses.dtype)


class RecurTrace(RecurrentLM):

    def __init__(self, cfg: RecurTraceConfig):
        super().__init__(cfg, LoopStep(cfg))
        self.ln_halt = norm_layer(cfg)
        self.halt = FP32Linear(cfg.d_model, 1, bias=True)  # the logit in fp32: BCE and the threshold read it
        self.last_loops: torch.Tensor | None = None  # [B, T] loops each token ran in the last halting forward
        self.last_mean_loops: float | None = None

    def init_weights(self, seed: int, assign=copy_full) -> None:
        init_gpt2_weights(self, self.block_executions(self.cfg), seed, assign)

    def halt_logit(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T] logit of P(continue) read from the loop state."""
        return self.halt(self.ln_halt(h.detach() if self.cfg.halt_detach else h)).squeeze(-1)

    def iterate(self, h: torch.Tensor, n: int, cache: KVCache | None = None, layout: TokenLayout | None = None):
        """Yield the state after each of n iterations, the loop memory carried along."""
        memories = [[] for _ in self.recur.blocks]
        for i in range(n):
            # a snapshot (tuples): activation checkpointing (core_step, blocks) recomputes the step in backward with
            # the memory it saw here, not the lists as the later loops have grown them
            h, new = self.recur(h, [tuple(m) for m in memories], at_step(cache, i), layout=layout)
            for memory, kv_now in zip(memories, new):
                memory.append(kv_now)
            yield h

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, n_steps: int | None = None,
                cache: KVCache | None = None, docs: torch.Tensor | None = None):
        """(logits, None) or (None, loss); ``docs`` [B, T]: each token's document (attention, loop memory and the
        sequence-mode halting mean stay inside it)."""
        cfg = self.cfg
        start = cache.begin(idx) if cache is not None else 0
        layout = token_layout(cfg, idx, start, docs)
        h0 = self.encode(idx, start, cache, layout)
        if targets is not None and self.training:
            states = list(self.iterate(h0, cfg.n_recurrence, layout=layout))
            head_in = self.readout(states[-1], layout=layout)
            if cfg.halt_coef == 0 or cfg.n_recurrence == 1:
                return head_output(self.lm_head, head_in, targets)
            # the LM loss's fused head also hands over each token's CE: the oracle's last row, one head pass fewer
            last = torch.empty(targets.shape, dtype=torch.promote_types(head_in.dtype, torch.float32),
                               device=targets.device)
            coef = z_loss.coefficient(self.lm_head)  # train.z_loss: on the LM loss only (the oracle keeps the CE)
            z = z_loss.new_buffer(targets, head_in) if coef else None
            loss = linear_cross_entropy(head_in, predicted_weight(self.lm_head), targets, token_losses=last,
                                        z_loss=coef, z_out=z)
            if coef:
                z_loss.record(self.lm_head, coef, z, targets)
            return None, loss + cfg.halt_coef * self.halting_loss(states, targets, last, layout)
        if n_steps is not None:
            h = h0
            for h in self.iterate(h0, n_steps, cache, layout):
                pass
        else:
            h = self.halted_state(h0, cache, layout)
        out = head_output(self.lm_head, self.readout(h, cache, layout), targets)
        if cache is not None:
            cache.advance()
        return out

    @torch.no_grad()
    def oracle_losses(self, states: list, targets: torch.Tensor, last: torch.Tensor | None = None,
                      layout: TokenLayout | None = None) -> torch.Tensor:
        """[R, B, T] detached next-token losses (nats; fp32, fp64 for an fp64 model) of coda + head on each
        iteration's state, 0 where the target is -1, from the fused chunked head (ops.linear_cross_entropy, per
        token): the [B, T, V] logits never exist (R of them per step took more memory traffic than the rest of a
        training step at the toy's shape). ``last``: the last iteration's losses when the caller has them."""
        todo = states if last is None else states[:-1]
        weight = predicted_weight(self.lm_head)
        losses = [linear_cross_entropy(self.readout(s, layout=layout), weight, targets, reduction="none")
                  for s in todo]
        return torch.stack(losses + ([] if last is None else [last.to(losses[0].dtype)]))

    def halting_loss(self, states: list, targets: torch.Tensor, last: torch.Tensor | None = None,
                     layout: TokenLayout | None = None) -> torch.Tensor:
        """BCE of the halting head after iterations 1..R-1 against the oracle (detached per-token losses; ``last``:
        those after iteration R, if the caller has them)."""
        target = oracle_targets(self.oracle_losses(states, targets, last, layout))
        logits = torch.stack([self.halt_logit(s) for s in states[:-1]])
        valid = (targets >= 0).expand_as(logits)
        return F.binary_cross_entropy_with_logits(logits[valid].float(), target[valid].float())

    def halted_state(self, h: torch.Tensor, cache: KVCache | None = None,
                     layout: TokenLayout | None = None) -> torch.Tensor:
        """Run up to R loops, each token (or row) stopping once P(continue) < halt_threshold: a stopped token keeps
        its state and, at every later iteration, each looped layer offers it as a key with its K/V of the last
        iteration it ran (module docstring). Sets ``last_loops`` and ``last_mean_loops``."""
        cfg = self.cfg
        active = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        loops = torch.zeros(h.shape[:2], device=h.device)
        memories = [[] for _ in self.recur.blocks]
        for i in range(cfg.n_recurrence):
            halted = None if i == 0 else (active, [memory[-1] for memory in memories])  # [-1]: each token's last run
            new, kv_now = self.recur(h, [tuple(m) for m in memories], at_step(cache, i), halted, layout)
            for memory, kv in zip(memories, kv_now):
                memory.append(kv)
            loops = loops + active
            h = torch.where(active[..., None], new, h)
            active = active & self.continues(self.halt_logit(h), None if layout is None else layout.docs)
            if not bool(active.any()):
                break  # with a cache, advance() gives the steps not run each token's last K/V: the same rule
        self.last_loops, self.last_mean_loops = loops, float(loops.mean())
        return h

    def continues(self, logit: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] bool: which tokens go on after this iteration. Threshold 0 and 1 are exact (always / never: a
        saturated sigmoid is 1.0 in fp32 from logit ~17, in bf16 from ~8, so ``p >= 1`` would keep a confident head
        looping); per token the test is on the logit, logit >= log(th / (1 - th)), the same as P >= th. Sequence
        mode takes the mean over each row, or over each document of ``docs`` [B, T]."""
        th = self.cfg.halt_threshold
        if th <= 0 or th >= 1:
            return torch.full(logit.shape, th <= 0, dtype=torch.bool, device=logit.device)
        if self.cfg.halt_mode == "token":
            return logit >= math.log(th / (1 - th))
        p = torch.sigmoid(logit.float())
        if docs is None:
            return (p.mean(-1, keepdim=True) >= th).expand(logit.shape)
        return document_mean(p, docs) >= th

    def exit_states(self, idx: torch.Tensor, exits, gates: dict | None = None, *, noise: bool = False,
                    docs: torch.Tensor | None = None):
        """(e, coda + final norm of the state after e loops) for each e in ``exits`` (0: the prelude output)."""
        if noise:
            raise ValueError("model.type=recurtrace has no inference noise; set eval.noise=false")
        wanted = sorted(set(exits))
        layout = token_layout(self.cfg, idx, docs=docs)
        h = self.encode(idx, layout=layout)
        if 0 in wanted:
            yield 0, self.readout(h, layout=layout)
        for e, s in enumerate(self.iterate(h, wanted[-1], layout=layout), 1):
            if e in wanted:
                yield e, self.readout(s, layout=layout)

    def train_depth(self, seed: int, step: int, micro_step: int | None = None) -> None:
        return None  # training runs all n_recurrence loops

    @classmethod
    def training_flops_per_token(cls, cfg: RecurTraceConfig, n_steps: int | None = None) -> int:
        """One training step (forward + backward = 3x forward, head included) plus the halting oracle's readouts:
        coda and head on the state after each of loops 1..n-1, forward only (no_grad; loop n's losses come from the
        LM loss's own pass): the trainer's MFU."""
        n = cfg.n_recurrence if n_steps is None else n_steps
        return 3 * cls.flops_per_token(cfg, n, with_head=True) + (n - 1) * RecurTrace.readout_flops(cfg)

    @staticmethod
    def readout_flops(cfg: RecurTraceConfig) -> int:
        """Coda blocks and the tied head on one state, per token."""
        return cfg.n_coda * block_flops_per_token(cfg, cfg.block_size) + head_flops_per_token(cfg)

    @staticmethod
    def flops_notes(cfg: RecurTraceConfig) -> list[str]:
        R = cfg.n_recurrence
        oracle = (R - 1) * RecurTrace.readout_flops(cfg)
        train = RecurTrace.training_flops_per_token(cfg)
        return [f"training also reads out the state after loops 1..{R - 1} (coda + head, no grad) for the halting "
                f"oracle: {oracle:,} FLOPs/token, {oracle / train:.1%} of a training step's {train:,}; the trainer's "
                f"MFU counts it",
                "inference with halting still runs every loop for every token (a halted token's state is frozen, "
                "not skipped): the FLOPs above are those of n_recurrence loops; `grt eval` reports the mean loops "
                "a token needed"]

    @staticmethod
    def flops_per_token(cfg: RecurTraceConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None, executed: bool = False) -> int:
        """Paper Eq. 1 over the block executions, plus the loop memory's scores and sums (4 d per earlier iteration,
        per looped layer and iteration) and the halting head (2 d per iteration)."""
        S, d = seq_len or cfg.block_size, cfg.d_model
        n = cfg.n_recurrence if n_steps is None else n_steps
        f = RecurTrace.block_executions(cfg, n) * block_flops_per_token(cfg, S)
        if cfg.loop_memory != "none":
            f += cfg.n_core * sum(4 * d * i for i in range(n))
        f += 2 * d * n
        return f + (head_flops_per_token(cfg) if with_head else 0)
