"""Static hyper-connections in GRT's looped core (``model.hyper_streams = n``; 1 = off, the plain core).

Follows Zhu et al. 2024, "Hyper-Connections" (arXiv 2409.19606, ICLR 2025), the static form (SHC, §2.1): the
residual stream is widened into n parallel streams H = [h_1 .. h_n] (n x d per token), and every sublayer T (each
block's attention and its MLP, each with its pre-LN) gets its own learned connection matrix

    HC = [[0,   B  ],        B   in R^{1 x n}  depth weights: how much of T's output each stream receives
          [A_m, A_r]]        A_m in R^{n x 1}  width weights: the mix of the streams that T reads
                             A_r in R^{n x n}  the residual mix of the streams into each other

    h_0 = A_m^T H            (T's input, one d-vector per token)
    H^  = B^T T(h_0) + A_r^T H     i.e.  stream i  <-  B_i T(h_0) + sum_j A_r[j, i] h_j

initialised as the paper's Eq. 14 so that the network starts as its pre-norm residual counterpart: for the k-th
sublayer A_m = e_{k mod n}, A_r = I_n, B = 1.

The reading chosen here (the abstract names hyper-connections as a switch of the phi measurement, nothing more): the
streams live inside the looped core of one recurrence step. The step's core input x (W_proj's output) is
replicated into the n streams (the paper replicates its network input the same way), the core's sublayers are
numbered k = 0 .. 2 n_core - 1 over the core (block i: attention 2i, MLP 2i + 1), the same parameters at every
recurrence step as the blocks' own, and after the last core block the streams are averaged back to one d-vector per
token (the paper sums the streams at the network's end; the mean makes the hyper-connected core at its
initialisation, where all streams stay equal, exactly the plain core, so hyper_streams=n starts as the plain GRT).
The recurrent state h, the gate and the prelude/coda are untouched.

Each hyper-connected block holds the sublayers of a standard block of ``model.block`` (GPT-2's or the Llama-style
one) under their own names (``ln_1``, ``attn``, ``ln_2``, ``mlp``: the parameter names of a plain block, so gpt2
checkpoints keep their keys), plus ``hc_attn`` and ``hc_mlp``: n + n^2 + n parameters each (not weight-decayed: the
optimizer decays Linear weights only). The first core block takes [B, T, d] and returns the streams [n, B, T, d];
the last takes the streams and returns [B, T, d]; so ``RecurrentStep``'s loop over its blocks is unchanged. The
stream mixes run with autocast off, in the streams' dtype (that of the core input, as the plain core's residual
adds), so a bf16 matmul never rounds an fp32 stream.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from pipeline.model.configs import GRTConfig
from pipeline.model.layers import KVSlot
from pipeline.model.layers import transformer_block
from pipeline.model.layout import TokenLayout


def mix_streams(weights: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_j weights[j, i] streams[j] for every column i: ``weights`` [n, m], ``streams`` [n, ...] -> [m, ...]. One
    small matmul over the flattened streams, with autocast off so that it runs in the streams' dtype."""
    n, m = weights.shape
    with torch.autocast(streams.device.type, enabled=False):
        out = weights.t().to(streams.dtype) @ streams.reshape(n, -1)
    return out.view(m, *streams.shape[1:])


class StaticHyperConnection(nn.Module):
    """The static hyper-connection of sublayer ``k`` over ``n`` streams (Zhu et al. 2024, Eqs. 1-5, init Eq. 14):
    ``a_m`` = A_m (width weights, [n]), ``a_r`` = A_r (residual mix, [n, n]), ``b`` = B (depth weights, [n])."""

    def __init__(self, n: int, k: int):
        super().__init__()
        self.n, self.k = n, k
        # built at the paper's initialisation (a model built on meta gets it again from init_gpt2_weights)
        self.a_m = nn.Parameter(self.init_value("a_m", torch.Size([n])))
        self.a_r = nn.Parameter(self.init_value("a_r", torch.Size([n, n])))
        self.b = nn.Parameter(self.init_value("b", torch.Size([n])))

    def init_value(self, attr: str, shape: torch.Size) -> torch.Tensor:
        """Paper Eq. 14, the pre-norm residual connection in hyper-connection form: A_m = e_{k mod n}, A_r = I,
        B = 1 (read by :func:`pipeline.model.layers.gpt2_init_value`, the one init rule of every parameter)."""
        if attr == "a_m":
            return torch.zeros(shape).index_fill_(0, torch.tensor([self.k % self.n]), 1.0)
        if attr == "a_r":
            return torch.eye(self.n).reshape(shape)
        if attr == "b":
            return torch.ones(shape)
        raise ValueError(f"StaticHyperConnection has no parameter {attr!r}")

    def forward(self, streams: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """H^ = B^T T(h_0) + A_r^T H with h_0 = A_m^T H and T = ``sublayer`` ([B, T, d] -> [B, T, d]): streams
        [n, B, T, d] in and out. The sublayer runs inside this call, so the mixing weights are used inside their own
        module's forward, where FSDP and ZeRO-3 gather parameters."""
        out = sublayer(mix_streams(self.a_m[:, None], streams)[0])
        return self.b.to(streams.dtype).view(-1, *[1] * out.dim()) * out + mix_streams(self.a_r, streams)

    def extra_repr(self) -> str:
        return f"n={self.n}, k={self.k}"


class HyperConnectedBlock(nn.Module):
    """A standard pre-norm block (``block``, of either kind) with a static hyper-connection around each sublayer in
    place of its residual add. The block's sublayers become this module's own (``ln_1``, ``attn``, ``ln_2``,
    ``mlp``), so parameter names and values are those of the plain block. The first core block (``first``)
    replicates its [B, T, d] input into the n streams; the last (``last``) returns their mean; the others take and
    return the streams [n, B, T, d]."""

    positions_in_order = False  # a standard block's sublayers: all positions at once

    def __init__(self, block: nn.Module, n: int, index: int, first: bool, last: bool):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = block.ln_1, block.attn, block.ln_2, block.mlp
        self.n, self.first, self.last = n, first, last
        self.hc_attn = StaticHyperConnection(n, 2 * index)  # sublayers numbered over the core
        self.hc_mlp = StaticHyperConnection(n, 2 * index + 1)

    def forward(self, x: torch.Tensor, kv: KVSlot | None = None, key_mask: torch.Tensor | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        H = x.expand(self.n, *x.shape) if self.first else x  # the paper's H^0: the input replicated n times
        H = self.hc_attn(H, lambda h: self.attn(self.ln_1(h), kv, key_mask, layout))
        H = self.hc_mlp(H, lambda h: self.mlp(self.ln_2(h)))
        return H.mean(0) if self.last else H

    def extra_repr(self) -> str:
        return f"streams={self.n}, first={self.first}, last={self.last}"


def core_blocks(cfg: GRTConfig) -> nn.ModuleList:
    """GRT's looped core: ``n_core`` standard blocks of ``cfg.block``, or hyper-connected ones over
    ``cfg.hyper_streams`` > 1 streams."""
    n = cfg.hyper_streams
    if n == 1:
        return nn.ModuleList(transformer_block(cfg) for _ in range(cfg.n_core))
    return nn.ModuleList(HyperConnectedBlock(transformer_block(cfg), n, i, first=i == 0, last=i == cfg.n_core - 1)
                         for i in range(cfg.n_core))
