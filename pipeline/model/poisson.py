"""Heavy-tail Poisson recurrent depth (Geiping et al. 2025, "Scaling up Test-Time Compute with Latent Reasoning: A
Recurrent Depth Approach", the Huginn model; code: seal-rg/recurrent-pretraining), the paper's Table 1 / Table 8
baseline: prelude once, a shared core looped from a random state with the prelude output re-injected through a
linear adapter at every step, then coda, final LN and a tied head.

    h_pre  = prelude(embed(x))
    h^(0)  ~ TruncNormal(0, s^2) on [-3s, 3s] in training, 0 in evaluation      s = init_std or sqrt(2 / (5d))
             (the training draw in evaluation too with ``exit_states(noise=True)``)
    h^(i)  = core(A [h^(i-1), h_pre])        A: Linear(2d -> d) over the concatenation, state first;  i = 1..p
    logits = W_e^T LN_f(coda(h^(p)))

Training depth, one draw per optimizer step, or per micro-step with train.depth_granularity=micro_step (the same
on every rank and after a resume, see ``train_depth``):
    lambda ~ LogNormal(log r - sigma^2 / 2, sigma),   p = Poisson(lambda) + 1,   so E[lambda] = r and E[p] = r + 1
with truncated backprop: steps 1..max(p - k, 0) run under no_grad, the last min(k, p) with gradient. Evaluation
runs r steps (``n_recurrence``). The loss is plain next-token cross-entropy: the method has no auxiliary objective.
The blocks are those of ``model.block`` (Huginn's own are Llama-like); under document masking (``docs``) the forward's
layout is built once and every block at every step attends within each token's document.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pipeline.model.configs import PoissonConfig
from pipeline.model.layers import KVCache
from pipeline.model.layers import KVCacheAtStep
from pipeline.model.layers import at_step
from pipeline.model.layers import block_flops_per_token
from pipeline.model.layers import cache_slot
from pipeline.model.layers import copy_full
from pipeline.model.layers import head_flops_per_token
from pipeline.model.layers import head_output
from pipeline.model.layers import init_gpt2_weights
from pipeline.model.layers import token_layout
from pipeline.model.layers import transformer_block
from pipeline.model.layout import TokenLayout
from pipeline.model.recurrent import RecurrentLM
from pipeline.runtime.seeds import derive_seed


class PoissonStep(nn.Module):
    """One recurrence step h <- core(A [h, h_pre]): the adapter and the shared core blocks, one module so that
    activation checkpointing, compilation and FSDP wrap exactly one step.

    A is a plain Linear over the concatenation, run in full at every step (Eq. 1's 4d^2 per step). GRT splits its
    W_proj to compute the h_pre half once per forward; here the first steps of a training forward run under no_grad,
    so a half computed there would carry no gradient to A's h_pre half, its bias and the prelude, and computing it
    outside this module's forward would bypass FSDP/ZeRO-3 parameter gathering. The saving would be 2d^2 of
    ~24d^2 * n_core per step; plain is simpler and correct."""

    def __init__(self, cfg: PoissonConfig):
        super().__init__()
        d = cfg.d_model
        self.adapter = nn.Linear(2 * d, d, bias=cfg.bias)  # A: 2d^2 (+ d)
        self.blocks = nn.ModuleList(transformer_block(cfg) for _ in range(cfg.n_core))

    def forward(self, h: torch.Tensor, h_pre: torch.Tensor, cache: KVCacheAtStep | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """One step; ``layout``: the forward's token layout, handed to every core block."""
        x = self.adapter(torch.cat([h, h_pre], dim=-1))  # state first, as Huginn's core_block_forward
        for block in self.blocks:
            x = block(x, cache_slot(cache, block), layout=layout)
        return x


def training_depth_pmf(mean: float, sigma: float, j_max: int, grid: int = 4001) -> list[float]:
    """P(p = j) for j = 1..j_max under p = Poisson(LogNormal(log mean - sigma^2/2, sigma)) + 1: the Poisson pmf
    averaged over the log-normal rate, lambda = exp(mu + sigma z), z ~ N(0, 1), by the trapezoid rule on z in
    [-10, 10] (spectrally accurate for this smooth, Gaussian-decaying integrand: exact to ~1e-12, no sampling)."""
    mu = math.log(mean) - sigma * sigma / 2
    dz = 20.0 / (grid - 1)
    pmf = [0.0] * j_max
    for i in range(grid):
        z = -10.0 + i * dz
        w = math.exp(-z * z / 2) / math.sqrt(2 * math.pi) * dz * (0.5 if i in (0, grid - 1) else 1.0)
        lam = math.exp(mu + sigma * z)
        for m in range(j_max):  # p = m + 1
            pmf[m] += w * math.exp(-lam + m * math.log(lam) - math.lgamma(m + 1))
    return pmf


class PoissonDepth(RecurrentLM):

    def __init__(self, cfg: PoissonConfig):
        super().__init__(cfg, PoissonStep(cfg))

    def init_weights(self, seed: int, assign=copy_full) -> None:
        """GPT-2 init (adapter included: N(0, 0.02)); residual projections scaled by the block executions at r, as
        Huginn scales its out-projections by the expected depth n_pre + n_core r + n_coda."""
        init_gpt2_weights(self, self.block_executions(self.cfg), seed, assign)

    # ------------------------------------------------------------------------------------------------ forward
    def initial_state(self, h_pre: torch.Tensor, noise: bool) -> torch.Tensor:
        """h^(0): truncated-normal noise in training, zeros (the noise's mean) otherwise.

        Huginn draws trunc_normal(std s, a=-3s, b=3s) and multiplies it by its embedding scale sqrt(d), because its
        embeddings are scaled by sqrt(d) too; our GPT-2 embeddings are unscaled (std 0.02), so s = sqrt(2/(5d))
        alone (0.023 at d=768) keeps the state at the embedding scale, as theirs. Noise at init only, never per step
        (paper Table 8). Huginn also draws the noise at inference; evaluation here starts from zeros instead (unless
        ``exit_states(noise=True)``), so exit curves and lm-eval scores are deterministic. The draw is in at least
        fp32 (bf16 is too coarse for the inverse-CDF sampler), from the global RNG the trainer seeds per
        micro-batch."""
        std = self.cfg.init_std if self.cfg.init_std is not None else math.sqrt(2 / (5 * self.cfg.d_model))
        if not noise or std == 0:
            return torch.zeros_like(h_pre)
        x = torch.empty(h_pre.shape, dtype=torch.promote_types(h_pre.dtype, torch.float32), device=h_pre.device)
        return nn.init.trunc_normal_(x, 0.0, std, -3 * std, 3 * std).to(h_pre.dtype)

    def iterate(self, h: torch.Tensor, h_pre: torch.Tensor, n: int, cache: KVCache | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """n steps of ``self.recur``, all with the forward's ``layout``; in training the first max(n - k, 0) under
        no_grad (truncated backprop, see :meth:`RecurrentLM.grad_free_steps`)."""
        n_free = self.grad_free_steps(n)
        with torch.no_grad():
            for r in range(n_free):
                h = self.recur(h, h_pre, at_step(cache, r), layout=layout)
        for r in range(n_free, n):
            h = self.recur(h, h_pre, at_step(cache, r), layout=layout)
        return h

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, n_steps: int | None = None,
                cache: KVCache | None = None, docs: torch.Tensor | None = None):
        """(logits, None) without targets, (None, loss) with them. ``n_steps``: p in training (``train_depth``),
        default r. With a ``cache``, ``idx`` holds only the new tokens (see :mod:`pipeline.model.kv_cache`).
        ``docs`` [B, T]: each token's document (attention stays inside it at every step)."""
        n = self.cfg.n_recurrence if n_steps is None else n_steps
        if n < (1 if self.training else 0):
            raise ValueError(f"n_steps={n_steps}: training needs at least one recurrence step (p >= 1), "
                             f"evaluation at least 0")
        start = cache.begin(idx) if cache is not None else 0
        layout = token_layout(self.cfg, idx, start, docs)  # once per forward, reused by every block at every step
        h_pre = self.encode(idx, start, cache, layout)
        h = self.iterate(self.initial_state(h_pre, self.training), h_pre, n, cache, layout)
        out = head_output(self.lm_head, self.readout(h, cache, layout), targets)
        if cache is not None:
            cache.advance()
        return out

    def exit_states(self, idx: torch.Tensor, exits, gates: dict | None = None, *, noise: bool = False,
                    docs: torch.Tensor | None = None):
        """One pass, yielding (e, coda + final norm of h^(e)) for each e in ``exits``; e = 0 is the initial state:
        zeros (noise off, the default), or with ``noise`` the training draw of h^(0) (Huginn's inference, which also
        starts from noise), from the global torch RNG so the caller's torch.manual_seed fixes it. No gates: a
        ``gates`` dict stays empty. ``docs``: as in :meth:`forward` (one layout for the whole pass)."""
        wanted = sorted(set(exits))
        layout = token_layout(self.cfg, idx, docs=docs)
        h_pre = self.encode(idx, layout=layout)
        h = self.initial_state(h_pre, noise=noise)
        for e in range(wanted[-1] + 1):
            if e > 0:
                h = self.recur(h, h_pre, layout=layout)
            if e in wanted:
                yield e, self.readout(h, layout=layout)

    def train_depth(self, seed: int, step: int, micro_step: int | None = None, depth: int | None = None) -> int:
        """p = Poisson(LogNormal(log r - sigma^2/2, sigma)) + 1 from a generator seeded by sha256(seed, step), or by
        sha256(seed, step, micro_step) with train.depth_granularity=micro_step, never the global RNG: every rank and
        every resume of a (micro-)step runs the same p (Huginn seeds its sampler by the step for the same reason,
        with lockstep across ranks). The rate's location uses log r; Huginn's code uses log(max(r - k, 0) + k), the
        same whenever r >= k (their release: r = 32, k = 8); for r < k we keep E[lambda] = r, the recipe's depth."""
        # the per-step key is the one checkpoints and tests were made with: never change it
        key = derive_seed("poisson-depth", seed, step, *(() if micro_step is None else (micro_step,)))
        gen = torch.Generator().manual_seed(key)
        # depth: model.depth_schedule's mean for this step (Huginn grows the mean recurrence in the same way)
        r, sigma = float(self.cfg.n_recurrence if depth is None else depth), self.cfg.depth_sigma
        rate = torch.full((1,), r, dtype=torch.float64)
        if sigma > 0:  # log_normal_ needs std > 0; sigma = 0 is a plain Poisson(r) + 1
            rate.log_normal_(math.log(r) - sigma * sigma / 2, sigma, generator=gen)
        return int(torch.poisson(rate, generator=gen).item()) + 1

    # --------------------------------------------------------------------------------------------- accounting
    @staticmethod
    def flops_per_token(cfg: PoissonConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None, executed: bool = False) -> int:
        """Paper Eq. 1: (n_pre + n_core n + n_coda)(24d^2 + 4Sd) + n * 4d^2 (the adapter, 2 * 2d^2 per step), plus
        2dV for the head. ``executed`` is the same: the adapter runs in full at every step."""
        n = cfg.n_recurrence if n_steps is None else n_steps
        d, S = cfg.d_model, seq_len or cfg.block_size
        f = PoissonDepth.block_executions(cfg, n) * block_flops_per_token(cfg, S) + n * 4 * d * d
        return f + (head_flops_per_token(cfg) if with_head else 0)

    @staticmethod
    def expected_grad_steps(cfg: PoissonConfig) -> float:
        """E[min(k, p)] = k - sum_{j<k} (k - j) P(p = j), exact from the Poisson-log-normal pmf."""
        k = cfg.backprop_steps
        pmf = training_depth_pmf(cfg.n_recurrence, cfg.depth_sigma, k - 1)
        return k - sum((k - j) * pmf[j - 1] for j in range(1, k))

    @staticmethod
    def flops_notes(cfg: PoissonConfig) -> list[str]:
        """How training's cost differs from Eq. 1 at r (forward FLOPs are linear in the depth, so the expectation
        over p is Eq. 1 at E[p]; backward taken as 2x forward, per step)."""
        r, k, f = cfg.n_recurrence, cfg.backprop_steps, PoissonDepth.flops_per_token
        at_r, at_mean = f(cfg), f(cfg, r + 1)
        step = f(cfg, 1) - f(cfg, 0)  # one core step: n_core blocks + the adapter
        grad = PoissonDepth.expected_grad_steps(cfg)
        train = 3 * f(cfg, 0) + step * (r + 1 + 2 * grad)  # prelude/coda fwd+bwd, p steps fwd, min(k,p) bwd
        return [
            f"training depth p = Poisson(LogNormal(log {r} - sigma^2/2, sigma={cfg.depth_sigma:g})) + 1: E[p] = {r + 1}"
            f" steps, so a training forward averages Eq. 1 at {r + 1} = {at_mean:,} FLOPs/token, "
            f"{at_mean / at_r:.3f}x the figure at r={r} (evaluation)",
            f"truncated backprop: only the last min(k={k}, p) steps run backward, E[min(k, p)] = {grad:.3f} of "
            f"E[p] = {r + 1} ({grad / (r + 1):.1%} of the core-step backward work of full backprop; exact, from the "
            f"Poisson-log-normal pmf by quadrature)",
            f"training FLOPs/token (forward + 2x-forward backward, head excluded): expected {train:,.0f}, "
            f"{train / (3 * at_r):.3f}x the 3 x Eq. 1 at r={r} of full backprop at r",
        ]
