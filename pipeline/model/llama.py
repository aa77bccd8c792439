"""The Llama-style block (``model.block: llama``): RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP, no
biases, and optionally QK-norm. It keeps the GPT-2 block's interface and its sublayer names (``ln_1``, ``attn``,
``ln_2``, ``mlp``), so every model that takes standard blocks takes it; the projections inside carry Hugging Face
Llama's names (``q_proj`` ... ``down_proj``), so a dense model exports as a stock ``LlamaForCausalLM``.

    x = x + o_proj(attention(rope(q_proj n1), rope(k_proj n1), v_proj n1)),   n1 = RMSNorm(x)
    x = x + down_proj(silu(gate_proj n2) * up_proj n2),                        n2 = RMSNorm(x)

Rotary embeddings use the half-split layout of Hugging Face's ``rotate_half`` (dimension i pairs with i + hd/2),
with angles position * theta^(-2i/hd) from the forward's :class:`pipeline.model.layout.TokenLayout`, so positions
restart at every document under document masking. QK-norm (OLMo 2, Qwen 3) is an RMSNorm over each head's
dimension on q and k, before the rotation.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.model.attention import causal_attention
from pipeline.model.kv_cache import KVSlot
from pipeline.model.layout import TokenLayout

RMS_EPS = 1e-6  # Hugging Face Llama's rms_norm_eps default, so an export computes the same norms


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalised in fp32 and cast back before the weight (as Hugging Face)."""

    def __init__(self, dim: int, eps: float = RMS_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = x.to(dtype)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * y.to(x.dtype) if x.dtype != dtype else self.weight.to(dtype) * y


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, H, T, hd] by the angles (cos, sin [B|1, 1, T, hd/2]), pairing dimension i with i + hd/2; in fp32."""
    half = x.shape[-1] // 2
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = cos.to(xf.dtype), sin.to(xf.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention: ``n_head`` query heads share ``n_kv_head`` key/value heads (a KV cache holds
    ``n_kv_head`` heads), rotary positions, optional QK-norm, no biases."""

    def __init__(self, d_model: int, n_head: int, n_kv_head: int, dropout: float, qk_norm: bool):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, d_model // n_head
        self.q_proj = nn.Linear(d_model, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, d_model, bias=False)
        self.o_proj.is_residual_projection = True
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else None
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def projections(self, x: torch.Tensor, layout: TokenLayout) -> tuple[torch.Tensor, ...]:
        """The queries [B, H, T, hd] and the keys and values [B, H_kv, T, hd] of ``x`` [B, T, d]: QK-normed, then
        rotated by the layout's angles."""
        if layout is None or layout.rope is None:
            raise ValueError("a llama block needs the forward's TokenLayout with rotary angles "
                             "(TokenLayout.build(..., rope=(head_dim, theta)))")
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, layout.rope.cos, layout.rope.sin), apply_rotary(k, layout.rope.cos, layout.rope.sin), v

    def forward(self, x: torch.Tensor, kv: KVSlot | None = None, key_mask: torch.Tensor | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.projections(x, layout)
        if kv is not None:
            k, v, key_mask = kv.update(k, v, key_mask)
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0, key_mask, layout)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * hd)))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, dropout: float):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)
        self.down_proj.is_residual_projection = True
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(RMSNorm(x)), then + SwiGLU(RMSNorm(x)). Parameters: d (2 h_q + 2 h_kv) hd
    + 3 d f + 2 d (+ 2 hd with QK-norm), f the SwiGLU hidden size."""

    positions_in_order = False

    def __init__(self, d_model: int, n_head: int, n_kv_head: int, hidden: int, dropout: float = 0.0,
                 qk_norm: bool = False):
        super().__init__()
        self.ln_1 = RMSNorm(d_model)
        self.attn = LlamaAttention(d_model, n_head, n_kv_head, dropout, qk_norm)
        self.ln_2 = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, hidden, dropout)

    def forward(self, x: torch.Tensor, kv: KVSlot | None = None, key_mask: torch.Tensor | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv, key_mask, layout)
        return x + self.mlp(self.ln_2(x))
