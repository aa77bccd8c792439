"""The frame the prelude / core / coda models share (GRT, Poisson, MoR, RRT, RecurTrace): token embeddings (and
learned positions with the gpt2 block), prelude blocks of ``model.block`` run once, ``recur`` (one recurrence step as
a module, its looped blocks in ``recur.blocks``), coda blocks, a final norm and the tied head; shorthand
``n_prelude + n_core x n_recurrence + n_coda``. Each model file adds its step and its loop, and builds one
:func:`~pipeline.model.layers.token_layout` per forward for :meth:`RecurrentLM.encode`, its steps and
:meth:`RecurrentLM.readout`; parallelism finds the same parts in every model (:mod:`pipeline.train.parallelize`)."""
from __future__ import annotations

import torch
import torch.nn as nn

from pipeline.model.configs import RecurrentConfig
from pipeline.model.interface import LanguageModel
from pipeline.model.layers import KVCache
from pipeline.model.layers import cache_slot
from pipeline.model.layers import lm_head
from pipeline.model.layers import norm_layer
from pipeline.model.layers import token_embedding
from pipeline.model.layers import transformer_block
from pipeline.model.layout import TokenLayout


class RecurrentLM(LanguageModel):
    def __init__(self, cfg: RecurrentConfig, recur: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.embed = token_embedding(cfg)
        self.prelude = nn.ModuleList(transformer_block(cfg) for _ in range(cfg.n_prelude))
        self.recur = recur
        self.coda = nn.ModuleList(transformer_block(cfg) for _ in range(cfg.n_coda))
        self.ln_f = norm_layer(cfg)
        self.lm_head = lm_head(cfg, self.embed)  # tied head

    def recurrent_core(self) -> nn.Module:
        return self.recur

    def encode(self, idx: torch.Tensor, start: int | torch.Tensor = 0, cache: KVCache | None = None,
               layout: TokenLayout | None = None) -> torch.Tensor:
        """Embeddings and prelude: h_pre, what the recurrence starts from or re-injects. ``start``: what
        ``cache.begin(idx)`` returned (the first position, per row in a left-padded batch). ``layout``: the
        forward's :func:`~pipeline.model.layers.token_layout` (documents, rotary angles), built once per forward."""
        h = self.embed(idx, start, layout)
        for block in self.prelude:
            h = block(h, cache_slot(cache, block), layout=layout)
        return h

    def readout(self, h: torch.Tensor, cache: KVCache | None = None, layout: TokenLayout | None = None) -> torch.Tensor:
        """Coda and final norm: the states the head reads (``layout``: the forward's, as for :meth:`encode`)."""
        for block in self.coda:
            h = block(h, cache_slot(cache, block), layout=layout)
        return self.ln_f(h)

    def grad_free_steps(self, n: int) -> int:
        """Truncated backprop (``model.backprop_steps`` k; GRT and Poisson): in training the
        first max(n - k, 0) of n steps run under no_grad and only the last min(k, n) get gradient; none without k or
        in eval mode (the caller's grad mode decides there). Every rank runs the same modules in the same order
        either way, and the last step always has gradient, so every parameter gets one (DDP needs no
        find_unused_parameters)."""
        k = getattr(self.cfg, "backprop_steps", None)
        return max(n - k, 0) if self.training and k else 0

    @classmethod
    def training_flops_per_token(cls, cfg: RecurrentConfig, n_steps: int) -> int:
        """Model FLOPs of one training step at depth ``n_steps`` (forward + backward = 3x forward, head included),
        without the backward that truncated backprop's no-grad steps skip: the trainer's MFU."""
        f = cls.flops_per_token
        k = getattr(cfg, "backprop_steps", None)
        no_grad = max(n_steps - k, 0) if k else 0
        return 3 * f(cfg, n_steps, with_head=True) - 2 * no_grad * (f(cfg, 1) - f(cfg, 0))

    @staticmethod
    def full_depth(cfg: RecurrentConfig) -> int:
        """The trained (and default evaluation) depth: n_recurrence."""
        return cfg.n_recurrence

    @staticmethod
    def shorthand(cfg: RecurrentConfig) -> str:
        return f"{cfg.n_prelude}+{cfg.n_core}x{cfg.n_recurrence}+{cfg.n_coda}"

    @staticmethod
    def block_executions(cfg: RecurrentConfig, n_steps: int | None = None) -> int:
        """Blocks run per forward at depth ``n_steps`` (default n_recurrence), the count in the paper's Eq. 1."""
        n = cfg.n_recurrence if n_steps is None else n_steps
        return cfg.n_prelude + cfg.n_core * n + cfg.n_coda
