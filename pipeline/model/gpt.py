"""Dense GPT-2 baseline, nanoGPT-equivalent: learned positions, pre-LN blocks, GELU MLP x4, tied embeddings, biases."""
from __future__ import annotations

import torch
import torch.nn as nn

from pipeline.config import GPTConfig
from pipeline.model.layers import (Block, LayerNorm, TokenEmbedding, block_flops_per_token, head_flops_per_token,
                                   head_output, init_gpt2_weights)


class GPT(nn.Module):
    config_class = GPTConfig

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.block_size, cfg.d_model, cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_head, cfg.dropout, cfg.bias) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.d_model, cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_gpt2_weights(self, cfg.n_layer)
        self.lm_head.weight = self.embed.wte.weight  # tied head

    def head(self, h: torch.Tensor, targets: torch.Tensor | None):
        """(logits, None) without targets; (None, loss) with them (the fused loss never builds the logits)."""
        return head_output(self.lm_head, self.ln_f(h), targets)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, n_steps: int | None = None):
        """(logits, None) without targets, (None, loss) with them. ``n_steps`` exists for interface parity with
        recurrent models and must be None."""
        if n_steps is not None:
            raise ValueError("the dense GPT has no recurrence steps; n_steps must be None")
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h, targets)

    @torch.no_grad()
    def exit_losses(self, idx: torch.Tensor, targets: torch.Tensor, n_steps: int | None = None) -> dict:
        """Loss when exiting after each layer l = 1..L through the final LN and head, in one pass."""
        h = self.embed(idx)
        losses = []
        for block in self.blocks[: n_steps or len(self.blocks)]:
            h = block(h)
            losses.append(self.head(h, targets)[1].item())
        return {"exit": list(range(1, len(losses) + 1)), "loss": losses}

    # ---- accounting (pure functions of the config; `grt info` and the trainer's tokens/s and FLOPs use them)
    def train_depth(self, seed: int, step: int) -> None:
        return None

    @staticmethod
    def shorthand(cfg: GPTConfig) -> str:
        return f"{cfg.n_layer}L"

    @staticmethod
    def block_executions(cfg: GPTConfig, n_steps: int | None = None) -> int:
        return n_steps if n_steps is not None else cfg.n_layer

    @staticmethod
    def flops_per_token(cfg: GPTConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None) -> int:
        """Paper Eq. 1 with no recurrence: L(24d^2 + 4Sd); ``n_steps`` = exit layer."""
        S = seq_len or cfg.block_size
        f = GPT.block_executions(cfg, n_steps) * block_flops_per_token(cfg.d_model, S)
        return f + (head_flops_per_token(cfg.d_model, cfg.vocab_size) if with_head else 0)
