"""Relaxed Recursive Transformer (Bae et al., ICLR 2025): a core of ``n_core`` blocks strictly shared across
``n_recurrence`` recursions, relaxed by one LoRA per recursion on every projection of every core block.

In the paper's 1+1x10+1 comparison layout: prelude blocks once, the core N_r times, coda blocks, final LN, tied head.

    h^(0) = prelude(embed(x))
    h^(r) = core_r(h^(r-1)),  r = 1..N_r        (no gate, no re-injection of h^(0): RRT has neither)
    logits = W_e LN(coda(h^(N_r)))

core_r is the shared core with every projection (attention c_attn and c_proj, MLP c_fc and c_proj) replaced by

    W x + b + (alpha / rank) B_r A_r x,     A_r: rank x d_in,  B_r: d_out x rank,

where W, b are shared by all recursions and (A_r, B_r) belong to recursion r alone. B_r = 0 at init, so every
recursion starts as the strictly shared model. RRT is depth-fixed (one LoRA per recursion): it trains at N_r with
the plain next-token loss and exits at e = 0..N_r, exit e using the LoRAs of recursions 1..e.

With the llama block (``model.block: llama``) the core is the llama block with the same relaxation on each of its
seven projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: no biases); prelude and coda are
the standard blocks of ``model.block``. Under document masking one
:class:`~pipeline.model.layout.TokenLayout` per forward serves every block of every recursion.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.model.attention import causal_attention
from pipeline.model.configs import RRTConfig
from pipeline.model.layers import KVCache
from pipeline.model.layers import KVCacheAtStep
from pipeline.model.layers import KVSlot
from pipeline.model.layers import at_step
from pipeline.model.layers import block_flops_per_token
from pipeline.model.layers import block_weight_params
from pipeline.model.layers import cache_slot
from pipeline.model.layers import copy_full
from pipeline.model.layers import head_flops_per_token
from pipeline.model.layers import head_output
from pipeline.model.layers import init_gpt2_weights
from pipeline.model.layers import norm_layer
from pipeline.model.layers import token_layout
from pipeline.model.layout import TokenLayout
from pipeline.model.llama import RMSNorm
from pipeline.model.llama import apply_rotary
from pipeline.model.recurrent import RecurrentLM


class LoRALinear(nn.Linear):
    """y = W x + b + (alpha / rank) B_r A_r x for recursion r (0-based in code and checkpoint keys: ``lora_A.3`` is
    the 4th recursion's A). W and b are the plain Linear's own parameters (same keys as a shared model's).

    Init: B_r = 0 (``init_std = 0``, read by ``layers.gpt2_init_value``). A_r ~ N(0, 0.02), the GPT-2 rule of every
    other linear weight here. The paper initialises (A_r, B_r) from a truncated SVD of the residual between a
    pretrained layer and its tied weight; trained from scratch there is no pretrained layer, so we use the standard
    LoRA recipe of random A and zero B instead (PEFT's Kaiming-uniform A has std 1/sqrt(3 d_in), ~0.021 at d = 768).
    No LoRA dropout: the model's ``dropout`` already applies to the block outputs."""

    def __init__(self, d_in: int, d_out: int, bias: bool, n_recurrence: int, rank: int, alpha: float):
        super().__init__(d_in, d_out, bias=bias)
        self.scale = alpha / rank
        self.lora_A = nn.ModuleList(nn.Linear(d_in, rank, bias=False) for _ in range(n_recurrence))
        self.lora_B = nn.ModuleList(nn.Linear(rank, d_out, bias=False) for _ in range(n_recurrence))
        for lora_b in self.lora_B:
            lora_b.init_std = 0.0  # every recursion starts identical to the strictly shared model

    def forward(self, x: torch.Tensor, r: int) -> torch.Tensor:
        return super().forward(x) + self.scale * self.lora_B[r](self.lora_A[r](x))


class RRTAttention(nn.Module):
    """layers.CausalSelfAttention with LoRA'd projections: the same attention math, the recursion index passed in."""

    def __init__(self, cfg: RRTConfig):
        super().__init__()
        d, lora = cfg.d_model, (cfg.n_recurrence, cfg.lora_rank, cfg.lora_alpha)
        self.n_head = cfg.n_head
        self.c_attn = LoRALinear(d, 3 * d, cfg.bias, *lora)
        self.c_proj = LoRALinear(d, d, cfg.bias, *lora)
        self.c_proj.is_residual_projection = True  # the shared W only; its LoRA children keep std 0.02 / 0
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, r: int, kv: KVSlot | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x, r).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        key_mask = None
        if kv is not None:
            k, v, key_mask = kv.update(k, v)  # key_mask: a left-padded batch's pads
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0, key_mask, layout)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y, r))


