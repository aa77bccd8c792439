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
for one position at a time, in order.

:class:`Traffic` counts, analytically, the elements each algorithm moves between main memory and a fast on-chip
memory that holds one tile (its queries, keys, values and softmax statistics) — the quantity the abstract's
Theta(N^2) -> Theta(N log N) refers to; on a CPU there is no such hierarchy to measure, so it is counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Reveal = Callable[[int, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Traffic:
    """Elements read from and written to main memory."""
    read: int = 0
    written: int = 0

    @property
    def total(self) -> int:
        return self.read + self.written


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Online-softmax partial of the queries ``q`` over the keys/values ``k``, ``v`` (every key visible to every
    query): (m, l, acc) with m the row max of the scores, l = sum exp(s - m), acc = exp(s - m) @ v."""
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    return m, p.sum(-1, keepdim=True), p @ v


def _merge(a, b):
    """Two partials of the same queries over disjoint key sets -> the partial over their union."""
    (m1, l1, acc1), (m2, l2, acc2) = a, b
    m = torch.maximum(m1, m2)
    w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return m, l1 * w1 + l2 * w2, acc1 * w1 + acc2 * w2


def attend_reference(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, reveal: Reveal,
                     traffic: Traffic | None = None) -> torch.Tensor:
    """Token by token: o_t = softmax(q_t . [k_own_t; K_<t] / sqrt(hd)) [v_own_t; V_<t], then (K_t, V_t) =
    reveal(t, t + 1, o_t). Inputs [B, H, N, hd]; returns o [B, H, N, hd]."""
    n, d = q.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d)
    keys, values, out = [], [], []
    for t in range(n):
        k = torch.cat([k_own[..., t:t + 1, :], *keys], dim=-2)
        v = torch.cat([v_own[..., t:t + 1, :], *values], dim=-2)
        o = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q[..., t:t + 1, :], k) * scale, dim=-1) @ v
        kt, vt = reveal(t, t + 1, o)
        keys.append(kt), values.append(vt), out.append(o)
        if traffic is not None:
            traffic.read += 3 * d + 2 * t * d  # q_t, own k/v, every earlier k/v
            traffic.written += 3 * d  # o_t, k_t, v_t
    return torch.cat(out, dim=-2)


def attend_tiled(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, reveal: Reveal, tile: int = 64,
                 traffic: Traffic | None = None) -> torch.Tensor:
    """The same outputs as :func:`attend_reference`, by divide and conquer (module docstring). ``tile`` >= 1."""
    if tile < 1:
        raise ValueError(f"tile={tile} must be >= 1")
    n, d = q.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d)
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
        part = _partial(q[..., mid:hi, :], torch.cat(keys[lo:mid], -2), torch.cat(values[lo:mid], -2), scale)
        tr.read += (hi - mid) * d + 2 * (mid - lo) * d  # right half's queries, left half's keys and values
        tr.written += (hi - mid) * (d + 2)  # its partial (acc, m, l per query)
        ancestors.append((mid, part))
        solve(mid, hi)
        ancestors.pop()

    def solve_tile(lo: int, hi: int) -> None:
        qt = q[..., lo:hi, :]
        s = (qt * k_own[..., lo:hi, :]).sum(-1, keepdim=True) * scale  # each query's own key: a one-key partial
        stats = (s, torch.ones_like(s), v_own[..., lo:hi, :])
        tr.read += 3 * (hi - lo) * d
        for first, part in ancestors:  # every enclosing right half covers this tile
            stats = _merge(stats, tuple(x[..., lo - first:hi - first, :] for x in part))
            tr.read += (hi - lo) * (d + 2)
        for t in range(lo, hi):  # in order: position t's key/value exist once t is computed
            row = tuple(x[..., t - lo:t - lo + 1, :] for x in stats)
            if t > lo:  # the tile's earlier positions, in fast memory
                row = _merge(row, _partial(q[..., t:t + 1, :], torch.cat(keys[lo:t], -2),
                                           torch.cat(values[lo:t], -2), scale))
            out[t] = row[2] / row[1]
            keys[t], values[t] = reveal(t, t + 1, out[t])
        tr.written += 3 * (hi - lo) * d  # o, k, v of the tile

    solve(0, n)
    return torch.cat(out, dim=-2)
