"""Self-KV attention (the Recurrent Transformer's layer-wise memory): the tiled divide-and-conquer algorithm equals
the token-by-token reference in outputs and gradients (float64), at lengths and tiles that exercise every branch,
and its counted memory traffic grows as N log N where the reference's grows as N^2."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.model.self_kv_attention import Traffic
from pipeline.model.self_kv_attention import attend_reference
from pipeline.model.self_kv_attention import attend_tiled


def layer(x, w):
    """A small layer around the attention: queries and own keys/values from the input; each position's output is
    x_t + tanh(o_t W_o), whose keys/values (W_k, W_v) later positions read."""
    wq, wk, wv, wo = w

    def reveal(t0, t1, o):
        y = x[..., t0:t1, :] + torch.tanh(o @ wo)
        return y @ wk, y @ wv
    return x @ wq, x @ wk, x @ wv, reveal


def by_hand(x, w):
    """The definition written out with explicit loops over positions and keys (no softmax helper)."""
    wq, wk, wv, wo = w
    B, H, N, D = x.shape
    out = torch.zeros_like(x)
    ks, vs = [], []
    for t in range(N):
        q = x[:, :, t] @ wq
        keys = [x[:, :, t] @ wk] + ks
        vals = [x[:, :, t] @ wv] + vs
        scores = torch.stack([(q * k).sum(-1) / math.sqrt(D) for k in keys], -1)
        p = torch.exp(scores - scores.max(-1, keepdim=True).values)
        p = p / p.sum(-1, keepdim=True)
        o = sum(p[..., j:j + 1] * vals[j] for j in range(len(keys)))
        out[:, :, t] = o
        y = x[:, :, t] + torch.tanh(o @ wo)
        ks.append(y @ wk), vs.append(y @ wv)
    return out


@pytest.mark.parametrize("n,tile", [(1, 1), (2, 1), (7, 1), (7, 2), (7, 7), (16, 4), (33, 5), (40, 64)])
def test_tiled_equals_reference_outputs_and_gradients_float64(n, tile):
    torch.manual_seed(n * 100 + tile)
    x = torch.randn(2, 2, n, 4, dtype=torch.float64, requires_grad=True)
    w = [(0.7 * torch.randn(4, 4, dtype=torch.float64)).requires_grad_() for _ in range(4)]
    ref = attend_reference(*layer(x, w))
    til = attend_tiled(*layer(x, w), tile=tile)
    torch.testing.assert_close(ref, by_hand(x.detach(), [t.detach() for t in w]), rtol=0, atol=1e-12)
    torch.testing.assert_close(til, ref, rtol=0, atol=1e-12)
    probe = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * probe).sum(), [x, *w], allow_unused=True)
    g_til = torch.autograd.grad((til * probe).sum(), [x, *w], allow_unused=True)
    for a, b in zip(g_ref, g_til):  # None: no path (n = 1 never reads a revealed key); equal to a zero gradient
        a = torch.zeros_like(x[0, 0, :4, :]) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(b, a, rtol=0, atol=1e-11)


def test_a_tile_below_one_is_refused():
    x = torch.zeros(1, 1, 3, 2)
    with pytest.raises(ValueError, match="tile=0"):
        attend_tiled(*layer(x, [torch.eye(2)] * 4), tile=0)


def counted(n: int, d: int, tile: int) -> tuple[int, int]:
    """Traffic of both algorithms at length n, head dim d (one batch row, one head)."""
    torch.manual_seed(0)
    x = torch.randn(1, 1, n, d)
    w = [0.1 * torch.randn(d, d) for _ in range(4)]
    a, b = Traffic(), Traffic()
    with torch.no_grad():
        attend_reference(*layer(x, w), traffic=a)
        attend_tiled(*layer(x, w), tile=tile, traffic=b)
    return a.total, b.total


def test_traffic_is_quadratic_for_the_reference_and_n_log_n_tiled():
    """The counts equal closed forms derived by hand from what each algorithm must move (not from its counter), so
    a term the counter drops (or adds) shows; the reference's ratio to the tiled count grows ~N / log N.

    Reference: position t reads q_t, its own k_t, v_t (3d) and the 2td of the t earlier keys/values, and writes o_t,
    k_t, v_t (3d): sum over t < N of 6d + 2td = 6dN + dN(N - 1) = d (N^2 + 5N).
    Tiled, N = tile 2^k (k levels of halving): a split of [lo, hi) (L positions) reads the right half's queries
    (L/2 d) and the left half's keys and values (2 L/2 d) and writes the right half's partial (acc, m, l: L/2 (d + 2));
    level j has 2^j splits of L = N / 2^j, so each level moves 3/2 Nd + 1/2 N (d + 2). A tile reads its queries and
    own keys/values (3 tile d) and writes o, k, v (3 tile d): 6dN over the N / tile tiles. A tile also reads the
    partial of every enclosing split whose right half holds it ((d + 2) per query each): tile i (0 .. 2^k - 1) has
    popcount(i) of them, and the popcounts sum to k 2^(k-1), so N k (d + 2) / 2 in all. Total:
    6dN + k N (3/2 d + (d + 2) / 2 + (d + 2) / 2) = 6dN + k N (5d + 4) / 2."""
    d, tile = 8, 16
    rows = {n: counted(n, d, tile) for n in (64, 128, 256, 512)}
    for n, (ref, til) in rows.items():
        assert ref == d * (n * n + 5 * n), (n, ref)
        k = round(math.log2(n // tile))
        assert n == tile * 2 ** k
        assert til == 6 * d * n + k * n * (5 * d + 4) // 2, (n, til)
    ratios = [rows[n][0] / rows[n][1] for n in sorted(rows)]
    assert all(b > 1.5 * a for a, b in zip(ratios, ratios[1:])) and ratios[-1] > 4 * ratios[0], ratios  # ~N / log N


@pytest.mark.parametrize("tile", [1, 3, 64])
def test_a_cached_past_and_left_pads_give_the_reference_and_match_one_pass(tile):
    """Split a sequence into a prefix and the rest: the rest attending to the prefix's revealed keys as a cache
    (``past``) gives the same outputs as one pass over the whole; a key mask drops left pads (a pad is nobody's
    key: the outputs of the other positions equal those of the sequence without the pads)."""
    torch.manual_seed(tile)
    x = torch.randn(2, 2, 12, 4, dtype=torch.float64)
    w = [0.7 * torch.randn(4, 4, dtype=torch.float64) for _ in range(4)]
    whole = attend_reference(*layer(x, w))
    ks, vs = [], []
    q, k_own, v_own, reveal = layer(x, w)

    def keep(t0, t1, o):
        k, v = reveal(t0, t1, o)
        ks.append(k), vs.append(v)
        return k, v
    attend_tiled(q[..., :5, :], k_own[..., :5, :], v_own[..., :5, :], keep, tile=tile)
    past = (torch.cat(ks, -2), torch.cat(vs, -2), None)

    def shifted(t0, t1, o):
        return reveal(t0 + 5, t1 + 5, o)
    rest = attend_tiled(q[..., 5:, :], k_own[..., 5:, :], v_own[..., 5:, :], shifted, tile=tile, past=past)
    torch.testing.assert_close(rest, whole[..., 5:, :], rtol=0, atol=1e-12)

    pads = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    padded = torch.cat([pads, x], dim=-2)
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[:, :3] = False
    for attend, kw in ((attend_reference, {}), (attend_tiled, {"tile": tile})):
        got = attend(*layer(padded, w), key_mask=mask, **kw)
        torch.testing.assert_close(got[..., 3:, :], whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tile", [1, 2, 3])
def test_no_own_key_and_scores_far_below_zero_stay_exact(tile):
    """Without own keys, with every revealed key pointing away from every query (scores ~ -800, where exp
    underflows even in float64): tiled equals the token-by-token reference, and its gradients are finite. An empty
    partial that carried a finite max (0) would weight the real keys by exp(-800) = 0."""
    torch.manual_seed(0)
    B, H, N, d = 1, 2, 9, 4
    q = torch.full((B, H, N, d), 40.0, dtype=torch.float64, requires_grad=True)
    noise = 0.01 * torch.randn(B, H, N, d, dtype=torch.float64)
    values = torch.randn(B, H, N, d, dtype=torch.float64)

    def reveal(t0, t1, o):
        return -10.0 + noise[..., t0:t1, :] + 0 * o, values[..., t0:t1, :] + o

    ref = attend_reference(q, None, None, reveal)
    til = attend_tiled(q, None, None, reveal, tile=tile)
    torch.testing.assert_close(til, ref, rtol=1e-12, atol=1e-12)
    assert ref[..., 1:, :].abs().amax() > 0.1  # the later positions do attend (position 0 has no key: 0)
    (g,) = torch.autograd.grad(til.square().sum(), q)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), q)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)
