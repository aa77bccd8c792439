"""Early-exit curves: for every exit (recurrence step r for GRT, layer for dense) the validation loss, KL(p_r || p_ref)
and top-1 agreement with the reference exit (the trained depth), all from one forward per batch.

The model yields the final-LN'd states of every exit in one pass (``exit_states``), under the precision of
``eval.dtype`` (:mod:`pipeline.infer.precision`: bf16 autocast on a bf16-capable GPU by default); the head then runs
over rows in chunks, in exact fp32, so that no more than ``chunk`` rows of vocabulary-sized logits exist at a time.
Every sum stays on the device until the curve is done: a GPU never waits for the host in the middle of a batch.
"""
from __future__ import annotations

import contextlib

import torch

from pipeline.infer.precision import exact_fp32
from pipeline.infer.precision import inference_precision
from pipeline.model import exits_are_layers
from pipeline.model import model_class
from pipeline.model.layers import predicted_weight
from pipeline.train.data import batch_parts

CPU_HEAD_CHUNK = 256  # rows: the [chunk, V] buffers stay small enough for the CPU's caches
HEAD_BUDGET_BYTES = 1 << 30  # CUDA: at most this much for the head's buffers (and a quarter of the free memory)


def head_chunk(vocab_size: int, device: torch.device | str, buffers: int = 3, element_size: int = 4,
               budget: int | None = None) -> int:
    """Rows of [rows, vocab_size] logits to compute at a time when ``buffers`` such buffers exist together.

    CPU: :data:`CPU_HEAD_CHUNK`. CUDA: as many rows as fit the buffers in ``budget`` bytes (default: the smaller of
    :data:`HEAD_BUDGET_BYTES` and a quarter of the memory free to this process), in multiples of 256 when at least
    256 fit, at least 1: a head matmul of a few thousand rows keeps the GPU busy where 256 rows leave it idle
    between launches."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_HEAD_CHUNK
    if budget is None:
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # the allocator's, reusable
        budget = min(HEAD_BUDGET_BYTES, (free + cached) // 4)
    rows = budget // (buffers * vocab_size * element_size)
    return rows // 256 * 256 if rows >= 256 else max(rows, 1)


@torch.no_grad()
def exit_stats(states: dict[int, torch.Tensor], weight: torch.Tensor, targets: torch.Tensor, ref: int,
               chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token losses [tokens, exits] (fp32, exits in sorted order) and, per exit in that order, the summed
    KL(p_exit || p_ref) ([exits] fp64) and the number of positions whose argmax equals the reference's ([exits]
    int64), all on the states' device: nothing here waits for the device. ``chunk``: rows of logits at a time
    (default :func:`head_chunk`).

    The vocabulary-sized work happens in three preallocated [chunk, V] buffers: fresh allocations of that size per
    chunk cost more in page faults than the arithmetic on a CPU. KL uses
    sum_v p_r (log p_r - log p_ref) = sum_v p_r (l_r - l_ref) - lse_r + lse_ref for logits l."""
    exits = sorted(states)
    flat = {e: s.reshape(-1, s.shape[-1]) for e, s in states.items()}
    tgt = targets.reshape(-1)
    device = weight.device
    with exact_fp32(device):
        w = weight.float().t()
        rows, V = tgt.numel(), w.shape[1]
        chunk = min(chunk or head_chunk(V, device), rows)
        ref_buf, buf, p_buf = (torch.empty(chunk, V, device=device) for _ in range(3))
        losses = torch.empty(rows, len(exits), device=device)
        # fp64 sums of the fp32 per-chunk sums: the old host-side Python float accumulation, value for value
        kl = torch.zeros(len(exits), dtype=torch.float64, device=device)
        agree = torch.zeros(len(exits), dtype=torch.long, device=device)
        for a in range(0, rows, chunk):
            n = min(chunk, rows - a)
            t = tgt[a:a + n, None]
            ref_l = ref_buf[:n]
            torch.matmul(flat[ref][a:a + n].float(), w, out=ref_l)
            ref_lse = logsumexp_into(ref_l, p_buf[:n])
            ref_top = ref_l.argmax(dim=-1)
            for j, e in enumerate(exits):
                if e == ref:
                    losses[a:a + n, j] = (ref_lse - ref_l.gather(1, t)).squeeze(1)
                    agree[j] += n
                    continue
                logits, p = buf[:n], p_buf[:n]
                torch.matmul(flat[e][a:a + n].float(), w, out=logits)
                lse = logsumexp_into(logits, p)  # p = exp(l - max) / sum: the probabilities
                losses[a:a + n, j] = (lse - logits.gather(1, t)).squeeze(1)
                agree[j] += (logits.argmax(dim=-1) == ref_top).sum()
                logits.sub_(ref_l)
                kl[j] += (p.mul_(logits).sum(dim=-1, keepdim=True) - lse + ref_lse).sum().double()
    return losses, kl, agree


