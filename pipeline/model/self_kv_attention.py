"""Self-KV attention, the Recurrent Transformer's layer-wise recurrent memory: the query of position t comes from the
layer's input at t (known for every position up front), while the keys and values of the earlier positions s < t
come from the layer's OUTPUT at s, which exists only once position s has been computed. Position t also attends to
the key/value of its own input (so position 0 has a key). The sequence is therefore processed in order; what this
module offers is two exact ways to do it:

- :func:`attend_reference`: token by token, each position reading every earlier key/value (exact by construction;
  memory traffic Theta(N^2 d), arithmetic intensity ~1);
- :func:`attend_tiled`: divide and conquer over positions. Solve the left half; then the left half's revealed
  keys/values reach every query of the right half in ONE batched attention, kept as an online-softmax partial
  (running max m, normaliser l, accumulator acc) per query; then solve the right half. Inside a tile of ``tile``
  positions the tile's own keys/values stay in fast memory and each position merges its ancestors' partials. Each
  level of the recursion moves O(N d) elements, so the traffic is Theta(N d log(N / tile)) (the abstract's
  Theta(N^2) -> Theta(N log N)); the softmax merges are exact, so both give the same outputs and gradients (up to
  floating-point reassociation).

``reveal(t0, t1, o)`` is the layer's rest: given the attention outputs ``o`` of positions [t0, t1) ([B, H, t1-t0,
hd]) it computes those positions' outputs and returns their keys and values (same shape). Both functions call it
for one position at a time, in order. With ``docs`` (document masking) a query reads only the earlier positions of
its own document: the key masks become [B, queries, keys], and the recursion is unchanged.

:class:`Traffic` counts, analytically, the elements each algorithm moves between main memory and a fast on-chip
memory that holds one tile (its queries, keys, values and softmax statistics) — the quantity the abstract's
Theta(N^2) -> Theta(N log N) refers to; on a CPU there is no such hierarchy to measure, so it is counted.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

Reveal = Callable[[int, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Past = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # cached keys, values [B, H, P, hd], key mask [B, P]


def _score_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """A key mask [B, keys] (the same for every query) or [B, queries, keys] (documents) -> broadcast to scores."""
    return key_mask[:, None, None, :] if key_mask.dim() == 2 else key_mask[:, None]


@dataclass
class Traffic:
    """Elements read from and written to main memory."""
    read: int = 0
    written: int = 0

    @property
    def total(self) -> int:
        return self.read + self.written


EMPTY = -1e30  # the row max of a partial with no key: below any score, finite in fp32 and bf16


def _up(t: torch.Tensor) -> torch.Tensor:
    """fp32 for bf16/fp16/fp32, fp64 kept: the scores, softmax statistics and merges run in it under bf16 autocast
    (q, k, v arrive in bf16 from the autocast projections), in the forward as in the recomputing backward."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _autocast_off(device: torch.device):
    # autocast would cast the fp32 operands of the score matmuls back to bf16; meta has no autocast to turn off
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else contextlib.nullcontext()


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, key_mask: torch.Tensor | None = None):
    """Online-softmax partial of the queries ``q`` over the keys/values ``k``, ``v`` (every key visible to every
    query, but those ``key_mask`` marks False: [B, keys] for left pads, [B, queries, keys] for documents): (m, l,
    acc) with m the row max of the scores, l = sum exp(s - m), acc = exp(s - m) @ v, all in fp32 (:func:`_up`)
    whatever the inputs' dtype. A row with no key gets m = EMPTY, l = 0, acc = 0: it merges as nothing, whatever
    the other side's scale (with m = 0 a partial whose scores are all below about -87 would get the weight
    exp(s - 0) = 0 in the merge), and two empty partials merge into an empty one (no -inf - -inf)."""
    with _autocast_off(q.device):
        s = torch.einsum("bhqd,bhkd->bhqk", _up(q), _up(k)) * scale
        if key_mask is not None:
            s = s.masked_fill(~_score_mask(key_mask), float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.full_like(m, EMPTY))
        p = torch.exp(s - m)
        return m, p.sum(-1, keepdim=True), p @ _up(v)


class _OwnScore(torch.autograd.Function):
    """Each query's score against its own key, sum(q * k, -1) * scale [..., 1], in fp32 (fp64 kept) from q and k in
    their own dtype, saving them as they came: autograd of the product of fp32 copies would keep the copies (bf16
    q and k twice over, in fp32)."""

    @staticmethod
    def forward(ctx, q, k, scale):
        ctx.save_for_backward(q, k)
        ctx.scale = scale
        with _autocast_off(q.device):
            return (_up(q) * _up(k)).sum(-1, keepdim=True) * scale

    @staticmethod
    def backward(ctx, ds):
        q, k = ctx.saved_tensors
        with _autocast_off(q.device):
            ds = ds * ctx.scale
            return (ds * _up(k)).to(q.dtype), (ds * _up(q)).to(k.dtype), None


