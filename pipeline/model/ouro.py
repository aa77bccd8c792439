"""Ouro (Zhu et al. 2025, "Scaling Latent Reasoning via Looped Language Models"): the whole stack of ``n_layer``
blocks looped T times with the same weights, the final norm at the end of every loop, a learned exit distribution
over the loops and the entropy-regularised expected loss.

    h_0 = embed(x),   h_t = LN(stack(h_{t-1}))   t = 1..T      (the norm's output is the next loop's input)
    logits_t = W_E h_t                                         (the tied head reads every loop)
    lambda_t = sigmoid(w . h_t + b)                            (exit gate: one Linear(d, 1) shared by all loops)
    p_t = lambda_t prod_{j<t} (1 - lambda_j)   for t < T,   p_T = prod_{j<T} (1 - lambda_j)
Training loss (``self.training``), per token, then the mean over the tokens with a target:
    L = sum_t p_t CE_t - beta H(p),   H(p) = -sum_t p_t log p_t,   CE_t = CE(logits_t, target)
the expectation of the per-loop losses (paper's Stage I objective), not the loss of the p-weighted logits. Each
CE_t comes from the fused chunked head (``ops.linear_cross_entropy(..., reduction="none")``), so the T heads never
hold a [tokens, vocab] tensor; ``train.z_loss`` c makes each CE_t + c lse_t^2 (pipeline/model/z_loss.py).
Evaluation: the plain next-token loss at depth ``n_steps`` (default T); any depth can be run, T + k extrapolates.

Choices where the issue is silent, following Ouro's released modeling code (``OuroModel.forward``:
``hidden_states = self.norm(hidden_states)`` inside the loop, ``early_exit_gate = nn.Linear(hidden_size, 1)``):
- the loop's norm output is the next loop's input, and the head and the gate read that same normed h_t;
- one gate with a bias shared by every loop, on h_t (not per-loop gates): theirs, and the gate then costs d + 1
  parameters whatever T; GPT-2 init (w ~ N(0, 0.02), b = 0) puts lambda_t ~ 0.5 at the start, as their init does;
- the gate of the last loop is not evaluated: p_T takes the remaining mass and never reads lambda_T;
- blocks are this pipeline's standard blocks (``model.block``): GPT-2's pre-LN blocks with learned positions
  added once at h_0 (the paper's comparison, every method sharing the same block), or the llama block with rotary
  positions, whose loop norm is then an RMSNorm (theirs: RoPE and sandwich RMSNorm). Under document masking one
  :class:`~pipeline.model.layout.TokenLayout` per forward serves every block of every loop.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ops import linear_cross_entropy
from pipeline.model import z_loss
from pipeline.model.configs import OuroConfig
from pipeline.model.fp32_linear import FP32Linear
from pipeline.model.interface import LanguageModel
from pipeline.model.layers import KVCache
from pipeline.model.layers import KVCacheAtStep
from pipeline.model.layers import acc_dtype
from pipeline.model.layers import at_step
from pipeline.model.layers import block_flops_per_token
from pipeline.model.layers import cache_slot
from pipeline.model.layers import copy_full
from pipeline.model.layers import head_flops_per_token
from pipeline.model.layers import head_output
from pipeline.model.layers import init_gpt2_weights
from pipeline.model.layers import lm_head
from pipeline.model.layers import norm_layer
from pipeline.model.layers import predicted_weight
from pipeline.model.layers import token_embedding
from pipeline.model.layers import token_layout
from pipeline.model.layers import transformer_block
from pipeline.model.layout import TokenLayout


def exit_log_probs(gate_logits: torch.Tensor) -> torch.Tensor:
    """log p_t [..., n] from the gate logits z_t of loops 1..n-1 ([..., n-1]): log p_t = log sigma(z_t) +
    sum_{j<t} log sigma(-z_j), the last loop without its own factor. In log space so that H(p) stays finite when a
    gate saturates."""
    zero = gate_logits.new_zeros(*gate_logits.shape[:-1], 1)
    before = torch.cat([zero, F.logsigmoid(-gate_logits).cumsum(dim=-1)], dim=-1)  # log prod_{j<t} (1 - lambda_j)
    leave = torch.cat([F.logsigmoid(gate_logits), zero], dim=-1)  # log lambda_t; the last loop takes the rest
    return before + leave


class OuroLoop(nn.Module):
    """One loop: the n_layer blocks, then the loop's norm (Ouro's final norm: LayerNorm, RMSNorm with the llama
    block). ``run_blocks=False`` applies only the norm (the exit e = 0, LN(embeddings)); it goes through this module
    so that a sharded norm is gathered. ``layout``: the forward's, the same at every loop."""

    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.blocks = nn.ModuleList(transformer_block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = norm_layer(cfg)

    def forward(self, h: torch.Tensor, cache: KVCacheAtStep | None = None, run_blocks: bool = True,
                layout: TokenLayout | None = None) -> torch.Tensor:
        if run_blocks:
            for block in self.blocks:
                h = block(h, cache_slot(cache, block), layout=layout)
        return self.ln_f(h)


class Ouro(LanguageModel):

    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = token_embedding(cfg)
        self.prelude = nn.ModuleList()  # the whole stack loops: nothing runs once before or after it
        self.recur = OuroLoop(cfg)
        self.coda = nn.ModuleList()
        self.exit_gate = FP32Linear(cfg.d_model, 1)  # lambda_t = sigmoid(w . h_t + b), shared by every loop; z in fp32
        self.lm_head = lm_head(cfg, self.embed)  # tied head

    def init_weights(self, seed: int, assign=copy_full) -> None:
        """GPT-2 init, each parameter from its own generator seeded by (seed, name). The residual projections are
        scaled for n_layer additions, not n_layer * T: the loop's norm restarts the residual stream every loop, so
        no stream sums more than n_layer block outputs (GPT-2's reason for the 1/sqrt(2 L) scale)."""
        init_gpt2_weights(self, self.cfg.n_layer, seed, assign)

    def recurrent_core(self) -> nn.Module:
        return self.recur  # the whole stack and its norm: one loop

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, n_steps: int | None = None,
                cache: KVCache | None = None, docs: torch.Tensor | None = None):
        """(logits at depth n, None) without targets; (None, loss) with them: in training the expected loss over the
        n loops minus beta H(p) (module docstring), in evaluation the plain loss at depth n. ``n_steps`` defaults
        to T. With a ``cache``, ``idx`` holds only the new tokens. ``docs`` [B, T]: each token's document."""
        n = self._depth(n_steps)
        start = cache.begin(idx) if cache is not None else 0
        layout = token_layout(self.cfg, idx, start, docs)
        h = self.embed(idx, start, layout)
        per_loop_loss = self.training and targets is not None
        if per_loop_loss and n < 1:
            raise ValueError(f"n_steps={n}: the training loss weighs the loops 1..n, so it needs n_steps >= 1 (or "
                             f"None for T)")
        if n == 0:
            h = self.recur(h, run_blocks=False)
        losses, gate_logits, zs = [], [], []
        head_weight = predicted_weight(self.lm_head)  # a padded vocabulary's rows are never predicted
        coef = z_loss.coefficient(self.lm_head) if per_loop_loss else 0.0  # train.z_loss: in every CE_t
        for t in range(1, n + 1):
            h = self.recur(h, at_step(cache, t - 1), layout=layout)
            if per_loop_loss:
                zs.append(z_loss.new_buffer(targets, h) if coef else None)
                losses.append(linear_cross_entropy(h, head_weight, targets, reduction="none", z_loss=coef,
                                                   z_out=zs[-1]))
                if t < n:
                    gate_logits.append(self._gate_logit(h))
        if cache is not None:
            cache.advance()
        if per_loop_loss:
            loss = self.expected_loss(torch.stack(losses, dim=-1), gate_logits, targets)
            if coef:  # the logged term: c lse_t^2 weighted by p_t like the CE_t it joins
                p = exit_log_probs(torch.stack(gate_logits, dim=-1).to(zs[0].dtype)).exp() if gate_logits else None
                z_loss.record(self.lm_head, coef, torch.stack(zs, dim=-1), targets, p)
            return None, loss
        return head_output(self.lm_head, h, targets)

    def expected_loss(self, losses: torch.Tensor, gate_logits: list[torch.Tensor],
                      targets: torch.Tensor) -> torch.Tensor:
        """mean over tokens with a target of sum_t p_t CE_t - beta H(p); ``losses``: CE_t [..., n]."""
        z = torch.stack(gate_logits, dim=-1) if gate_logits else losses.new_zeros(*losses.shape[:-1], 0)
        log_p = exit_log_probs(z.to(losses.dtype))
        p = log_p.exp()
        per_token = (p * losses).sum(-1) + self.cfg.entropy_beta * (p * log_p).sum(-1)  # - beta H = + beta sum p log p
        valid = targets != -1
        return (per_token * valid).sum() / valid.sum().clamp(min=1)

    @torch.no_grad()
    def exit_distribution(self, idx: torch.Tensor, n_loops: int | None = None,
                          docs: torch.Tensor | None = None) -> torch.Tensor:
        """p_t per token over loops 1..n (default T) in one pass: [B, S, n], summing to 1 over the last dim. The
        Q-exit rule exits at the first t with sum_{j<=t} p_j >= q."""
        n = self._depth(n_loops)
        if n < 1:
            raise ValueError(f"the exit distribution needs n_loops >= 1, got {n}")
        layout = token_layout(self.cfg, idx, docs=docs)
        h = self.embed(idx, layout=layout)
        gate_logits = []
        for _ in range(n - 1):
            h = self.recur(h, layout=layout)
            gate_logits.append(self._gate_logit(h))
        z = torch.stack(gate_logits, dim=-1) if gate_logits else h.new_zeros(*idx.shape, 0, dtype=acc_dtype(h.dtype))
        return exit_log_probs(z).exp()

    def _gate_logit(self, h: torch.Tensor) -> torch.Tensor:
        """w . h_t + b per token, in fp32 (fp64 for a fp64 model) whatever the autocast dtype: computed so, not cast
        up after a bf16 Linear has rounded it."""
        return self.exit_gate(h).squeeze(-1)

    def exit_states(self, idx: torch.Tensor, exits, gates: dict | None = None, *, noise: bool = False,
                    docs: torch.Tensor | None = None):
        """One pass yielding (e, h_e) for each e in ``exits``: the loop outputs (already normed, what the head
        reads); e = 0 is LN(embeddings), the loop's norm applied before any loop. Any e, past T too. ``gates`` is
        left untouched (the exit gate is reported by :meth:`exit_distribution`)."""
        if noise:  # nothing to turn on: this model trains without noise too (dropout is not inference noise)
            raise ValueError("model.type=ouro has no inference noise: eval.noise=true is for the types in "
                             "pipeline.model.registry.NOISY_TYPES (grt, poisson); set eval.noise=false")
        wanted = sorted(set(exits))
        layout = token_layout(self.cfg, idx, docs=docs)
        h = self.embed(idx, layout=layout)
        if 0 in wanted:
            yield 0, self.recur(h, run_blocks=False)
        for e in range(1, wanted[-1] + 1):
            h = self.recur(h, layout=layout)
            if e in wanted:
                yield e, h

    def _depth(self, n_steps: int | None) -> int:
        if n_steps is None:
            return self.cfg.n_recurrence
        if n_steps < 0:
            raise ValueError(f"n_steps={n_steps}: the number of loops must be >= 0")
        return n_steps

    @staticmethod
    def full_depth(cfg: OuroConfig) -> int:
        """The trained (and default evaluation) depth: T loops."""
        return cfg.n_recurrence

    # --------------------------------------------------------------------------------------------- accounting
    def train_depth(self, seed: int, step: int, micro_step: int | None = None) -> None:
        return None  # every training step runs all T loops (the loss weighs each loop by p_t)

    @staticmethod
    def shorthand(cfg: OuroConfig) -> str:
        return f"{cfg.n_layer}Lx{cfg.n_recurrence}"

    @staticmethod
    def block_executions(cfg: OuroConfig, n_steps: int | None = None) -> int:
        return cfg.n_layer * (cfg.n_recurrence if n_steps is None else n_steps)

    @staticmethod
    def flops_per_token(cfg: OuroConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None, executed: bool = False) -> int:
        """Paper Eq. 1 for n loops: n L (2 W + 4Sd) + n 2d for the exit gate (W the block's matmul weights,
        ``block_weight_params``: 12d^2 for GPT-2's block) (the per-loop norm, O(d), is left
        out as Eq. 1 leaves out the blocks' norms), + 2dV for one head. ``executed`` changes nothing (the
        gate's 2d per loop is noise beside the blocks). The T heads of training are in
        :meth:`flops_notes`."""
        n = cfg.n_recurrence if n_steps is None else n_steps
        S = seq_len or cfg.block_size
        gates = n
        f = Ouro.block_executions(cfg, n) * block_flops_per_token(cfg, S) + gates * 2 * cfg.d_model
        return f + (head_flops_per_token(cfg) if with_head else 0)

    @staticmethod
    def training_flops_per_token(cfg: OuroConfig, n_steps: int | None = None) -> int:
        """Model FLOPs of one training step: 3x the forward with the head at every loop (the fused loss's logits
        recomputation is not model work and not counted): the trainer's MFU."""
        T = cfg.n_recurrence if n_steps is None else n_steps
        head = head_flops_per_token(cfg)
        return 3 * (Ouro.flops_per_token(cfg, T, with_head=True) + (T - 1) * head)

    @staticmethod
    def flops_notes(cfg: OuroConfig) -> list[str]:
        T, head = cfg.n_recurrence, head_flops_per_token(cfg)
        one_head = Ouro.flops_per_token(cfg, with_head=True)
        t_heads = one_head + (T - 1) * head
        train = 3 * (one_head - head) + 4 * T * head  # blocks and gates fwd + 2x bwd; heads fwd + recompute + 2x bwd
        return [
            f"training runs the head at every one of the T={T} loops: T x 2dV = {T * head:,} FLOPs/token instead of "
            f"2dV = {head:,} ({T}x the head); the training forward is {t_heads:,} FLOPs/token, "
            f"{t_heads / one_head:.3f}x Eq. 1 with one head ({one_head:,})",
            f"the per-token fused loss recomputes each loop's logits in the backward, so the heads cost 4 x T x 2dV "
            f"= {4 * T * head:,} FLOPs/token forward + backward ({4 * T / 3:.2f}x the 3 x 2dV of one fused head); a "
            f"training step is {train:,} FLOPs/token, {train / (3 * one_head):.3f}x the 3 x Eq. 1 with one head; "
            f"evaluation at depth n runs one head and no gate",
        ]
