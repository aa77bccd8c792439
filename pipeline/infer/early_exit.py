"""Early exit at decode: each decoded token runs recurrence steps 1, 2, ..., n_max and stops after the first step r
at which a criterion between successive steps falls below a threshold (batch size 1: every token decides alone).

Criteria, between step r and step r - 1 (step 0 = the state before any step, what ``exit_states`` yields at e = 0;
so a token can exit after step 1):
    kl       KL(p_r || p_{r-1}) = sum_v p_r(v) (log p_r(v) - log p_{r-1}(v))     p_r: next-token distribution of
             the head on the state after r steps (coda, final norm and head run at every step)
    latent   ||h_r - h_{r-1}|| / ||h_r||      h_r: the recurrent state after r steps (before the coda)
    entropy  |H(p_r) - H(p_{r-1})|,  H(p) = -sum_v p(v) log p(v)
each in float32 (float64 for a float64 model) over the one new token; a token exits after step r when its value is
strictly below the threshold, and runs all n_max steps otherwise. Every criterion is >= 0 (KL clamped at 0 against
rounding), so threshold 0 never exits early, and a threshold above every value exits after step 1.

The prompt (prefill) runs n_max steps with full per-step attention; only decoded tokens exit early. Their K/V:
with ``kv=full`` a token that exits after r < n_max steps has no K/V for steps r..n_max-1, and later tokens' deeper
steps attend to its last computed step's K/V instead (the cache's fill rule: ``KVCache.advance`` in
pipeline/model/kv_cache.py copies step r-1's K/V into those slots); the compact strategies (last | first |
averaged) compact over the steps the token ran, so they need nothing. Running the coda again at the same step (to
read p_r) overwrites its K/V, so the cache ends holding the coda K/V of the exit step.

Supported model types (:data:`EXIT_TYPES`): grt, poisson, ouro (unbounded depth), mor and rrt (depth at most
N_r: one router / one LoRA per recursion; MoR decodes with its causal threshold routing, and a token its router
drops keeps its state, so every criterion is 0 there). The dense model has no recurrence to exit from.
"""
from __future__ import annotations

import torch

from pipeline.model.kv_cache import KVCache
from pipeline.model.kv_cache import at_step
from pipeline.model.layers import acc_dtype
from pipeline.model.layers import head_output
from pipeline.model.layers import token_layout
from pipeline.model.registry import exits_are_layers

CRITERIA = ("kl", "latent", "entropy")


class _Recurrence:
    """One model's recurrence driven a step at a time with a cache: ``begin`` (embeddings, prelude) -> h_0,
    ``step(h, r)`` -> h_{r+1}, ``head_input(h, r)`` (coda, final norm; r = steps run) -> what the head reads. The
    token's layout (rotary angles at its position; None for the gpt2 block) is built once in ``begin``."""

    def __init__(self, model):
        self.model, self.core = model, model.recurrent_core()
        self.layout = None

    def begin(self, idx: torch.Tensor, start, cache: KVCache) -> torch.Tensor:
        self.layout = token_layout(self.model.cfg, idx, start)
        self.h_pre = self.model.encode(idx, start, cache, self.layout)
        return self.h_pre

    def head_input(self, h: torch.Tensor, r: int, cache: KVCache) -> torch.Tensor:
        return self.model.readout(h, cache, self.layout)


class _GRT(_Recurrence):
    def begin(self, idx, start, cache):
        self.anchor = None
        return self.model.initial_state(super().begin(idx, start, cache), noise=False)

    def step(self, h, r, cache):
        h, _, self.anchor = self.core(h, self.h_pre, False, at_step(cache, r), self.anchor, layout=self.layout)
        return h


class _Poisson(_Recurrence):
    def begin(self, idx, start, cache):
        return self.model.initial_state(super().begin(idx, start, cache), noise=False)  # zeros in evaluation

    def step(self, h, r, cache):
        return self.core(h, self.h_pre, at_step(cache, r), self.layout)


class _RRT(_Recurrence):  # h_0 = the prelude output; recursion r uses its own LoRAs
    def step(self, h, r, cache):
        return self.core(h, r, at_step(cache, r), self.layout)


class _MoR(_Recurrence):  # h_0 = the prelude output; causal threshold routing, as MoR decodes with a cache
    def begin(self, idx, start, cache):
        self.chosen = None
        return super().begin(idx, start, cache)

    def step(self, h, r, cache):
        h, self.chosen, _ = self.core(h, r, self.chosen, True, at_step(cache, r), self.layout)
        return h