class _RecomputedPartial(torch.autograd.Function):
    """:func:`_partial` of ``q`` over the concatenation of per-position keys and values, keeping for backward only
    its inputs (q and those per-position tensors, which exist anyway: no concatenated copy) and its max m, and
    recomputing the scores and probabilities in backward, as flash attention does. Saving them instead would cost
    the probabilities of every cross step (Theta(N^2 H) per layer) and a copy of a tile's earlier keys/values at
    each of its positions (Theta(N tile d) per layer). The backward is written out (a few batched products per
    call, no second autograd pass: one runs per position). Forward and backward compute the scores from the same
    inputs in the same precision (fp32, :func:`_partial`), so the gradient is that of the forward computed."""

    @staticmethod
    def forward(ctx, scale, key_mask, n_keys, q, *keys_then_values):
        k, v = torch.cat(keys_then_values[:n_keys], -2), torch.cat(keys_then_values[n_keys:], -2)
        m, l, acc = _partial(q, k, v, scale, key_mask)
        ctx.scale, ctx.key_mask, ctx.n_keys = scale, key_mask, n_keys
        ctx.save_for_backward(q, m, *keys_then_values)
        return m, l, acc

    @staticmethod
    def backward(ctx, dm, dl, dacc):
        q, m, *kv = ctx.saved_tensors
        n, scale = ctx.n_keys, ctx.scale
        with _autocast_off(q.device):  # a backward run under autocast would cast the fp32 products down
            q32, m32, dl, dacc = (_up(t) for t in (q, m, dl, dacc))
            k, v = _up(torch.cat(kv[:n], -2)), _up(torch.cat(kv[n:], -2))
            s = (q32 @ k.transpose(-1, -2)) * scale
            if ctx.key_mask is not None:
                s = s.masked_fill(~_score_mask(ctx.key_mask), float("-inf"))
            p = torch.exp(s - m32)  # 0 at masked keys
            # m is held constant (dm left out): the partial reaches the output only through exp(m) l and exp(m) acc
            # (the merges, then acc / l), which do not depend on m, so what reaches m through dm and through
            # p = exp(s - m) cancels exactly; flash attention's backward treats its row max the same way
            ds = p * (dl + dacc @ v.transpose(-1, -2))  # through l = sum p and acc = p v
            dq = (ds @ k) * scale
            dk = (ds.transpose(-1, -2) @ q32) * scale
            dv = p.transpose(-1, -2) @ dacc
        sizes = [t.shape[-2] for t in kv[:n]]
        dkv = torch.cat([dk, dv], -2).to(kv[0].dtype)  # one cast (the keys and values share the layer's dtype)
        return (None, None, None, dq.to(q.dtype), *dkv.split(sizes + sizes, -2))


def _partial_recomputed(q, keys: list, values: list, scale, key_mask=None):
    """:func:`_partial` over the keys/values lists ([B, H, n_i, hd] each, concatenated), recomputed in backward
    (:class:`_RecomputedPartial`) when gradients are on."""
    if not torch.is_grad_enabled():
        return _partial(q, torch.cat(keys, -2), torch.cat(values, -2), scale, key_mask)
    return _RecomputedPartial.apply(scale, key_mask, len(keys), q, *keys, *values)


def _merge(a, b):
    """Two partials of the same queries over disjoint key sets -> the partial over their union."""
    (m1, l1, acc1), (m2, l2, acc2) = a, b
    m = torch.maximum(m1, m2)
    w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return m, l1 * w1 + l2 * w2, acc1 * w1 + acc2 * w2


