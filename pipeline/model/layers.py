"""Transformer building blocks shared by every model here: GPT-2's pre-LN block (nanoGPT-equivalent)."""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ops import linear_cross_entropy
from pipeline.model import z_loss
from pipeline.model.attention import causal_attention
from pipeline.model.configs import ModelConfig
from pipeline.model.kv_cache import KVCache  # noqa: F401 (re-exported)
from pipeline.model.kv_cache import KVCacheAtStep  # noqa: F401 (re-exported)
from pipeline.model.kv_cache import KVSlot  # noqa: F401 (re-exported)
from pipeline.model.kv_cache import at_step  # noqa: F401 (re-exported)
from pipeline.model.kv_cache import cache_slot  # noqa: F401 (re-exported)
from pipeline.model.layout import TokenLayout
from pipeline.model.llama import LlamaBlock
from pipeline.model.llama import RMSNorm
from pipeline.model.llama import SwiGLU
from pipeline.runtime.seeds import derive_seed


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1 in every path)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if w.dtype != x.dtype and torch.promote_types(w.dtype, x.dtype) == x.dtype:
            # bf16 parameters (FSDP2's param_dtype, DeepSpeed's bf16 engine) on the fp32 residual stream: normalise
            # in fp32 as CUDA autocast does (CPU autocast leaves layer_norm alone and refuses the mixed dtypes)
            w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
        return F.layer_norm(x, w.shape, w, b, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)
        self.c_proj.is_residual_projection = True
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def projections(self, x: torch.Tensor, layout: TokenLayout | None = None) -> tuple[torch.Tensor, ...]:
        """The queries, keys and values [B, H, T, hd] of ``x`` [B, T, d] (the layout is the llama block's, for its
        rotary angles; learned positions are already in ``x``)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        return tuple(t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))

    def forward(self, x: torch.Tensor, kv: "KVSlot | None" = None, key_mask: torch.Tensor | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """Causal self-attention (within documents when the ``layout`` has them).
        ``key_mask`` ([B, T] bool, for the tokens of ``x``; a cache slot keeps those of
        earlier tokens and masks left pads): which positions may be attended to; each query also sees itself, so no
        row is empty."""
        B, T, C = x.shape
        q, k, v = self.projections(x)
        if kv is not None:
            k, v, key_mask = kv.update(k, v, key_mask)
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0, key_mask, layout)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model, bias=bias)
        self.c_proj = nn.Linear(4 * d_model, d_model, bias=bias)
        self.c_proj.is_residual_projection = True
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then + mlp(ln(x)). 12d^2 + 13d parameters with biases."""

    positions_in_order = False  # all positions at once (a self-KV block runs them one after another: compile its MLP)

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.ln_1 = LayerNorm(d_model, bias)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, bias)
        self.ln_2 = LayerNorm(d_model, bias)
        self.mlp = MLP(d_model, dropout, bias)

    def forward(self, x: torch.Tensor, kv: "KVSlot | None" = None, key_mask: torch.Tensor | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv, key_mask, layout)
        return x + self.mlp(self.ln_2(x))