class RRTMLP(nn.Module):
    def __init__(self, cfg: RRTConfig):
        super().__init__()
        d, lora = cfg.d_model, (cfg.n_recurrence, cfg.lora_rank, cfg.lora_alpha)
        self.c_fc = LoRALinear(d, 4 * d, cfg.bias, *lora)
        self.c_proj = LoRALinear(4 * d, d, cfg.bias, *lora)
        self.c_proj.is_residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, r: int) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x, r)), r))


class RRTLlamaAttention(nn.Module):
    """llama.LlamaAttention (grouped-query, rotary, optional QK-norm) with LoRA'd q/k/v/o projections."""

    def __init__(self, cfg: RRTConfig):
        super().__init__()
        d, lora = cfg.d_model, (cfg.n_recurrence, cfg.lora_rank, cfg.lora_alpha)
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads(), cfg.head_dim()
        d_kv = self.n_kv_head * self.head_dim
        self.q_proj = LoRALinear(d, d, False, *lora)
        self.k_proj = LoRALinear(d, d_kv, False, *lora)
        self.v_proj = LoRALinear(d, d_kv, False, *lora)
        self.o_proj = LoRALinear(d, d, False, *lora)
        self.o_proj.is_residual_projection = True
        self.q_norm = RMSNorm(self.head_dim) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, r: int, kv: KVSlot | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x, r).view(B, T, self.n_head, hd).transpose(1, 2)
        k = self.k_proj(x, r).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        v = self.v_proj(x, r).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, layout.rope.cos, layout.rope.sin), apply_rotary(k, layout.rope.cos, layout.rope.sin)
        key_mask = None
        if kv is not None:
            k, v, key_mask = kv.update(k, v)  # key_mask: a left-padded batch's pads
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0, key_mask, layout)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * hd), r))


class RRTSwiGLU(nn.Module):
    """llama.SwiGLU with LoRA'd gate/up/down projections."""

    def __init__(self, cfg: RRTConfig):
        super().__init__()
        d, lora = cfg.d_model, (cfg.n_recurrence, cfg.lora_rank, cfg.lora_alpha)
        f = cfg.mlp_hidden()
        self.gate_proj = LoRALinear(d, f, False, *lora)
        self.up_proj = LoRALinear(d, f, False, *lora)
        self.down_proj = LoRALinear(f, d, False, *lora)
        self.down_proj.is_residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, r: int) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x, r)) * self.up_proj(x, r), r))


class RRTBlock(nn.Module):
    """A pre-norm block of ``model.block`` (layers.Block's or llama.LlamaBlock's names and math) whose projections
    carry one LoRA per recursion."""

    def __init__(self, cfg: RRTConfig):
        super().__init__()
        llama = cfg.block == "llama"
        self.ln_1 = norm_layer(cfg)
        self.attn = RRTLlamaAttention(cfg) if llama else RRTAttention(cfg)
        self.ln_2 = norm_layer(cfg)
        self.mlp = RRTSwiGLU(cfg) if llama else RRTMLP(cfg)

    def forward(self, x: torch.Tensor, r: int, kv: KVSlot | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), r, kv, layout)
        return x + self.mlp(self.ln_2(x), r)