def logsumexp_into(logits: torch.Tensor, scratch: torch.Tensor, softmax: bool = True) -> torch.Tensor:
    """logsumexp over the last dim, [n, 1], with ``scratch`` (same shape) as the only large temporary; leaves
    softmax(logits) there when ``softmax``."""
    m = logits.amax(dim=-1, keepdim=True)
    torch.sub(logits, m, out=scratch).exp_()
    total = scratch.sum(dim=-1, keepdim=True)
    if softmax:
        scratch.div_(total)
    return m + total.log()


@torch.no_grad()
def exit_curve(model, batches, exits: list[int], ref: int, device: torch.device, keep_tokens: bool = False,
               noise: bool = False, dtype: str | None = None, head=None) -> dict:
    """Token-weighted means over ``batches`` of each exit's loss, KL to ``ref`` and top-1 agreement with ``ref``;
    the gate's mean per step where there is one. ``exits`` may include 0 (GRT: the state before any step).
    With ``keep_tokens`` the per-token losses [tokens, exits] and target ids are returned too (for the
    frequency-band and difficulty-decile breakdowns). ``noise``: the model's training noise on (``eval.noise``; the
    caller seeds the global RNG), for the model types whose ``exit_states`` take it. ``dtype``: the forward's
    precision (``eval.dtype``, :mod:`pipeline.infer.precision`; None: as the caller has it). A batch is a
    :class:`~pipeline.train.data.Batch` (its ``docs`` go to the model under document masking) or (inputs, targets).

    The sums stay on ``device`` and come to the host once, at the end (with ``keep_tokens`` the per-token losses
    come once per batch). ``head``: a context around each batch's head, where the head's weight is read (ZeRO-3
    gathers it there, :mod:`pipeline.train.in_loop_eval`); None: read once."""
    model.eval()
    exits = sorted(set(exits) | {ref})
    weight = predicted_weight(model.lm_head) if head is None else None
    chunk = head_chunk(getattr(model.lm_head, "n_vocab", model.lm_head.out_features), device)
    # rows: loss, KL, top-1 agreements, gate mean x tokens; fp64 as the per-batch sums were added on the host
    sums = torch.zeros(4, len(exits), dtype=torch.float64, device=device)
    has_gate, tokens, per_token, ids = False, 0, [], []
    for batch in batches:
        y_host = batch[1]
        x, y, docs = batch_parts(batch, device)
        gates: dict[int, float | torch.Tensor] = {}
        with inference_precision(dtype, device):
            states = dict(model.exit_states(x, exits, gates, noise=True, **docs) if noise else
                          model.exit_states(x, exits, gates, **docs))
        with contextlib.nullcontext() if head is None else head():
            losses, kl, agree = exit_stats(states, predicted_weight(model.lm_head) if weight is None else weight, y,
                                           ref, chunk)
        n = y.numel()
        sums[0] += losses.double().sum(dim=0)
        sums[1] += kl
        sums[2] += agree
        for j, e in enumerate(exits):
            if e in gates:
                g = gates[e]  # a float, or a 0-d device tensor (no host sync), multiplied in fp64 either way
                sums[3, j] += (g.double() if isinstance(g, torch.Tensor) else g) * n
                has_gate = True
        tokens += n
        if keep_tokens:
            per_token.append(losses.cpu())
            ids.append(y_host.reshape(-1).cpu())
    loss_sum, kl_sum, agree_sum, gate_sum = sums.cpu()
    result = {"exit": exits, "loss": (loss_sum / tokens).tolist(), "kl": [k / tokens for k in kl_sum.tolist()],
              "top1": [a / tokens for a in agree_sum.tolist()], "ref_exit": ref, "val_tokens": tokens}
    if has_gate:
        result["gate_mean"] = [g / tokens if e > 0 else None for g, e in zip(gate_sum.tolist(), exits)]
    if keep_tokens:
        result["token_losses"] = torch.cat(per_token)
        result["token_ids"] = torch.cat(ids)
    return result


def exit_range(cfg) -> list[int]:
    """The exits the curve scores: 0..eval.max_steps (default 2R, capped by the deepest) for recurrent types, every
    layer for dense."""
    recurrent = not exits_are_layers(cfg.model.type)
    trained_depth = model_class(cfg.model.type).recurrence_depth(cfg.model)
    deepest = cfg.model.max_depth()  # dense: its layers; MoR / RRT: their last recursion; others: unbounded
    n_max = cfg.eval.max_steps or min(2 * trained_depth if recurrent else deepest, deepest or 10**9)
    return list(range(0 if recurrent else 1, n_max + 1))


def exit_flops(cfg, exits: list[int]) -> list[int]:
    """Inference FLOPs per token (Eq. 1 + head) of exiting at each point."""
    cls = model_class(cfg.type)
    return [cls.flops_per_token(cfg, e, with_head=True) for e in exits]
