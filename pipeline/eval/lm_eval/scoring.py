"""Token-level scoring for downstream tasks, independent of lm-eval: log-likelihoods of continuations at several
depths from one forward per batch (or, for a compact KV strategy, as decoding sees them), and greedy generation of
prompts of any lengths with a KV cache.

Depths are exits: recurrence steps r for GRT, layers for the dense model. A request is (context tokens,
continuation tokens); like lm-eval's HF model, the input is the last ``max_length + 1`` tokens of
context + continuation minus the final one, so the continuation is scored with as much context as fits. A request
is one document (``data.document_masking``): each is its own row from position 0, right-padded, so no ``docs`` are
passed and a model trained with masking scores it as it trained.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from collections.abc import Sequence

import torch

from pipeline.eval.exit_losses import head_chunk
from pipeline.eval.exit_losses import logsumexp_into
from pipeline.infer.generate import generate
from pipeline.infer.precision import exact_fp32
from pipeline.model.kv_cache import KVCache
from pipeline.model.layers import predicted_weight

Request = tuple[Sequence[int], Sequence[int]]


def _window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> tuple[list[int], list[int]]:
    """(model input, targets of the continuation) within ``max_length`` positions."""
    if not continuation:
        raise ValueError("a continuation must have at least one token")
    whole = (list(context) + list(continuation))[-(max_length + 1):]
    return whole[:-1], list(continuation)[-max_length:]  # a continuation longer than the context: its tail


@torch.no_grad()
def loglikelihoods(model, requests: Sequence[Request], depths: Sequence[int], batch_size: int, max_length: int,
                   pad_id: int = 0,
                   progress: Callable[[int], None] | None = None) -> dict[int, list[tuple[float, bool]]]:
    """For each depth: [(sum of log p(continuation | context), whether every continuation token is the argmax)].

    Requests are sorted longest first and batched with right padding (padding after a sequence never reaches its
    positions under causal attention); the LM head runs only on the continuation positions. Results come back in
    the order of ``requests``.
    """
    device = next(model.parameters()).device
    # the real vocabulary only: the padding rows of model.vocab_multiple never get a logit or a share of the softmax
    w = predicted_weight(model.lm_head).float().t()
    bufs = [torch.empty(head_chunk(w.shape[1], device, buffers=2), w.shape[1], device=device) for _ in range(2)]
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
            for i, ll_i, misses_i in zip(idxs, ll.tolist(), misses.tolist()):  # one host transfer each per batch
                out[depth][i] = (ll_i, misses_i == 0)
        if progress:
            progress(len(idxs))
    return out


def _target_log_probs(states: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                      bufs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and whether the target is the argmax, for rows of final-LN'd states; the [rows, V] logits exist
    as many rows at a time as the two reused buffers hold, in exact fp32 whatever the forward's precision."""
    lp = torch.empty(len(targets), device=states.device)
    hit = torch.empty(len(targets), device=states.device)
    chunk = bufs[0].shape[0]
    with exact_fp32(states.device):
        for a in range(0, len(targets), chunk):
            n = min(chunk, len(targets) - a)
            logits, scratch = bufs[0][:n], bufs[1][:n]
            torch.matmul(states[a:a + n].float(), w, out=logits)
            t = targets[a:a + n, None]
            lp[a:a + n] = (logits.gather(1, t) - logsumexp_into(logits, scratch, softmax=False)).squeeze(1)
            hit[a:a + n] = (logits.argmax(dim=-1) == t.squeeze(1)).float()
    return lp, hit


def greedy_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, n_steps: int | None,
                    block_size: int, stop: Callable[[int, list[int]], bool] | None = None,
                    kv: str = "full") -> list[list[int]]:
    """Greedy continuation of ``prompts`` (any lengths) as one left-padded batch with a KV cache of strategy ``kv``:
    the decoding loop of ``grt generate`` (:func:`pipeline.infer.generate.generate`, which documents the padding,
    the sliding re-encode at ``block_size`` and ``stop(row, tokens_so_far)``); each row's new tokens."""
    return generate(model, prompts, max_new_tokens, block_size, n_steps=n_steps, kv=kv, stop=stop).tokens


@torch.no_grad()
def decode_loglikelihoods(model, requests: Sequence[Request], n_steps: int | None, batch_size: int, max_length: int,
                          kv: str, pad_id: int = 0,
                          progress: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
    """[(sum of log p(continuation | context), whether every continuation token is the argmax)] at depth
    ``n_steps``, scored as generation would see them under the KV strategy ``kv``: the context is encoded in one
    forward (prefill), then the continuation is fed one token per forward (teacher-forced decoding), attending to the
    compacted cache. With ``kv="full"`` this equals :func:`loglikelihoods` (one forward over everything).

    The windows are those of :func:`loglikelihoods`. Requests are batched by the number of decoded tokens (so the
    rows of a batch decode in lockstep, within ``max_length`` columns), contexts left-padded."""
    windows = [_window(c, t, max_length) for c, t in requests]
    # the prefill is the context (as a prompt: its last position predicts the continuation's first token), every
    # later input token (the continuation but its last) is decoded
    prefill = [len(inp) - len(cont) + 1 for inp, cont in windows]
    n_dec = [len(cont) - 1 for _, cont in windows]
    order = sorted(range(len(windows)), key=lambda i: (n_dec[i], -prefill[i], i))
    out: list = [None] * len(windows)
    for _, group in itertools.groupby(order, key=n_dec.__getitem__):
        group = list(group)
        for b in range(0, len(group), batch_size):
            idxs = group[b:b + batch_size]
            rows = [(windows[i][0][:prefill[i]], windows[i][0][prefill[i]:], windows[i][1]) for i in idxs]
            for i, res in zip(idxs, _decode_batch(model, rows, n_steps, max_length, kv, pad_id)):
                out[i] = res
            if progress:
                progress(len(idxs))
    return out


def _decode_batch(model, rows: list[tuple[list[int], list[int], list[int]]], n_steps: int | None, max_length: int,
                  kv: str, pad_id: int) -> list[tuple[float, bool]]:
    """Rows of (prefill tokens, decoded tokens: the same number in every row, continuation): the prefills
    left-padded into one forward, then one decoded column per forward. A row's inputs end at the last column, and
    so do the positions predicting its continuation."""
    device = next(model.parameters()).device
    cache, x = KVCache.left_padded([p for p, _, _ in rows], max_length, kv, pad_id, device)
    n_cols = x.shape[1] + len(rows[0][1])
    targets = torch.full((len(rows), n_cols), -1, dtype=torch.long)
    for row, (_, _, cont) in enumerate(rows):
        targets[row, n_cols - len(cont):] = torch.tensor(cont)
    targets = targets.to(device)
    feeds = [x] + [torch.tensor([[dec[j]] for _, dec, _ in rows], device=device) for j in range(len(rows[0][1]))]
    ll = torch.zeros(len(rows), dtype=torch.float64, device=device)
    misses = torch.zeros(len(rows), device=device)
    col = 0
    for feed in feeds:
        logits, _ = model(feed, n_steps=n_steps, cache=cache)
        tgt = targets[:, col:col + feed.shape[1]]
        r, c = (tgt >= 0).nonzero(as_tuple=True)
        sel, t = logits[r, c].double(), tgt[r, c]
        ll.index_add_(0, r, sel.gather(1, t[:, None]).squeeze(1) - sel.logsumexp(dim=-1))
        misses.index_add_(0, r, (sel.argmax(dim=-1) != t).float())
        col += feed.shape[1]
    return [(ll_row, misses_row == 0) for ll_row, misses_row in zip(ll.tolist(), misses.tolist())]
