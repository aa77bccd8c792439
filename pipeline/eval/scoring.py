"""Token-level scoring for downstream tasks, independent of lm-eval: log-likelihoods of continuations at several
depths from one forward per batch, and greedy generation with a KV cache.

Depths are exits: recurrence steps r for GRT, layers for the dense model. A request is (context tokens,
continuation tokens); like lm-eval's HF model, the input is the last ``max_length + 1`` tokens of
context + continuation minus the final one, so the continuation is scored with as much context as fits.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from pipeline.eval.exits import logsumexp_into
from pipeline.model.layers import KVCache

HEAD_CHUNK = 256  # rows of vocabulary-sized logits computed at a time

Request = tuple[Sequence[int], Sequence[int]]


def _window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> tuple[list[int], list[int]]:
    """(model input, targets of the continuation) within ``max_length`` positions."""
    if not continuation:
        raise ValueError("a continuation must have at least one token")
    whole = (list(context) + list(continuation))[-(max_length + 1):]
    return whole[:-1], list(continuation)[-max_length:]  # a continuation longer than the context: its tail


@torch.no_grad()
def loglikelihoods(model, requests: Sequence[Request], depths: Sequence[int], batch_size: int, max_length: int,
                   pad_id: int = 0, progress: Callable[[int], None] | None = None) -> dict[int, list[tuple[float, bool]]]:
    """For each depth: [(sum of log p(continuation | context), whether every continuation token is the argmax)].

    Requests are sorted longest first and batched with right padding (padding after a sequence never reaches its
    positions under causal attention); the LM head runs only on the continuation positions. Results come back in
    the order of ``requests``.
    """
    device = next(model.parameters()).device
    w = model.lm_head.weight.float().t()
    bufs = [torch.empty(HEAD_CHUNK, w.shape[1], device=device) for _ in range(2)]
    windows = [_window(c, t, max_length) for c, t in requests]
    cut = sum(len(t) > max_length for _, t in requests)
    if cut:
        logging.getLogger(__name__).warning(
            "%d of %d continuations are longer than the model's context (%d tokens, model.block_size); only their "
            "last %d tokens are scored", cut, len(requests), max_length, max_length)
    order = sorted(range(len(windows)), key=lambda i: (-len(windows[i][0]), i))
    out: dict[int, list] = {d: [None] * len(windows) for d in depths}
    for b in range(0, len(order), batch_size):
        idxs = order[b:b + batch_size]
        T = len(windows[idxs[0]][0])
        x = torch.full((len(idxs), T), pad_id, dtype=torch.long)
        rows, cols, targets, owner = [], [], [], []
        for row, i in enumerate(idxs):
            inp, cont = windows[i]
            x[row, :len(inp)] = torch.tensor(inp)
            first = len(inp) - len(cont)
            rows += [row] * len(cont)
            cols += range(first, len(inp))
            targets += cont
            owner += [row] * len(cont)
        rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
        tgt = torch.tensor(targets, device=device)
        own = torch.tensor(owner, device=device)
        for depth, states in model.exit_states(x.to(device), depths):
            tok_lp, hit = _target_log_probs(states[rows_t, cols_t], w, tgt, bufs)
            ll = torch.zeros(len(idxs), dtype=torch.float64, device=device).index_add_(0, own, tok_lp.double())
            misses = torch.zeros(len(idxs), device=device).index_add_(0, own, 1.0 - hit)
            for row, i in enumerate(idxs):
                out[depth][i] = (ll[row].item(), bool(misses[row].item() == 0))
        if progress:
            progress(len(idxs))
    return out


def _target_log_probs(states: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                      bufs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and whether the target is the argmax, for rows of final-LN'd states; the [rows, V] logits exist
    ``HEAD_CHUNK`` rows at a time, in two reused buffers."""
    lp = torch.empty(len(targets), device=states.device)
    hit = torch.empty(len(targets), device=states.device)
    for a in range(0, len(targets), HEAD_CHUNK):
        n = min(HEAD_CHUNK, len(targets) - a)
        logits, scratch = bufs[0][:n], bufs[1][:n]
        torch.matmul(states[a:a + n].float(), w, out=logits)
        t = targets[a:a + n, None]
        lp[a:a + n] = (logits.gather(1, t) - logsumexp_into(logits, scratch, softmax=False)).squeeze(1)
        hit[a:a + n] = (logits.argmax(dim=-1) == t.squeeze(1)).float()
    return lp, hit


@torch.no_grad()
def greedy_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, n_steps: int | None,
                    block_size: int, stop: Callable[[int, list[int]], bool] | None = None) -> list[list[int]]:
    """Greedy continuation of equal-length ``prompts`` as one batch, with a KV cache: the prompt is encoded once,
    then each new token costs one position. ``stop(row, tokens_so_far)`` ends a row early; the batch ends when
    every row has stopped. When the sequence reaches ``block_size`` the cache is rebuilt from the last
    ``block_size // 2`` tokens (learned positions cannot go further)."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("greedy_generate batches prompts of equal length only")
    device = next(model.parameters()).device
    seqs = [list(p)[-(block_size - 1):] or [0] for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    cache, feed = KVCache(), torch.tensor(seqs, device=device)
    for _ in range(max_new_tokens):
        if cache.pos + feed.shape[1] > block_size:  # slide: re-encode the recent half
            cache = KVCache()
            feed = torch.tensor([s[-(block_size // 2):] for s in seqs], device=device)
        logits, _ = model(feed, n_steps=n_steps, cache=cache)
        nxt = logits[:, -1].argmax(dim=-1).tolist()
        for row, tok in enumerate(nxt):
            seqs[row].append(tok)
            if not done[row]:
                new[row].append(tok)
                done[row] = bool(stop and stop(row, new[row]))
        if all(done):
            break
        feed = torch.tensor([[t] for t in nxt], device=device)
    return new