class _Ouro(_Recurrence):
    """h_0 = the embeddings; a step is one loop, its norm included, and its output is what the head reads."""

    def begin(self, idx, start, cache):
        self.layout = token_layout(self.model.cfg, idx, start)
        return self.model.embed(idx, start, self.layout)

    def step(self, h, r, cache):
        return self.core(h, at_step(cache, r), layout=self.layout)

    def head_input(self, h, r, cache):
        # e = 0: the loop's norm on the embeddings
        return self.core(h, run_blocks=False, layout=self.layout) if r == 0 else h


RECURRENCES = {"grt": _GRT, "poisson": _Poisson, "rrt": _RRT, "mor": _MoR, "ouro": _Ouro}
EXIT_TYPES = tuple(RECURRENCES)


class EarlyExit:
    """Per-token early exit for one model: ``decode(idx, cache)`` runs the forward of one new token (batch 1) and
    returns (next-token logits [1, V], steps run, the criterion's value after each step run)."""

    def __init__(self, model, criterion: str, threshold: float, n_max: int | None = None):
        mtype = model.cfg.type
        if mtype not in RECURRENCES:
            raise ValueError(f"early exit runs a recurrence one step at a time; model.type={mtype} "
                             + ("is dense (no recurrence): drop the exit criterion, or exit at a fixed layer with "
                                "n_steps" if exits_are_layers(mtype) else
                                f"is not supported (supported: {', '.join(EXIT_TYPES)}); drop the exit criterion"))
        if criterion not in CRITERIA:
            raise ValueError(f"exit criterion {criterion!r} is unknown; choose one of {', '.join(CRITERIA)}")
        if not threshold >= 0:
            raise ValueError(f"exit threshold {threshold} is negative; every criterion is >= 0, so use a threshold "
                             f">= 0 (0 never exits early)")
        deepest = model.cfg.max_depth()
        n_max = type(model).full_depth(model.cfg) if n_max is None else int(n_max)
        if n_max < 1 or (deepest is not None and n_max > deepest):
            raise ValueError(f"early exit needs n_max in 1..{deepest if deepest is not None else 'any'} recurrence "
                             f"steps for model.type={mtype}; got {n_max}")
        self.model, self.criterion, self.threshold, self.n_max = model, criterion, float(threshold), n_max
        self.recurrence = RECURRENCES[mtype](model)

    @torch.no_grad()
    def decode(self, idx: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, int, list[float]]:
        if idx.shape[0] != 1:
            raise ValueError(f"early exit decides per token, so it decodes one sequence at a time; got a batch of "
                             f"{idx.shape[0]}: generate each prompt alone")
        if self.model.training:
            raise ValueError("early exit is for inference: call model.eval() first")
        rec = self.recurrence

        def head(states):  # the real vocabulary only (a padded one's rows are never predicted)
            return head_output(self.model.lm_head, states, None)[0]
        h = rec.begin(idx, cache.begin(idx), cache)
        by_distribution = self.criterion != "latent"
        if by_distribution:
            logits = head(rec.head_input(h, 0, cache))[:, -1]
            logp = _log_probs(logits)
        values: list[float] = []
        for r in range(1, self.n_max + 1):
            h_prev, h = h, rec.step(h, r - 1, cache)
            if by_distribution:  # p_r: coda and head on the state after r steps (the coda's K/V overwritten)
                prev_logp, logits = logp, head(rec.head_input(h, r, cache))[:, -1]
                logp = _log_probs(logits)
                if self.criterion == "kl":
                    value = (logp.exp() * (logp - prev_logp)).sum().clamp(min=0)
                else:
                    value = (_entropy(logp) - _entropy(prev_logp)).abs()
            else:
                a, b = h[:, -1].to(acc_dtype(h.dtype)), h_prev[:, -1].to(acc_dtype(h.dtype))
                value = (a - b).norm() / a.norm()
            values.append(value.item())
            if values[-1] < self.threshold:
                break
        if not by_distribution:
            logits = head(rec.head_input(h, len(values), cache))[:, -1]
        # kv=full: the steps this token did not run get its last step's K/V here (KVCache.advance, the fill rule)
        cache.advance()
        return logits, len(values), values


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to(acc_dtype(logits.dtype)), dim=-1)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum()
