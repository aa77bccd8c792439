"""Gated Recurrent Transformer (paper §3): prelude once, a shared core looped R times with a projection that
re-injects the prelude output and an elementwise gate, then coda, final LN and a tied head.

Step r (Eq. 2 and §3.3):
    h~ = W_proj([h + eps_x, h_pre])                           (Linear 2d -> d)
    o  = core(h~)                                             (n_core blocks of model.block, same weights every step)
    g  = sigmoid(f_g([LN(h), LN(h_pre)]) / tau + eps_g)       (f_g: Linear 2d->d, SiLU, Linear d->d, last bias +4)
    h  = g * h + (1 - g) * o
eps_x, eps_g ~ N(0, sigma^2) in training, and in evaluation only when asked (``exit_states(noise=True)``: Algorithm
1's inference noise; Appendix E evaluates without). The ablation switches (``reinject``, ``gate``, ``state_noise``)
turn off one component each, giving the rows of the paper's Figure 5 / Table 7.

With ``model.block: llama`` the prelude, core and coda blocks are Llama-style (and the final norm an RMSNorm); W_proj
and the gate, with its two LayerNorms, stay as above. Under document masking (``docs``) every block attends within
each token's document; the forward's layout (mask, positions, rotary angles) is built once and reused at every step.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ops import gate_update
from ops import gated_update
from ops import new_seed
from ops import state_noise
from ops.gate import gate_reference
from ops.gate import gate_update_reference
from pipeline.model.configs import GRTConfig
from pipeline.model.fp32_linear import FP32Linear
from pipeline.model.hyper_connections import core_blocks
from pipeline.model.layers import KVCache
from pipeline.model.layers import KVCacheAtStep
from pipeline.model.layers import LayerNorm
from pipeline.model.layers import at_step
from pipeline.model.layers import block_flops_per_token
from pipeline.model.layers import cache_slot
from pipeline.model.layers import copy_full
from pipeline.model.layers import head_flops_per_token
from pipeline.model.layers import head_output
from pipeline.model.layers import init_gpt2_weights
from pipeline.model.layers import token_layout
from pipeline.model.layout import TokenLayout
from pipeline.model.recurrent import RecurrentLM
from pipeline.runtime.seeds import derive_seed


class SplitLinear(nn.Linear):
    """A Linear(2d, d) over [x, a] that can also apply just one half: ``part="x"`` gives W_x x (no bias),
    ``part="a"`` gives W_a a + b, so the half that reads the anchor can be computed once per forward. The same
    parameters (and checkpoint keys) as a plain Linear; calling the module (not slicing its weight from outside)
    keeps FSDP and ZeRO-3 parameter gathering working."""

    def forward(self, x: torch.Tensor, part: str | None = None) -> torch.Tensor:
        if part is None:
            return super().forward(x)
        d = self.in_features // 2
        if part == "x":
            return F.linear(x, self.weight[:, :d])
        return F.linear(x, self.weight[:, d:], self.bias)


class Gate(nn.Module):
    """f_g on [LN(h), LN(h_pre)]: 3d^2 + 2d parameters in the MLP plus 4d in the two LayerNorms."""

    def __init__(self, d: int, bias_init: float, bias: bool = True):
        super().__init__()
        self.ln_h = LayerNorm(d, bias)
        self.ln_pre = LayerNorm(d, bias)
        self.fc1 = SplitLinear(2 * d, d)
        self.fc2 = FP32Linear(d, d)  # the logit z in fp32: the gate's sigmoid reads it in fp32 (ops.gate)
        self.fc2.bias_init = bias_init  # paper §3.3: +4 -> g ~ 0.98 at init (read by gpt2_init_value)

    def anchor_term(self, h_pre: torch.Tensor) -> torch.Tensor:
        """W1_a LN(h_pre) + b1: the part of the first layer that is the same at every step."""
        return self.fc1(self.ln_pre(h_pre), part="a")

    def forward(self, h: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The gate logits z (before / tau and the noise); ``anchor`` is :meth:`anchor_term` of the step's anchor."""
        return self.fc2(F.silu(self.fc1(self.ln_h(h), part="x") + anchor))


