"""Causal scaled dot-product attention for every block here: plain causal, after a KV cache (decoding and chunked
prefill), with a key mask (left pads, MoR's routing), and within documents (``data.document_masking``).

Kernels: PyTorch's SDPA everywhere, with a boolean mask where one is needed; within documents on CUDA,
FlexAttention with the forward's block mask (:meth:`pipeline.model.layout.TokenLayout.block_mask`), whose kernel
skips the key blocks that lie wholly in other documents (:func:`pipeline.model.layout.uses_flex` chooses).
Grouped-query attention (fewer key/value heads than query heads) goes to the kernels' own GQA support."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pipeline.model.layout import TokenLayout
from pipeline.model.layout import uses_flex


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """flex_attention compiled once (its eager form is a slow reference); the block mask is an input, so a new
    document layout does not recompile it. Dynamic shapes stay at torch's default: a length seen second (MoR's
    per-batch capacities under masking, an eval at another block size) recompiles once into a shape-generic kernel
    instead of once per length."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     key_mask: torch.Tensor | None = None, layout: TokenLayout | None = None) -> torch.Tensor:
    """Scaled dot-product attention [B, H, T, hd] of the T queries, which are the last T of the keys' positions
    (the earlier ones come from a cache), causally; ``key_mask`` ([B, keys] bool) further limits which keys may be
    attended to, each query always seeing itself; a ``layout`` with documents limits each query to its own
    document. ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention). Dropout only in the
    uncached paths (training never caches)."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    T, past = q.shape[2], k.shape[2] - q.shape[2]
    if layout is not None and layout.docs is not None:
        if past:
            raise ValueError("document masking applies to whole windows, not after a KV cache")
        if key_mask is None and uses_flex(q, dropout_p):
            return _compiled_flex()(q, k, v, block_mask=layout.block_mask(), **gqa)
        mask = layout.dense_mask()
        if key_mask is not None:
            eye = torch.eye(T, dtype=torch.bool, device=q.device)
            mask = mask & (key_mask[:, None, None, :] | eye)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, **gqa)
    if key_mask is not None:
        query_pos = torch.arange(past, past + T, device=q.device)[:, None]
        key_pos = torch.arange(past + T, device=q.device)[None, :]
        mask = (key_pos <= query_pos) & (key_mask[:, None, None, :] | (key_pos == query_pos))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, **gqa)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **gqa)
    if T == 1:  # one decoded token: it sees every cached key, so no mask, and SDPA may pick a flash/efficient kernel
        return F.scaled_dot_product_attention(q, k, v, **gqa)
    mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past)  # cached keys, then causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
