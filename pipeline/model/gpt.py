"""Dense GPT-2 baseline, nanoGPT-equivalent: learned positions, pre-LN blocks, GELU MLP x4, tied embeddings, biases."""
from __future__ import annotations

import torch
import torch.nn as nn

from pipeline.model.configs import GPTConfig
from pipeline.model.interface import LanguageModel
from pipeline.model.layers import KVCache
from pipeline.model.layers import block_flops_per_token
from pipeline.model.layers import cache_slot
from pipeline.model.layers import copy_full
from pipeline.model.layers import head_flops_per_token
from pipeline.model.layers import head_output
from pipeline.model.layers import init_gpt2_weights
from pipeline.model.layers import lm_head
from pipeline.model.layers import norm_layer
from pipeline.model.layers import token_embedding
from pipeline.model.layers import token_layout
from pipeline.model.layers import transformer_block


class GPT(LanguageModel):
    exits_are_layers = True  # its depth is the exit layer (no recurrence); subclasses with other blocks inherit it

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = token_embedding(cfg)
        self.blocks = nn.ModuleList(self.make_block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = norm_layer(cfg)
        self.lm_head = lm_head(cfg, self.embed)  # tied head

    @staticmethod
    def make_block(cfg: GPTConfig) -> nn.Module:
        """One layer (a subclass with another kind of layer overrides this)."""
        return transformer_block(cfg)

    def init_weights(self, seed: int, assign=copy_full) -> None:
        """GPT-2 init, each parameter from its own generator seeded by (seed, name) (see ``init_gpt2_weights``)."""
        init_gpt2_weights(self, self.cfg.n_layer, seed, assign)

    def head(self, h: torch.Tensor, targets: torch.Tensor | None):
        """(logits, None) without targets; (None, loss) with them (the fused loss never builds the logits)."""
        return head_output(self.lm_head, self.ln_f(h), targets)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, n_steps: int | None = None,
                cache: KVCache | None = None, docs: torch.Tensor | None = None):
        """(logits, None) without targets, (None, loss) with them. ``n_steps`` is the exit layer (default: all
        layers), the dense counterpart of a recurrent model's depth. With a ``cache``, ``idx`` holds only the new
        tokens and attends to the cached ones. ``docs`` [B, T]: each token's document (attention stays inside it)."""
        n = self._exit_layer(n_steps)
        start = cache.begin(idx) if cache is not None else 0
        layout = token_layout(self.cfg, idx, start, docs)
        h = self.embed(idx, start, layout)
        for block in self.blocks[:n]:
            h = block(h, cache_slot(cache, block), layout=layout)
        if cache is not None:
            cache.advance()
        return self.head(h, targets)

    def exit_states(self, idx: torch.Tensor, exits, gates: dict | None = None, *, noise: bool = False,
                    docs: torch.Tensor | None = None):
        """One pass, yielding (layer l, final-LN'd states after layer l) for each l in ``exits`` (no gates: a
        ``gates`` dict stays empty)."""
        if noise:  # nothing to turn on: this model trains without noise too (dropout is not inference noise)
            raise ValueError(f"model.type={self.cfg.type} has no inference noise: eval.noise=true is for the types in "
                             "pipeline.model.registry.NOISY_TYPES (grt, poisson); set eval.noise=false")
        wanted = sorted(set(exits))
        layout = token_layout(self.cfg, idx, docs=docs)
        h = self.embed(idx, layout=layout)
        for l, block in enumerate(self.blocks[: self._exit_layer(wanted[-1])], 1):
            h = block(h, layout=layout)
            if l in wanted:
                yield l, self.ln_f(h)

    @staticmethod
    def full_depth(cfg: GPTConfig) -> int:
        """The full depth: every layer."""
        return cfg.n_layer

    def _exit_layer(self, n_steps: int | None) -> int:
        L = self.cfg.n_layer
        if n_steps is None:
            return L
        if not 1 <= n_steps <= L:
            raise ValueError(f"exit layer n_steps={n_steps} is outside 1..{L} (model.n_layer) of this dense model")
        return n_steps

    # ---- accounting (pure functions of the config; `grt info` and the trainer's tokens/s and FLOPs use them)
    def train_depth(self, seed: int, step: int, micro_step: int | None = None) -> None:
        return None

    @staticmethod
    def shorthand(cfg: GPTConfig) -> str:
        return f"{cfg.n_layer}L"

    @staticmethod
    def block_executions(cfg: GPTConfig, n_steps: int | None = None) -> int:
        return n_steps if n_steps is not None else cfg.n_layer

    @staticmethod
    def flops_per_token(cfg: GPTConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None, executed: bool = False) -> int:
        """Paper Eq. 1 with no recurrence: L(24d^2 + 4Sd); ``n_steps`` = exit layer. ``executed`` changes nothing
        here (no step overhead to save); it is there for parity with recurrent models."""
        S = seq_len or cfg.block_size
        f = GPT.block_executions(cfg, n_steps) * block_flops_per_token(cfg, S)
        return f + (head_flops_per_token(cfg) if with_head else 0)
