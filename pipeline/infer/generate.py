"""Batched generation with a KV cache: the one decoding loop behind ``grt generate`` and the lm-eval adapter's
``generate_until`` (through :func:`pipeline.eval.lm_eval.scoring.greedy_generate`).

    prompts (any lengths) --left padding--> one prefill forward --> next token of each row (greedy or sampled)
        --> one forward per new token (each row its own positions) --> ... until every row has stopped

Prompts of different lengths share a batch through left padding: row b's first real token gets position 0 and its
pads are never attended to (:meth:`KVCache.left_padded`). Learned positions end at ``block_size``: a prompt keeps its
last ``block_size - 1`` tokens, and when the batch would pass ``block_size`` columns every row is re-encoded from its
last ``block_size // 2`` tokens (a new prefill). A row stops when ``stop(row, its new tokens)`` says so (EOT, a stop
string, ...); the batch stops when every row has. The depth is ``n_steps`` for every forward, or, with early exit
(batch size 1), the prefill runs at ``n_max`` and each decoded token exits on its own (:mod:`.early_exit`).

A prefill applies the LM head to each row's last position only (:func:`last_position_head`): the other positions'
logits would be discarded, and at [B, T, V] they cost T times the head's FLOPs and memory of the one kept. The
forwards run under the precision ``dtype`` names (:mod:`.precision`: bf16 autocast on a bf16-capable GPU for
``auto``).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

import torch

from pipeline.infer.early_exit import EarlyExit
from pipeline.infer.precision import inference_precision
from pipeline.infer.sampling import Sampler
from pipeline.model.kv_cache import KVCache

GREEDY = Sampler()


@dataclass
class Generation:
    tokens: list[list[int]]  # each row's new tokens, up to and including the one that stopped it
    seconds: float  # wall time of the whole loop (prefill included)
    steps: list[int] = field(default_factory=list)  # early exit: recurrence steps each decoded token ran

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def mean_steps(self) -> float | None:
        return sum(self.steps) / len(self.steps) if self.steps else None


@contextlib.contextmanager
def last_position_head(model) -> Iterator[None]:
    """While inside, ``model.lm_head`` reads only the last position of its [B, T, d] input, so a forward returns
    [B, 1, V] logits. Every model type's forward without targets ends in ``lm_head(states)``
    (``pipeline.model.layers.head_output``), so this serves all of them from outside their code; the positions
    before the last still run every block (their K/V fill the cache), only their logits are skipped. Left padding
    puts every row's last real token in the last column."""
    handle = model.lm_head.register_forward_pre_hook(lambda _module, args: (args[0][:, -1:], *args[1:]))
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int,
             n_steps: int | None = None, kv: str = "full", sampler: Sampler = GREEDY,
             stop: Callable[[int, list[int]], bool] | None = None, early_exit: EarlyExit | None = None,
             pad_id: int = 0, dtype: str | None = None) -> Generation:
    """Continue every prompt (token lists, at least one token each) by up to ``max_new_tokens`` tokens as one
    left-padded batch with a KV cache of strategy ``kv`` (module docstring). ``n_steps``: the depth of every forward
    (recurrence steps; the exit layer of a dense model; None = the model's default). ``stop(row, tokens)`` is called
    after each new token of a running row. ``dtype``: the forwards' precision (:mod:`.precision`: auto, bfloat16,
    float32; None: as the caller has it)."""
    if early_exit is not None and len(prompts) != 1:
        raise ValueError(f"early exit decides per token, so it generates one prompt at a time (batch size 1); got "
                         f"{len(prompts)} prompts: generate them one by one, or drop early exit")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for 0 or more tokens")
    device = next(model.parameters()).device
    depth = early_exit.n_max if early_exit is not None else n_steps
    seqs = [list(p)[-(block_size - 1):] for p in prompts]
    if not all(seqs):
        raise ValueError("every prompt needs at least one token; start an empty one with the end-of-text token")
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    steps: list[int] = []
    t0 = time.perf_counter()
    cache, feed = KVCache.left_padded(seqs, block_size, kv, pad_id, device)
    prefill = True
    with inference_precision(dtype, device):
        for _ in range(max_new_tokens):
            if cache.pos + feed.shape[1] > block_size:  # slide: re-encode the recent half of every row
                cache, feed = KVCache.left_padded([s[-(block_size // 2):] for s in seqs], block_size, kv, pad_id,
                                                  device)
                prefill = True
            if prefill:  # always at the full depth, early exit or not
                with last_position_head(model):
                    logits = model(feed, n_steps=depth, cache=cache)[0][:, -1]
            elif early_exit is None:
                logits = model(feed, n_steps=depth, cache=cache)[0][:, -1]
            else:
                logits, ran, _ = early_exit.decode(feed, cache)
                steps.append(ran)
            prefill = False
            nxt = sampler(logits).tolist()
            for row, tok in enumerate(nxt):
                seqs[row].append(tok)
                if not done[row]:
                    new[row].append(tok)
                    done[row] = bool(stop and stop(row, new[row]))
            if all(done):
                break
            feed = torch.tensor([[t] for t in nxt], device=device)
    return Generation(new, time.perf_counter() - t0, steps)