class StepSeeds(NamedTuple):
    """One step's noise seeds, 0-dim int64 tensors (see :meth:`RecurrentStep.draw_seeds`); None where that noise
    is off."""
    x: torch.Tensor | None = None  # eps_x, the state noise on the projection input
    g: torch.Tensor | None = None  # eps_g, the noise on the gate logits


# The seed handed to the gate op when its noise is off (sigma = 0: nothing is drawn from it). A constant, so that a
# compiled step builds no tensor for it either.
_UNUSED_SEED = torch.zeros((), dtype=torch.int64, device="cpu")  # explicit: this module may be first imported
# inside a `with torch.device("meta")` (build_model on meta), where a meta seed would send every noise-off forward to
# the op's fake kernel


class RecurrentStep(nn.Module):
    """One application of the shared core with its projection and gate. A module of its own so that activation
    checkpointing and compilation can wrap exactly one recurrence step.

    W_proj [h + eps_x, h_pre] = W_x (h + eps_x) + (W_a h_pre + b), and f_g's first layer likewise: the anchor halves
    do not change across steps, so :meth:`anchor_terms` computes them once per forward and every step reuses them
    (4d^2 of the paper's 10d^2 per-step FLOPs, exactly the same result)."""

    def __init__(self, cfg: GRTConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.proj = SplitLinear(2 * d, d) if cfg.reinject else None  # W_proj: 2d^2 + d
        self.blocks = core_blocks(cfg)  # n_core blocks; hyper-connected with model.hyper_streams > 1
        self.gate = Gate(d, cfg.gate_bias_init, cfg.bias) if cfg.gate == "elementwise" else None

    def anchor_terms(self, h_pre: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.proj(h_pre, part="a") if self.proj is not None else None,
                self.gate.anchor_term(h_pre) if self.gate is not None else None)

    def draw_seeds(self, noise: bool) -> StepSeeds:
        """This step's noise seeds from torch's global RNG: eps_x's (state_noise=every_step, sigma_x > 0), then
        eps_g's (whenever there is a gate), the draws training has always made in that order, so a seeded run's
        noise is unchanged (on a CPU with dropout the step's dropout masks now follow both seeds instead of falling
        between them); none with noise off. GRT's loops call this in eager code and pass the seeds in: drawn
        inside the compiled step, a seed becomes inductor's randint, a C++ CPU kernel needing a host compiler on the
        GPU machine (a step left to draw its own gets a graph break instead: ``new_seed`` is compile-disabled)."""
        x = new_seed() if noise and self._adds_state_noise() else None
        return StepSeeds(x, new_seed() if noise and self.gate is not None else None)

    def _adds_state_noise(self) -> bool:
        return self.cfg.state_noise == "every_step" and self.cfg.sigma_x > 0

    def proposal(self, h: torch.Tensor, h_pre: torch.Tensor, noise: bool, cache: KVCacheAtStep | None = None,
                 anchor: tuple | None = None, seeds: StepSeeds | None = None,
                 layout: TokenLayout | None = None) -> torch.Tensor:
        """o = core(W_proj([h + eps_x, h_pre])): what the step would write with the gate fully open. ``anchor``:
        :meth:`anchor_terms` of h_pre, computed here when not given. ``seeds``: :meth:`draw_seeds`; eps_x's seed
        is drawn here when not given. ``layout``: the forward's token layout, handed to every core block."""
        x = h
        if noise and self._adds_state_noise():
            x = state_noise(h, self.cfg.sigma_x, seeds.x if seeds is not None else new_seed())
        if self.proj is not None:
            a = (anchor if anchor is not None else self.anchor_terms(h_pre))[0]
            o = self.proj(x, part="x") + a
        else:
            o = x
        for block in self.blocks:
            o = block(o, cache_slot(cache, block), layout=layout)
        return o

    def forward(self, h: torch.Tensor, h_pre: torch.Tensor, noise: bool, cache: KVCacheAtStep | None = None,
                anchor: tuple | None = None, need_gate: bool = False, seeds: StepSeeds | None = None,
                layout: TokenLayout | None = None):
        """(h^(r), g^(r) or None, anchor terms). g is returned only when ``need_gate``; without a gate the state is
        replaced by the proposal. Pass the returned anchor terms to the next step. ``seeds``: :meth:`draw_seeds`
        (noise on); drawn here when not given (in a compiled step, at the cost of a graph break). ``layout``: the
        forward's :class:`~pipeline.model.layout.TokenLayout` (None: the gpt2 block's plain causal window).

        ``need_gate`` with ``noise``: g = sigmoid(z / tau + eps_g) and the update in plain PyTorch (the reference op),
        with the seed training draws, so on CPU (or with the reference ops) the state equals training's; the Triton
        kernel draws other (equally distributed) noise for the same seed."""
        if seeds is None:
            seeds = self.draw_seeds(noise)
        if anchor is None:
            anchor = self.anchor_terms(h_pre)
        o = self.proposal(h, h_pre, noise, cache, anchor, seeds, layout)
        if self.gate is None:
            return o, None, anchor
        z = self.gate(h, anchor[1])
        if need_gate:
            if noise:  # evaluation with the training noise: the same g for the update and the report
                inv_tau = 1.0 / self.cfg.tau
                g = gate_reference(z, inv_tau, self.cfg.sigma_g, seeds.g)
                return gate_update_reference(z, h, o, inv_tau, self.cfg.sigma_g, seeds.g), g, anchor
            h_new, g = gated_update(z, h, o, self.cfg.tau)
            return h_new, g, anchor
        sigma, seed = (self.cfg.sigma_g, seeds.g) if noise else (0.0, _UNUSED_SEED)
        return gate_update(z, h, o, 1.0 / self.cfg.tau, sigma, seed), None, anchor


class GRT(RecurrentLM):

    def __init__(self, cfg: GRTConfig):
        super().__init__(cfg, RecurrentStep(cfg))

    def init_weights(self, seed: int, assign=copy_full) -> None:
        """GPT-2 init, each parameter from its own generator seeded by (seed, name) (see ``init_gpt2_weights``); the
        gate's last bias at ``gate_bias_init``. Residual projections are scaled as in GPT-2 by the depth the
        residual stream actually sees at R."""
        init_gpt2_weights(self, self.block_executions(self.cfg), seed, assign)

    # ------------------------------------------------------------------------------------------------ forward
    def initial_state(self, h_pre: torch.Tensor, noise: bool) -> torch.Tensor:
        # h^(0) = h_pre by default: the paper's Algorithm 1 (Appendix A) sets "h^(0) = h^(pre)", and its Figure 9
        # reports the gate=1 model equal to the prelude-only output, which holds only if h^(0) = h_pre.
        # 'zeros' and 'noise' (a random state, as in Geiping et al.'s recurrent-depth model) are kept for study;
        # 'noise' is drawn in training only, so evaluation stays deterministic.
        cfg = self.cfg
        if cfg.init_state == "prelude":
            h = h_pre
        elif cfg.init_state == "zeros" or not noise:
            h = torch.zeros_like(h_pre)
        else:
            h = cfg.sigma_x * torch.randn_like(h_pre)
        if noise and cfg.state_noise == "init" and cfg.sigma_x > 0:
            h = h + cfg.sigma_x * torch.randn_like(h)
        return h

    def decode(self, h: torch.Tensor, targets: torch.Tensor | None, cache: KVCache | None = None,
               layout: TokenLayout | None = None):
        """Coda, final norm and the tied head applied to a recurrent state: (logits, None) without targets,
        (None, loss) with them (the fused loss never builds the logits)."""
        return head_output(self.lm_head, self.readout(h, cache, layout), targets)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, n_steps: int | None = None,
                cache: KVCache | None = None, docs: torch.Tensor | None = None):
        """(logits, None) without targets, (None, loss) with them. ``n_steps`` defaults to R; noise is on exactly
        when the module is in training. With a ``cache``, ``idx`` holds only the new tokens. ``docs`` [B, T]: each
        token's document (attention stays inside it at every step)."""
        n = self.cfg.n_recurrence if n_steps is None else n_steps
        noise = self.training
        start = cache.begin(idx) if cache is not None else 0
        layout = token_layout(self.cfg, idx, start, docs)  # once per forward, reused by every block at every step
        h_pre = self.encode(idx, start, cache, layout)
        h = self.initial_state(h_pre, noise)
        anchor = None
        n_free = self.grad_free_steps(n)  # truncated backprop (model.backprop_steps): these steps save nothing
        with torch.no_grad():
            for r in range(n_free):
                seeds = self.recur.draw_seeds(noise)
                h, _, anchor = self.recur(h, h_pre, noise, at_step(cache, r), anchor, seeds=seeds, layout=layout)
        anchor = None  # the first step with gradient recomputes the anchor terms with gradient (to h_pre, W_a)
        for r in range(n_free, n):  # seeds drawn here, in eager code (see RecurrentStep.draw_seeds)
            h, _, anchor = self.recur(h, h_pre, noise, at_step(cache, r), anchor, seeds=self.recur.draw_seeds(noise),
                                      layout=layout)
        out = self.decode(h, targets, cache, layout)
        if cache is not None:
            cache.advance()
        return out

    def exit_states(self, idx: torch.Tensor, exits, gates: dict | None = None, *, noise: bool = False,
                    docs: torch.Tensor | None = None):
        """One pass, yielding (r, coda + final norm of h^(r)) for each r in ``exits`` (0 = the initial state). A
        ``gates`` dict receives the gate's mean at each yielded r >= 1 (when the model has a gate), a 0-d tensor.
        ``docs``: as in :meth:`forward` (one layout for the whole pass).

        ``noise``: Algorithm 1's inference noise, which Appendix E turns off (the default): the training noise path
        (eps_x on the projection input every step or on h^(0), per ``state_noise``; eps_g in the gate; a random
        h^(0) with init_state=noise), each draw seeded from the global torch RNG as in training, so the caller's
        torch.manual_seed fixes it. ``gates`` then holds the mean of the noisy g. Dropout stays as the module's
        mode has it (off in eval)."""
        wanted = sorted(set(exits))
        # with noise the gate is always computed in plain PyTorch (RecurrentStep.forward), so the states do not
        # depend on whether ``gates`` was asked for (the Triton kernel would draw other noise for the same seed)
        need_gate = self.recur.gate is not None and (gates is not None or noise)
        layout = token_layout(self.cfg, idx, docs=docs)
        h_pre = self.encode(idx, layout=layout)
        h = self.initial_state(h_pre, noise=noise)
        g = anchor = None
        for r in range(wanted[-1] + 1):
            if r > 0:
                h, g, anchor = self.recur(h, h_pre, noise, None, anchor, need_gate=need_gate,
                                          seeds=self.recur.draw_seeds(noise), layout=layout)
            if r in wanted:
                if g is not None and gates is not None:
                    gates[r] = g.detach().float().mean()  # a 0-d tensor: no host sync per exit
                yield r, self.readout(h, layout=layout)

    # --------------------------------------------------------------------------------------------- accounting
    def train_depth(self, seed: int, step: int, micro_step: int | None = None, depth: int | None = None) -> int:
        """r ~ U{1..R} (paper §3.4) from a generator seeded by (seed, step), or by (seed, step, micro_step) with
        train.depth_granularity=micro_step (Algorithm 1 draws r in every forward), never the global RNG: every
        rank and every resume draw the same r (sharded backends need all ranks to run the same number of steps).
        Per step, every micro-batch of the step shares r and a world-size change keeps the same depths; per
        micro-step, which samples meet which r depends on the world size (see the trainer)."""
        bound = self.cfg.n_recurrence if depth is None else depth  # model.depth_schedule's bound of this step
        if self.cfg.depth_sampling == "fixed":
            return bound
        # the per-step key is the one checkpoints and tests were made with: never change it
        key = derive_seed("depth", seed, step, *(() if micro_step is None else (micro_step,)))
        gen = torch.Generator().manual_seed(key)
        return int(torch.randint(1, bound + 1, (1,), generator=gen).item())

    @staticmethod
    def step_overhead_flops(cfg: GRTConfig) -> int:
        """Per-step FLOPs per token outside the blocks: W_proj 2*(2d^2) + f_g 2*(3d^2) = 10d^2 (paper Eq. 1)."""
        d = cfg.d_model
        return (4 * d * d if cfg.reinject else 0) + (6 * d * d if cfg.gate == "elementwise" else 0)

    @staticmethod
    def executed_overhead_flops(cfg: GRTConfig, n_steps: int) -> int:
        """What the code runs instead: per step W_x (2d^2) + f_g's state half and second layer (4d^2); once per
        forward the anchor halves of W_proj and f_g's first layer (2d^2 each)."""
        d = cfg.d_model
        per_step = (2 * d * d if cfg.reinject else 0) + (4 * d * d if cfg.gate == "elementwise" else 0)
        once = (2 * d * d if cfg.reinject else 0) + (2 * d * d if cfg.gate == "elementwise" else 0)
        return n_steps * per_step + (once if n_steps > 0 else 0)

    @staticmethod
    def flops_notes(cfg: GRTConfig) -> list[str]:
        saved = GRT.flops_per_token(cfg) - GRT.flops_per_token(cfg, executed=True)
        notes = [f"the code runs {saved:,} FLOPs/token fewer than Eq. 1 at R={cfg.n_recurrence}: the anchor halves of "
                 f"W_proj and f_g are computed once per forward, not at every step (the same result)"] if saved else []
        k, R = cfg.backprop_steps, cfg.n_recurrence
        if k is not None and k < R:
            depths = range(1, R + 1) if cfg.depth_sampling == "uniform" else [R]
            grad = sum(min(k, r) for r in depths) / len(depths)
            mean = sum(depths) / len(depths)
            notes.append(f"truncated backprop (model.backprop_steps = {k}): only the last min({k}, r) recurrence steps "
                         f"run backward, E = {grad:.3g} of E[r] = {mean:.3g} steps; the trainer's MFU counts it")
        n = cfg.hyper_streams
        if n > 1:
            mix = 2 * cfg.n_core * (2 * n * n + 4 * n) * cfg.d_model
            notes.append(f"hyper-connections (model.hyper_streams = {n}) add {mix:,} FLOPs/token per recurrence step "
                         f"that Eq. 1 leaves out: (2n^2 + 4n) d per sublayer for the stream mixes")
        return notes

    @staticmethod
    def flops_per_token(cfg: GRTConfig, n_steps: int | None = None, with_head: bool = False,
                        seq_len: int | None = None, executed: bool = False) -> int:
        """Paper Eq. 1: (n_pre + n_rec R + n_coda)(24d^2 + 4Sd) + R * 10d^2 (+ 2dV for the head). ``executed``:
        with the step overhead the code actually runs (anchor halves once per forward)."""
        n = cfg.n_recurrence if n_steps is None else n_steps
        S = seq_len or cfg.block_size
        overhead = GRT.executed_overhead_flops(cfg, n) if executed else n * GRT.step_overhead_flops(cfg)
        f = GRT.block_executions(cfg, n) * block_flops_per_token(cfg, S) + overhead
        return f + (head_flops_per_token(cfg) if with_head else 0)