class TokenEmbedding(nn.Module):
    """Token embeddings (``rows`` >= the vocabulary: padded rows are never read by the head) + learned position
    embeddings (the GPT-2 block; none with rotary positions: ``block_size`` None), with dropout."""

    def __init__(self, vocab_size: int, block_size: int | None, d_model: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model) if block_size is not None else None
        self.drop = nn.Dropout(dropout)
        self.block_size = block_size

    def forward(self, idx: torch.Tensor, start: int | torch.Tensor = 0,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """``start``: the first token's position, or one per row ([B] long, from a left-padded KVCache: row b's
        j-th token is at start[b] + j, negative for its left pads, which are embedded at 0 and never attended to).
        A ``layout`` gives the positions instead (restarting at each document)."""
        x = self.wte(idx)
        if self.wpe is not None:
            T = idx.shape[1]
            if layout is not None:
                pos = layout.positions
                length = int(pos.max()) + 1 if isinstance(start, torch.Tensor) else start + T
            elif isinstance(start, torch.Tensor):
                pos = (start[:, None] + torch.arange(T, device=idx.device)).clamp(min=0)
                length = int(pos[:, -1].max()) + 1  # one device sync, on the padded path only
            else:
                pos, length = start + torch.arange(T, device=idx.device), start + T
            if length > self.block_size:
                raise ValueError(f"sequence length {length} exceeds model.block_size={self.block_size}; "
                                 f"shorten the input or raise model.block_size")
            x = x + self.wpe(pos)
        if torch.is_autocast_enabled(x.device.type):
            # mixed precision: the residual stream (and a recurrent model's state) starts in fp32 whatever dtype the
            # parameters are held in (DeepSpeed's bf16 engine casts them all to bf16), as under single and DDP
            x = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.drop(x)


def token_embedding(cfg: ModelConfig) -> TokenEmbedding:
    """The embeddings of ``cfg``: learned positions for the gpt2 block, none for llama (rotary positions)."""
    return TokenEmbedding(cfg.embedding_rows(), cfg.block_size if cfg.block == "gpt2" else None, cfg.d_model,
                          cfg.dropout)


def transformer_block(cfg: ModelConfig) -> nn.Module:
    """One standard block of ``cfg.block``: GPT-2's pre-LN block or the Llama-style block."""
    if cfg.block == "llama":
        return LlamaBlock(cfg.d_model, cfg.n_head, cfg.kv_heads(),
                          cfg.mlp_hidden(), cfg.dropout, cfg.qk_norm)
    return Block(cfg.d_model, cfg.n_head, cfg.dropout, cfg.bias)


def norm_layer(cfg: ModelConfig) -> nn.Module:
    """The norm of ``cfg.block``, before the head and inside blocks built outside this module: LayerNorm or
    RMSNorm."""
    return RMSNorm(cfg.d_model) if cfg.block == "llama" else LayerNorm(cfg.d_model, cfg.bias)


def feed_forward(cfg: ModelConfig) -> nn.Module:
    """The MLP of ``cfg.block``: GPT-2's GELU x4 or the llama block's SwiGLU."""
    if cfg.block == "llama":
        return SwiGLU(cfg.d_model, cfg.mlp_hidden(), cfg.dropout)
    return MLP(cfg.d_model, cfg.dropout, cfg.bias)


def lm_head(cfg: ModelConfig, embed: TokenEmbedding) -> nn.Linear:
    """The LM head, its weight tied to the token embeddings; it predicts only the first ``vocab_size`` rows."""
    head = nn.Linear(cfg.d_model, cfg.embedding_rows(), bias=False)
    head.weight = embed.wte.weight
    head.n_vocab = cfg.vocab_size  # read by head_output: the padded rows are never predicted
    return head


def token_layout(cfg: ModelConfig, idx: torch.Tensor, start: int | torch.Tensor = 0,
                 docs: torch.Tensor | None = None) -> TokenLayout | None:
    """The forward's :class:`TokenLayout`, built once and handed to every block; None for the gpt2 block without
    documents (positions are the embedding's business there, and attention is plain causal: the paper's path)."""
    if cfg.block == "gpt2" and docs is None:
        return None
    rope = (cfg.head_dim(), cfg.rope_theta) if cfg.block == "llama" else None
    return TokenLayout.build(idx, start, docs, rope)


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s own generator: its initial value depends on (seed, name) alone, not on the
    order of construction, the device or how the parameter is sharded."""
    return derive_seed("init", seed, name)


def gpt2_init_value(module: nn.Module, attr: str, shape: torch.Size, gen: torch.Generator,
                    std_resid: float) -> torch.Tensor:
    """The full fp32 CPU initial value of ``module.<attr>`` under the GPT-2 rule: N(0, 0.02) for linear and embedding
    weights, N(0, std_resid) for residual projections (``is_residual_projection``), N(0, module.init_std) where a
    module sets ``init_std`` (0: zeros), biases at the module's ``bias_init`` (0 unless set), LayerNorm weight 1 and
    bias 0 (RMSNorm weight 1); any other module's parameters by its own ``init_value(attr, shape)``."""
    if isinstance(module, (LayerNorm, RMSNorm)):
        return torch.ones(shape) if attr == "weight" else torch.zeros(shape)
    if isinstance(module, nn.Linear) and attr == "bias":
        return torch.full(shape, float(getattr(module, "bias_init", 0.0)))
    if isinstance(module, (nn.Linear, nn.Embedding)) and attr == "weight":
        std = std_resid if getattr(module, "is_residual_projection", False) else 0.02
        std = getattr(module, "init_std", std)  # a module's own rule (e.g. a LoRA B at 0)
        if std == 0:
            return torch.zeros(shape)
        return torch.empty(shape).normal_(0.0, std, generator=gen)
    if hasattr(module, "init_value"):  # a module with a rule of its own (static hyper-connections: the paper's)
        return module.init_value(attr, shape)
    raise TypeError(f"no initialisation rule for parameter {attr!r} of {type(module).__name__}; add one to "
                    f"pipeline.model.layers.gpt2_init_value")


def copy_full(param: nn.Parameter, make: Callable[[torch.Size], torch.Tensor]) -> None:
    """Write a parameter held whole on this process: ``make(shape)`` is its full initial value."""
    param.copy_(make(param.shape))


@torch.no_grad()
def init_gpt2_weights(model: nn.Module, n_residual_layers: int, seed: int, assign=copy_full) -> None:
    """GPT-2 init of every parameter, each from its own generator seeded by (seed, parameter name), one parameter at a
    time; ``assign(param, make)`` writes ``make(full_shape)`` into the parameter (:func:`copy_full` for a whole
    tensor; the trainer passes one that keeps only this rank's shard). A tied parameter is written once, under its
    first name.

    ``n_residual_layers`` is the number of block applications on the residual path (for GRT: block executions at
    the maximum depth), as in GPT-2 where it is the number of layers.
    """
    std_resid = 0.02 / math.sqrt(2 * n_residual_layers)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        assign(param, functools.partial(gpt2_init_value, modules[owner], attr, gen=gen, std_resid=std_resid))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and softmaxes accumulate in: fp32 for bf16/fp16/fp32, fp64 kept."""
    return torch.promote_types(dtype, torch.float32)


def predicted_weight(lm_head: nn.Linear) -> torch.Tensor:
    """The head's rows that are predicted: the first ``n_vocab`` (a padded vocabulary's extra rows never are)."""
    return lm_head.weight[:getattr(lm_head, "n_vocab", lm_head.out_features)]


def head_output(lm_head: nn.Linear, h: torch.Tensor, targets: torch.Tensor | None):
    """The LM head on final-LN'd states: (logits, None) without targets; with them (None, mean next-token
    cross-entropy in nats, + train.z_loss's term in training), fused and chunked so the full logits are never
    materialised (-1 targets ignored). A padded vocabulary (``model.vocab_multiple``) predicts only its first
    ``lm_head.n_vocab`` rows: the padding never gets a logit or a share of the softmax. The logits come from calling
    the module (hooks on it see them: :func:`pipeline.infer.generate.last_position_head`)."""
    if targets is None:
        logits = lm_head(h)
        n_vocab = getattr(lm_head, "n_vocab", lm_head.out_features)
        return (logits if n_vocab == lm_head.out_features else logits[..., :n_vocab]), None
    coef = z_loss.coefficient(lm_head)  # train.z_loss, training forwards only (pipeline/model/z_loss.py)
    if not coef:
        return None, linear_cross_entropy(h, predicted_weight(lm_head), targets)
    z = z_loss.new_buffer(targets, h)
    loss = linear_cross_entropy(h, predicted_weight(lm_head), targets, z_loss=coef, z_out=z)
    z_loss.record(lm_head, coef, z, targets)
    return None, loss


def block_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Paper Eq. 1: forward FLOPs per token of one block, 2 x its projection weights (24d^2 for GPT-2's block;
    2d(2d + 2 d_kv + 3f) for the llama block, d_kv = n_kv_head * head size, f the SwiGLU hidden size) + 4Sd, the two
    attention matmuls over the S keys of a full causal window. Under document masking the kernel may skip the key
    blocks of other documents; the model FLOPs (and MFU) still count 4Sd, the convention of the unmasked window,
    so a masked and an unmasked run of the same recipe report the same FLOPs (bench/document_masking.py measures the
    share masking saves)."""
    d = cfg.d_model
    return 2 * block_weight_params(cfg) + 4 * seq_len * d


def block_weight_params(cfg: ModelConfig) -> int:
    """Matmul weights of one standard block (no norms, no biases): 12d^2 for GPT-2's; d(2d + 2 d_kv) + 3df for
    the llama block."""
    d = cfg.d_model
    if cfg.block == "llama":
        d_kv = cfg.kv_dim()
        return d * (2 * d + 2 * d_kv) + 3 * d * cfg.mlp_hidden()
    return 12 * d * d


def head_flops_per_token(cfg: ModelConfig) -> int:
    """The tied LM head: one d x V matmul over the real vocabulary (the padding rows are never computed), 2dV."""
    return 2 * cfg.d_model * cfg.vocab_size