class RRTRecursion(nn.Module):
    """One recursion h <- core_r(h): the shared blocks with recursion r's LoRAs. One module call per recursion, the
    index an explicit int argument, so checkpointing, FSDP and compile wrap exactly one recursion."""

    def __init__(self, cfg: RRTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(RRTBlock(cfg) for _ in range(cfg.n_core))

    def forward(self, h: torch.Tensor, r: int, cache: KVCacheAtStep | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        for block in self.blocks:
            h = block(h, r, cache_slot(cache, block), layout)
        return h


class RRT(RecurrentLM):

    def __init__(self, cfg: RRTConfig):
        super().__init__(cfg, RRTRecursion(cfg))

    def init_weights(self, seed: int, assign=copy_full) -> None:
        """GPT-2 init, each parameter from its own generator seeded by (seed, name); residual projections scaled by
        the block executions at N_r; LoRA A ~ N(0, 0.02), LoRA B = 0."""
        init_gpt2_weights(self, self.block_executions(self.cfg), seed, assign)

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, n_steps: int | None = None,
                cache: KVCache | None = None, docs: torch.Tensor | None = None):
        """(logits, None) without targets, (None, loss) with them: the plain next-token loss, in training and
        evaluation alike (RRT's objective). ``n_steps`` = exit e in 0..N_r (default N_r). With a ``cache``, ``idx``
        holds only the new tokens. ``docs`` [B, T]: each token's document (attention stays inside it)."""
        n = self._depth(n_steps)
        start = cache.begin(idx) if cache is not None else 0
        layout = token_layout(self.cfg, idx, start, docs)
        h = self.encode(idx, start, cache, layout)
        for r in range(n):
            h = self.recur(h, r, at_step(cache, r), layout)
        out = head_output(self.lm_head, self.readout(h, cache, layout), targets)
        if cache is not None:
            cache.advance()
        return out

    def exit_states(self, idx: torch.Tensor, exits, gates: dict | None = None, *, noise: bool = False,
                    docs: torch.Tensor | None = None):
        """One pass, yielding (e, coda + final LN of h^(e)) for each e in ``exits`` (0 = the prelude output). No
        gate: a ``gates`` dict stays empty."""
        if noise:  # nothing to turn on: this model trains without noise too (dropout is not inference noise)
            raise ValueError("model.type=rrt has no inference noise: eval.noise=true is for the types in "
                             "pipeline.model.registry.NOISY_TYPES (grt, poisson); set eval.noise=false")
        wanted = sorted(set(exits))
        layout = token_layout(self.cfg, idx, docs=docs)
        h = self.encode(idx, layout=layout)
        for e in range(self._depth(wanted[-1]) + 1):
            if e > 0:
                h = self.recur(h, e - 1, layout=layout)
            if e in wanted:
                yield e, self.readout(h, layout=layout)

    def _depth(self, n_steps: int | None) -> int:
        N = self.cfg.n_recurrence
        if n_steps is None:
            return N
        if not 0 <= n_steps <= N:
            raise ValueError(f"n_steps={n_steps} is outside 0..{N}: RRT has one LoRA per recursion up to "
                             f"model.n_recurrence={N}, so it cannot recurse further; exit at a depth in 0..{N}")
        return n_steps

    # --------------------------------------------------------------------------------------------- accounting
    def train_depth(self, seed: int, step: int, micro_step: int | None = None) -> None:
        return None  # depth-fixed (the paper's Table 8): every step trains at N_r

    @staticmethod
    def lora_dims_sum(cfg: RRTConfig) -> int:
        """Sum of d_in + d_out over a core block's LoRA'd projections: GPT-2's four, c_attn 4d, attn c_proj 2d, c_fc
        5d, mlp c_proj 5d (16d); the llama block's seven, q and o 2d each, k and v d + d_kv each, gate and up d + f
        each, down f + d (9d + 2 d_kv + 3f; d_kv = n_kv_head * head size, f the SwiGLU hidden size)."""
        d = cfg.d_model
        if cfg.block == "llama":
            d_kv = cfg.kv_dim()
            return 9 * d + 2 * d_kv + 3 * cfg.mlp_hidden()
        return 16 * d

    @staticmethod
    def lora_projections(cfg: RRTConfig) -> int:
        """LoRA'd projections per core block: 4 (GPT-2's c_attn, c_proj, c_fc, c_proj) or 7 (llama's)."""
        return 7 if cfg.block == "llama" else 4

    @staticmethod
    def shared_params(cfg: RRTConfig) -> int:
        """Parameters of the strictly shared model (no LoRA): every block's matmul weights, norms and biases, the
        final norm, the token embeddings (padded rows included) and, with the gpt2 block, the learned positions."""
        d = cfg.d_model
        if cfg.block == "llama":
            block_p = block_weight_params(cfg) + 2 * d + (2 * cfg.head_dim() if cfg.qk_norm else 0)
            final_p, positions = d, 0
        else:
            block_p = block_weight_params(cfg) + (13 * d if cfg.bias else 2 * d)
            final_p, positions = (2 * d if cfg.bias else d), cfg.block_size
        return (cfg.n_prelude + cfg.n_core + cfg.n_coda) * block_p + final_p + (cfg.embedding_rows() + positions) * d

    @staticmethod
    def lora_params(cfg: RRTConfig) -> int:
        """N_r * n_core * sum_proj rank (d_in + d_out): every recursion's A and B on every core projection."""
        return cfg.n_recurrence * cfg.n_core * cfg.lora_rank * RRT.lora_dims_sum(cfg)

    @staticmethod
    def lora_flops_per_token(cfg: RRTConfig, n_steps: int | None = None) -> int:
        """Per recursion and core block, each projection's A x and B (A x): 2 rank (d_in + d_out) FLOPs."""
        n = cfg.n_recurrence if n_steps is None else n_steps
        return n * cfg.n_core * 2 * cfg.lora_rank * RRT.lora_dims_sum(cfg)

    @staticmethod
    def flops_per_token(cfg: RRTConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None, executed: bool = False) -> int:
        """Paper Eq. 1: (n_pre + n_core e + n_coda)(2 W + 4Sd) + e * n_core * 2 rank (sum of d_in + d_out) (the
        LoRA matmuls: 32 rank d with GPT-2's block) (+ 2dV for the head); W the block's matmul weights (12d^2 for
        GPT-2's block, ``block_weight_params``). ``executed`` changes nothing: the code runs exactly these matmuls."""
        S = seq_len or cfg.block_size
        f = RRT.block_executions(cfg, n_steps) * block_flops_per_token(cfg, S)
        f += RRT.lora_flops_per_token(cfg, n_steps)
        return f + (head_flops_per_token(cfg) if with_head else 0)

    @staticmethod
    def flops_notes(cfg: RRTConfig) -> list[str]:
        S = cfg.block_size
        lora_f = RRT.lora_flops_per_token(cfg)
        blocks_f = RRT.block_executions(cfg) * block_flops_per_token(cfg, S)
        shared_p = RRT.shared_params(cfg)
        lora_p = RRT.lora_params(cfg)
        return [f"LoRA matmuls (rank {cfg.lora_rank}, {cfg.n_recurrence} recursions x {cfg.n_core} core block(s) x "
                f"{RRT.lora_projections(cfg)} projections): {lora_f:,} FLOPs/token, "
                f"{100 * lora_f / (blocks_f + lora_f):.2f}% of the Eq. 1 figure without head (included in it)",
                f"LoRA parameters: {lora_p:,} ({100 * lora_p / (shared_p + lora_p):.2f}% of the model's "
                f"{shared_p + lora_p:,}; the strictly shared model has {shared_p:,})"]
