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
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.model.configs import RecurrentTransformerConfig
from pipeline.model.gpt import GPT
from pipeline.model.layers import MLP
from pipeline.model.layers import LayerNorm
from pipeline.model.self_kv_attention import attend_reference
from pipeline.model.self_kv_attention import attend_tiled


class SelfKVBlock(nn.Module):
    """GPT-2's pre-LN block whose attention reads the keys/values of the block's own earlier outputs."""

    positions_in_order = True  # the positions run one after another (train.compile compiles the MLP only)

    def __init__(self, cfg: RecurrentTransformerConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg, self.n_head = cfg, cfg.n_head
        self.ln_1 = LayerNorm(d, cfg.bias)
        self.c_attn = nn.Linear(d, 3 * d, bias=cfg.bias)
        self.c_proj = nn.Linear(d, d, bias=cfg.bias)
        self.c_proj.is_residual_projection = True
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.ln_2 = LayerNorm(d, cfg.bias)
        self.mlp = MLP(d, cfg.dropout, cfg.bias)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, C = t.shape
        return t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)

    def memory_kv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, T, hd] that later positions read from the block outputs ``y`` [B, T, C]."""
        C = y.shape[-1]
        w, b = self.c_attn.weight[C:], None if self.c_attn.bias is None else self.c_attn.bias[C:]
        k, v = F.linear(self.ln_1(y), w, b).split(C, dim=2)
        return self._heads(k), self._heads(v)

    def forward(self, x: torch.Tensor, kv=None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C] -> the block's outputs. ``kv``: this block's cache slot (the earlier tokens' memory keys and
        values; the new tokens' are written after the pass); ``key_mask`` [B, T]: which new tokens may be keys."""
        B, T, C = x.shape
        q, k_own, v_own = (self._heads(t) for t in self.c_attn(self.ln_1(x)).split(C, dim=2))
        if self.cfg.own_key == "none":
            k_own = v_own = None
        outputs, revealed = [], []

        def reveal(t0: int, t1: int, o: torch.Tensor):
            y = x[:, t0:t1] + self.resid_dropout(self.c_proj(o.transpose(1, 2).reshape(B, t1 - t0, C)))
            y = y + self.mlp(self.ln_2(y))
            outputs.append(y)
            revealed.append(self.memory_kv(y))
            return revealed[-1]

        past = None
        if kv is not None and kv.k is not None and kv.cache.pos:
            a = kv.cache.pos
            past = (kv.k[:, :, :a], kv.v[:, :, :a], None if kv.cache.valid is None else kv.cache.valid[:, :a])
        if kv is not None and kv.cache.valid is not None:  # left pads among the new tokens are nobody's keys
            a = kv.cache.pos
            pads = kv.cache.valid[:, a:a + T]
            key_mask = pads if key_mask is None else key_mask & pads
        attend = attend_tiled if self.cfg.prefill == "tiled" else attend_reference
        extra = {"tile": self.cfg.tile} if self.cfg.prefill == "tiled" else {}
        attend(q, k_own, v_own, reveal, past=past, key_mask=key_mask, **extra)
        y = torch.cat(outputs, dim=1)
        if kv is not None:  # the new tokens' memory keys/values (computed once, in reveal), for the tokens after them
            kv.update(torch.cat([k for k, _ in revealed], 2), torch.cat([v for _, v in revealed], 2))
        return y


class RecurrentTransformer(GPT):
    """GPT-2 with :class:`SelfKVBlock` layers: embedding, ``n_layer`` blocks, final LN, tied head. Everything but the
    block (exits, accounting, the head) is the dense model's."""


    @staticmethod
    def make_block(cfg: RecurrentTransformerConfig) -> nn.Module:
        return SelfKVBlock(cfg)

    @staticmethod
    def shorthand(cfg: RecurrentTransformerConfig) -> str:
        return f"{cfg.n_layer}L self-KV"

    @staticmethod
    def flops_per_token(cfg: RecurrentTransformerConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None, executed: bool = False) -> int:
        """GPT-2's count (Eq. 1 without recurrence) plus each layer's memory keys/values: c_attn's key/value rows
        on ln_1 of the layer's output, 2 x 2d^2 per token; ``n_steps`` = exit layer."""
        f = GPT.flops_per_token(cfg, n_steps, with_head, seq_len, executed)
        return f + GPT.block_executions(cfg, n_steps) * 4 * cfg.d_model ** 2

    @staticmethod
    def flops_notes(cfg: RecurrentTransformerConfig) -> list[str]:
        extra = 4 * cfg.d_model ** 2 * cfg.n_layer
        notes = [f"each layer also projects its own outputs to the memory keys/values: +{extra:,} FLOPs/token over "
                 f"a GPT-2 of the same shape (counted above)"]
        if cfg.own_key == "none":
            notes.append(f"own_key=none: the block still computes the (unused) key/value of its input, another "
                         f"{extra:,} FLOPs/token not counted above")
        return notes