def attend_reference(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, reveal: Reveal,
                     traffic: Traffic | None = None, past: Past | None = None,
                     key_mask: torch.Tensor | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: o_t = softmax(q_t . [k_own_t; P; K_<t] / sqrt(hd)) [v_own_t; P_v; V_<t], then (K_t, V_t) =
    reveal(t, t + 1, o_t). Inputs [B, H, N, hd] (``k_own``, ``v_own`` None: no own key; a query with no key at
    all gets o = 0); returns o [B, H, N, hd]. ``past``: (keys, values, mask or None)
    of earlier tokens (a KV cache), seen by every query; ``key_mask`` [B, N]: which of these positions may be keys
    of later ones (False: a left pad); ``docs`` [B, N]: each position's document (a query sees only the earlier
    positions of its own; not with ``past``). Each query always sees its own key."""
    _check_docs(docs, past)
    n, d = q.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d)
    B = q.shape[0]
    keys, values, out = [], [], []
    p_k, p_v, p_mask = past if past is not None else (q[..., :0, :], q[..., :0, :], None)
    p_mask = p_mask if p_mask is not None else torch.ones(B, p_k.shape[-2], dtype=torch.bool, device=q.device)
    own = torch.ones(B, 0 if k_own is None else 1, dtype=torch.bool, device=q.device)
    new_mask = key_mask if key_mask is not None else torch.ones(B, n, dtype=torch.bool, device=q.device)
    for t in range(n):
        own_k, own_v = ([], []) if k_own is None else ([k_own[..., t:t + 1, :]], [v_own[..., t:t + 1, :]])
        k = torch.cat([*own_k, p_k, *keys], dim=-2)
        v = torch.cat([*own_v, p_v, *values], dim=-2)
        earlier = new_mask[:, :t] if docs is None else new_mask[:, :t] & (docs[:, :t] == docs[:, t:t + 1])
        mask = torch.cat([own, p_mask, earlier], dim=1)
        with _autocast_off(q.device):  # fp32 scores and softmax, as the tiled path's
            s = torch.einsum("bhqd,bhkd->bhqk", _up(q[..., t:t + 1, :]), _up(k)) * scale
            p = torch.softmax(s.masked_fill(~mask[:, None, None, :], float("-inf")), dim=-1)
            o = torch.nan_to_num(p, nan=0.0) @ _up(v)  # no key at all (no own key, position 0): attends to nothing, 0
        kt, vt = reveal(t, t + 1, o)
        keys.append(kt), values.append(vt), out.append(o)
        if traffic is not None:
            traffic.read += 3 * d + 2 * (t + p_k.shape[-2]) * d  # q_t, own k/v, every earlier k/v
            traffic.written += 3 * d  # o_t, k_t, v_t
    return torch.cat(out, dim=-2)


def attend_tiled(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, reveal: Reveal, tile: int = 64,
                 traffic: Traffic | None = None, past: Past | None = None,
                 key_mask: torch.Tensor | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
    """The same outputs as :func:`attend_reference` (same arguments), by divide and conquer (module docstring).
    ``tile`` >= 1. The ``past`` keys reach every query in one batched attention before the recursion."""
    if tile < 1:
        raise ValueError(f"tile={tile} must be >= 1")
    _check_docs(docs, past)
    n, d = q.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d)

    def km(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """Which keys k0..k1 the queries q0..q1 may see: [B, keys], or [B, queries, keys] with documents."""
        m = None if key_mask is None else key_mask[:, k0:k1]
        if docs is None:
            return m
        same = docs[:, q0:q1, None] == docs[:, None, k0:k1]
        return same if m is None else same & m[:, None, :]

    keys: list = [None] * n
    values: list = [None] * n
    out: list = [None] * n
    ancestors: list = []  # (first query, partial over [first query, first query + rows)) of the enclosing right halves
    tr = traffic if traffic is not None else Traffic()

    def solve(lo: int, hi: int) -> None:
        if hi - lo <= tile:
            solve_tile(lo, hi)
            return
        mid = (lo + hi) // 2
        solve(lo, mid)
        part = _partial_recomputed(q[..., mid:hi, :], keys[lo:mid], values[lo:mid], scale, km(mid, hi, lo, mid))
        tr.read += (hi - mid) * d + 2 * (mid - lo) * d  # right half's queries, left half's keys and values
        tr.written += (hi - mid) * (d + 2)  # its partial (acc, m, l per query)
        ancestors.append((mid, part))
        solve(mid, hi)
        ancestors.pop()

    def solve_tile(lo: int, hi: int) -> None:
        qt = q[..., lo:hi, :]
        if k_own is None:  # no own key: an empty partial
            z = qt.new_zeros(*qt.shape[:-1], 1, dtype=torch.promote_types(qt.dtype, torch.float32))
            stats = (z + EMPTY, z, z.expand(qt.shape) * 0)
            tr.read += (hi - lo) * d
        else:  # each query's own key: a one-key partial; its score in fp32, its value as it is (the merges with
            # the fp32 partials compute in fp32)
            s = _OwnScore.apply(qt, k_own[..., lo:hi, :], scale)
            stats = (s, torch.ones_like(s), v_own[..., lo:hi, :])
            tr.read += 3 * (hi - lo) * d
        for first, part in ancestors:  # every enclosing right half covers this tile
            stats = _merge(stats, tuple(x[..., lo - first:hi - first, :] for x in part))
            tr.read += (hi - lo) * (d + 2)
        for t in range(lo, hi):  # in order: position t's key/value exist once t is computed
            row = tuple(x[..., t - lo:t - lo + 1, :] for x in stats)
            if t > lo:  # the tile's earlier positions, in fast memory
                row = _merge(row, _partial_recomputed(q[..., t:t + 1, :], keys[lo:t], values[lo:t], scale,
                                                      km(t, t + 1, lo, t)))
            m, l, acc = row
            out[t] = acc / torch.where(l > 0, l, torch.ones_like(l))  # l = 0: no key at all, acc = 0
            keys[t], values[t] = reveal(t, t + 1, out[t])
        tr.written += 3 * (hi - lo) * d  # o, k, v of the tile

    if past is not None and past[0].shape[-2]:
        ancestors.append((0, _partial(q, past[0], past[1], scale, past[2])))  # covers every query
        tr.read += n * d + 2 * past[0].shape[-2] * d
        tr.written += n * (d + 2)
    solve(0, n)
    return torch.cat(out, dim=-2)


def _check_docs(docs: torch.Tensor | None, past: Past | None) -> None:
    if docs is not None and past is not None and past[0].shape[-2]:
        raise ValueError("document masking applies to whole windows, not after a KV cache: pass docs without past")
