"""What every model type offers, written down: the trainer, parallelize, eval and the registry ask this interface and
probe nothing. A new ``model.type`` subclasses :class:`LanguageModel` and implements its abstract members; a class
that misses one cannot be instantiated (and ``tests/test_model_interface.py`` names it)."""
from __future__ import annotations

import abc
from collections.abc import Iterable
from collections.abc import Iterator

import torch
import torch.nn as nn

from pipeline.model.configs import ModelConfig


class LanguageModel(nn.Module, metaclass=abc.ABCMeta):
    """A causal LM whose depth can be chosen per forward: the recurrence steps of a recurrent model, the exit layer of
    a stack run once. The accounting members are pure functions of the config (``grt info`` uses them unbuilt)."""

    # the depth is an exit layer of a stack run once (gpt, recurrent_transformer), not a recurrence/loop count
    exits_are_layers: bool = False
    # MoR's routing mode ("topk" | "threshold", set per instance); None for models without routing
    routing: str | None = None

    # what callers outside the model package read, set by every subclass's __init__
    cfg: ModelConfig  # the recipe's model: section the model was built from
    embed: nn.Module  # the token and position embeddings (TokenEmbedding)
    lm_head: nn.Linear  # the LM head, its weight tied to the token embeddings

    # ------------------------------------------------------------------------------------------- the module
    @abc.abstractmethod
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, n_steps: int | None = None,
                cache=None, docs: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, None) without targets, (None, loss) with them, at depth ``n_steps`` (default: the full depth).
        With a ``cache`` (:class:`pipeline.model.kv_cache.KVCache`), ``idx`` holds only the new tokens. ``docs``
        ([B, T], each token's document index, non-decreasing along T; document masking): nothing passes between
        documents, and positions restart at each (:mod:`pipeline.model.layout`)."""

    @abc.abstractmethod
    def exit_states(self, idx: torch.Tensor, exits: Iterable[int], gates: dict | None = None, *,
                    noise: bool = False, docs: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """One pass yielding (depth e, the states the head reads after e) for each e in ``exits``; a ``gates``
        dict is filled with the gate values where the model has a gate; ``docs`` as in :meth:`forward`."""

    @abc.abstractmethod
    def init_weights(self, seed: int, assign=None) -> None:
        """The initial weights, each parameter from its own generator seeded by (seed, its name)."""

    @abc.abstractmethod
    def train_depth(self, seed: int, step: int, micro_step: int | None = None) -> int | None:
        """The depth of a training forward at ``step`` (None: the model runs its own), the same on every rank. The
        types with a sampled depth also take ``depth=``, model.depth_schedule's bound (pipeline/train/curriculum.py)."""

    def recurrent_core(self) -> nn.Module | None:
        """The module run once per recurrence step (its looped blocks in ``.blocks``; the run-once blocks are
        ``prelude`` and ``coda``), or None for a stack run once (its layers in ``blocks``)."""
        return None

    # ------------------------------------------------------------------------- accounting (from the config)
    @staticmethod
    @abc.abstractmethod
    def full_depth(cfg) -> int:
        """The trained and default evaluation depth (recurrence steps, loops, or every layer)."""

    @classmethod
    def recurrence_depth(cls, cfg) -> int | None:
        """The trained number of recurrence steps (``model.n_recurrence``); None for a stack run once."""
        return None if cls.exits_are_layers else cls.full_depth(cfg)

    @staticmethod
    @abc.abstractmethod
    def shorthand(cfg) -> str:
        """The layout in a few characters, e.g. ``2+4x8+2`` or ``12L``."""

    @staticmethod
    @abc.abstractmethod
    def block_executions(cfg, n_steps: int | None = None) -> int:
        """Blocks run per forward at depth ``n_steps`` (default: the full depth), the count in the paper's Eq. 1."""

    @staticmethod
    @abc.abstractmethod
    def flops_per_token(cfg, n_steps: int | None = None, with_head: bool = False, seq_len: int | None = None,
                        executed: bool = False) -> int:
        """Forward FLOPs per token at depth ``n_steps`` (paper Eq. 1); ``executed``: after the exact step savings."""

    @classmethod
    def training_flops_per_token(cls, cfg, n_steps: int | None = None) -> int:
        """Model FLOPs of one training step (the trainer's MFU): forward + backward = 3x the forward, head included,
        unless the method counts its own (no-grad steps, capacities, a head at every loop)."""
        return 3 * cls.flops_per_token(cfg, n_steps, with_head=True)

    @staticmethod
    def flops_notes(cfg) -> list[str]:
        """How the method's real cost differs from the Eq. 1 figure (capacities, extra heads, sampled depth...)."""
        return []
