"""Next-token choice: greedy, or sampling with temperature, top-k and top-p (nucleus) filtering, reproducible from a
seed.

For each row's next-token logits z (a float64 copy, so that the filtering and the draw do not depend on the model's
dtype):
    temperature T = 0    the argmax (greedy; no draw)
    otherwise            q = softmax(z / T)
    top-k  (k >= 1)      keep the tokens whose z is >= the k-th largest z (ties at the k-th value kept), renormalise
    top-p  (0 < p <= 1)  then, tokens sorted by q descending, keep each token whose predecessors' mass is < p (the
                         smallest prefix reaching p; the most likely token always stays), renormalise
    draw                 u ~ U[0, 1) from the generator, one float64 per row per generated token (``torch.rand``
                         of shape [B, 1], nothing else drawn); the token is the first id, in vocabulary order,
                         whose cumulative kept mass exceeds u times the total kept mass (inverse CDF)
top-k then top-p, as Hugging Face's logits processors apply them. The inverse-CDF draw (rather than
``torch.multinomial``) is what makes a run replicable by hand: the same generator, seeded the same, gives the same
u and hence the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampler:
    """How the next token is chosen; ``temperature=0`` is greedy. ``generator``: a ``torch.Generator`` on the
    logits' device (see :func:`seeded_generator`), needed when sampling."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self):
        problems = sampling_problems(self.temperature, self.top_k, self.top_p)
        if problems:
            raise ValueError("; ".join(problems))
        if self.temperature > 0 and self.generator is None:
            raise ValueError("sampling (temperature > 0) needs a generator: Sampler(..., generator="
                             "seeded_generator(seed, device))")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row of ``logits`` [B, V]: [B] long."""
        if self.greedy:
            return logits.argmax(dim=-1)
        probs = filtered_probs(logits, self.temperature, self.top_k, self.top_p)
        return draw(probs, self.generator)


def sampling_problems(temperature: float, top_k: int | None, top_p: float | None) -> list[str]:
    """What is wrong with these sampling settings, each with its fix (empty when they are valid)."""
    p = []
    if not temperature >= 0:
        p.append(f"temperature {temperature} is negative; use 0 for greedy decoding or a positive value to sample")
    if top_k is not None and top_k < 1:
        p.append(f"top-k {top_k}: keep at least 1 token (1 = greedy), or leave top-k unset for no top-k filter")
    if top_p is not None and not 0 < top_p <= 1:
        p.append(f"top-p {top_p} is outside (0, 1]: it is the probability mass to keep (1 keeps everything)")
    if temperature == 0 and (top_k is not None or top_p is not None):
        p.append("top-k / top-p filter the sampling distribution, and temperature 0 decodes greedily: set a "
                 "temperature > 0 (e.g. 0.8) to sample, or drop top-k / top-p")
    return p


def seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: the same seed on the same device gives the same draws."""
    return torch.Generator(device=device).manual_seed(int(seed))


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """softmax(logits / T) with the top-k then top-p filters of the module docstring, renormalised: [B, V] float64."""
    z = logits.double() / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more likely tokens
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before >= top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] by the inverse CDF of one uniform per row (module docstring)."""
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    cdf = probs.cumsum(dim=-1)
    token = (cdf <= u * cdf[:, -1:]).sum(dim=-1)  # first id whose cumulative mass exceeds u * total
    # u * total can round up to the total when u is within 2^-53 of 1: take the last token with mass then
    last_kept = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(token, last_kept)
