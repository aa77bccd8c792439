"""Recurrent Transformer (companion abstract, "each layer attends to key-value pairs computed off its own
activations"): a GPT-2 stack in which layer l's keys/values of an earlier position s come from layer l's OUTPUT at
s, not its input. Position t at layer l thus reads the layer's own earlier results (layer-wise recurrent memory) while
decoding costs what a standard transformer's does: one key/value per layer per token, appended once the token's
layer output exists.

The abstract states the idea only; the choices where it is silent (each the simplest reading):
- one set of projections: the block is GPT-2's pre-LN block, and the memory keys/values of position s are its
  c_attn key/value projections applied to ln_1 of the block's output at s (so the parameters equal GPT-2's, block
  for block, and "parameter-matched" is a matter of the layer count and width);
- the output at s is the whole block's (after the MLP);
- position t also attends to the key/value of its own input (ln_1 of x_t), as a standard block does, so position 0
  has a key (``model.own_key: input``); ``none`` drops it (position 0 then attends to nothing and its attention
  output is 0), the stricter reading of "attends to key-value pairs computed off its own activations".
Prefill and training process the positions in order inside each layer (``model.prefill: tiled``, the abstract's
exact tiling, Theta(N log N) memory traffic; ``reference``, token by token): see
:mod:`pipeline.model.self_kv_attention`.

With ``model.block: llama`` the same definition with the llama block's parts: RMSNorm, q/k/v/o_proj with
grouped-query heads (``n_kv_head`` memory keys/values per token, query head h reading kv head h // group), optional
QK-norm, a SwiGLU MLP, and rotary positions: the query and the own key at t are rotated by t, each memory key by its
own position s (as a cached key of a standard block), so a score depends on t - s. Under document masking
(``docs``) a token reads only the memory of the earlier tokens of its own document, and positions (learned or
rotary) restart at each document: each document is computed as if alone.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.model.configs import RecurrentTransformerConfig
from pipeline.model.gpt import GPT
from pipeline.model.layers import LayerNorm
from pipeline.model.layers import feed_forward
from pipeline.model.layout import TokenLayout
from pipeline.model.llama import LlamaAttention
from pipeline.model.llama import RMSNorm
from pipeline.model.llama import apply_rotary
from pipeline.model.self_kv_attention import attend_reference
from pipeline.model.self_kv_attention import attend_tiled


class SelfKVBlock(nn.Module):
    """A pre-norm block whose attention reads the keys/values of the block's own earlier outputs: GPT-2's (LayerNorm,
    c_attn/c_proj, GELU MLP) or, with ``model.block: llama``, the llama block's (RMSNorm, q/k/v/o_proj with
    grouped-query heads, optional QK-norm, rotary angles of each key's own position, SwiGLU)."""

    positions_in_order = True  # the positions run one after another (train.compile compiles the MLP only)

    def __init__(self, cfg: RecurrentTransformerConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg, self.n_head, self.llama = cfg, cfg.n_head, cfg.block == "llama"
        if self.llama:
            self.ln_1 = RMSNorm(d)
            self.attn = LlamaAttention(d, cfg.n_head, cfg.kv_heads(), cfg.dropout, cfg.qk_norm)
            self.ln_2 = RMSNorm(d)
            self.mlp = feed_forward(cfg)
            return
        self.ln_1 = LayerNorm(d, cfg.bias)
        self.c_attn = nn.Linear(d, 3 * d, bias=cfg.bias)
        self.c_proj = nn.Linear(d, d, bias=cfg.bias)
        self.c_proj.is_residual_projection = True
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.ln_2 = LayerNorm(d, cfg.bias)
        self.mlp = feed_forward(cfg)

    def _heads(self, t: torch.Tensor, n_head: int | None = None) -> torch.Tensor:
        B, T, C = t.shape
        n_head = n_head or self.n_head
        return t.view(B, T, n_head, C // n_head).transpose(1, 2)

    def _shared(self, t: torch.Tensor) -> torch.Tensor:
        """Grouped-query keys/values [B, n_kv_head, T, hd] -> one per query head (query head h reads kv head
        h // group, as SDPA's enable_gqa); the gpt2 block's as they are."""
        group = self.n_head // t.shape[1]
        return t if group == 1 else t.repeat_interleave(group, dim=1)

    def _rotate(self, t: torch.Tensor, layout: TokenLayout, t0: int, t1: int) -> torch.Tensor:
        """Rotary angles of positions t0..t1 of the forward's layout (restarting at each document)."""
        return apply_rotary(t, layout.rope.cos[:, :, t0:t1], layout.rope.sin[:, :, t0:t1])

    def input_qkv(self, x: torch.Tensor, layout: TokenLayout | None):
        """The queries, and the own keys/values, [B, heads, T, hd], of the block inputs ``x`` [B, T, C]."""
        h = self.ln_1(x)
        if not self.llama:
            return (self._heads(t) for t in self.c_attn(h).split(x.shape[-1], dim=2))
        if layout is None or layout.rope is None:
            raise ValueError("a llama self-KV block needs the forward's TokenLayout with rotary angles")
        a, T = self.attn, x.shape[1]
        q = self._heads(a.q_proj(h))
        k, v = self._heads(a.k_proj(h), a.n_kv_head), self._heads(a.v_proj(h), a.n_kv_head)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        return self._rotate(q, layout, 0, T), self._rotate(k, layout, 0, T), v

    def memory_kv(self, y: torch.Tensor, layout: TokenLayout | None = None,
                  t0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv heads, T, hd] that later positions read from the block outputs ``y`` [B, T, C] of
        positions t0.. (the llama block rotates each key by its own position)."""
        C = y.shape[-1]
        if not self.llama:
            w, b = self.c_attn.weight[C:], None if self.c_attn.bias is None else self.c_attn.bias[C:]
            k, v = F.linear(self.ln_1(y), w, b).split(C, dim=2)
            return self._heads(k), self._heads(v)
        a, h = self.attn, self.ln_1(y)
        k, v = self._heads(a.k_proj(h), a.n_kv_head), self._heads(a.v_proj(h), a.n_kv_head)
        if a.k_norm is not None:
            k = a.k_norm(k)
        return self._rotate(k, layout, t0, t0 + y.shape[1]), v

    def attention_output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention outputs [B, T, C] (heads merged) through the output projection."""
        if self.llama:
            return self.attn.resid_dropout(self.attn.o_proj(o))
        return self.resid_dropout(self.c_proj(o))

    def forward(self, x: torch.Tensor, kv=None, key_mask: torch.Tensor | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """x [B, T, C] -> the block's outputs. ``kv``: this block's cache slot (the earlier tokens' memory keys and
        values; the new tokens' are written after the pass); ``key_mask`` [B, T]: which new tokens may be keys;
        ``layout``: the forward's (documents: a token reads only its own document's memory; rotary angles)."""
        B, T, C = x.shape
        q, k_own, v_own = self.input_qkv(x, layout)
        if self.cfg.own_key == "none":
            k_own = v_own = None
        else:
            k_own, v_own = self._shared(k_own), self._shared(v_own)
        outputs, revealed = [], []

        def reveal(t0: int, t1: int, o: torch.Tensor):
            y = x[:, t0:t1] + self.attention_output(o.transpose(1, 2).reshape(B, t1 - t0, C))
            y = y + self.mlp(self.ln_2(y))
            outputs.append(y)
            revealed.append(self.memory_kv(y, layout, t0))
            return tuple(self._shared(t) for t in revealed[-1])

        past = None
        if kv is not None and kv.k is not None and kv.cache.pos:
            a = kv.cache.pos
            past = (self._shared(kv.k[:, :, :a]), self._shared(kv.v[:, :, :a]),
                    None if kv.cache.valid is None else kv.cache.valid[:, :a])
        if kv is not None and kv.cache.valid is not None:  # left pads among the new tokens are nobody's keys
            a = kv.cache.pos
            pads = kv.cache.valid[:, a:a + T]
            key_mask = pads if key_mask is None else key_mask & pads
        attend = attend_tiled if self.cfg.prefill == "tiled" else attend_reference
        extra = {"tile": self.cfg.tile} if self.cfg.prefill == "tiled" else {}
        docs = None if layout is None else layout.docs
        attend(q, k_own, v_own, reveal, past=past, key_mask=key_mask, docs=docs, **extra)
        y = torch.cat(outputs, dim=1)
        if kv is not None:  # the new tokens' memory keys/values (computed once, in reveal), for the tokens after them
            kv.update(torch.cat([k for k, _ in revealed], 2), torch.cat([v for _, v in revealed], 2))
        return y


class RecurrentTransformer(GPT):
    """The dense model with :class:`SelfKVBlock` layers: embedding, ``n_layer`` blocks, final norm, tied head.
    Everything but the block (exits, documents, accounting, the head) is the dense model's."""

    @staticmethod
    def make_block(cfg: RecurrentTransformerConfig) -> nn.Module:
        return SelfKVBlock(cfg)

    @staticmethod
    def shorthand(cfg: RecurrentTransformerConfig) -> str:
        return f"{cfg.n_layer}L self-KV"

    @staticmethod
    def flops_per_token(cfg: RecurrentTransformerConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None, executed: bool = False) -> int:
        """The dense count (Eq. 1 without recurrence) plus each layer's memory keys/values: the key/value
        projections on the norm of the layer's output, 2 x 2 d d_kv per token (4d^2 for GPT-2's block, d_kv = d);
        ``n_steps`` = exit layer."""
        f = GPT.flops_per_token(cfg, n_steps, with_head, seq_len, executed)
        return f + GPT.block_executions(cfg, n_steps) * memory_kv_flops(cfg)

    @staticmethod
    def flops_notes(cfg: RecurrentTransformerConfig) -> list[str]:
        extra = memory_kv_flops(cfg) * cfg.n_layer
        dense = "a GPT-2" if cfg.block == "gpt2" else "the dense llama model"
        notes = [f"each layer also projects its own outputs to the memory keys/values: +{extra:,} FLOPs/token over "
                 f"{dense} of the same shape (counted above)"]
        if cfg.own_key == "none":
            notes.append(f"own_key=none: the block still computes the (unused) key/value of its input, another "
                         f"{extra:,} FLOPs/token not counted above")
        return notes


def memory_kv_flops(cfg: RecurrentTransformerConfig) -> int:
    """One layer's memory key/value projections per token: 2 x 2 d d_kv (d_kv = kv heads x head size)."""
    d = cfg.d_model
    return 4 * d * cfg.kv_dim()
