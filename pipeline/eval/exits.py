"""Early-exit curves: for every exit (recurrence step r for GRT, layer for dense) the validation loss, KL(p_r || p_ref)
and top-1 agreement with the reference exit (the trained depth), all from one forward per batch.

The model yields the final-LN'd states of every exit in one pass (``exit_states``); the head then runs over rows in
chunks so that no more than ``chunk`` rows of vocabulary-sized logits exist at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.model import model_class


@torch.no_grad()
def exit_stats(states: dict[int, torch.Tensor], weight: torch.Tensor, targets: torch.Tensor, ref: int,
               chunk: int = 256) -> tuple[torch.Tensor, dict[int, float], dict[int, float]]:
    """Per-token losses [tokens, exits] (exits in sorted order), and per exit the summed KL(p_exit || p_ref) and the
    number of positions whose argmax equals the reference's.

    The vocabulary-sized work happens in three preallocated [chunk, V] buffers: fresh allocations of that size per
    chunk cost more in page faults than the arithmetic on a CPU. KL uses
    sum_v p_r (log p_r - log p_ref) = sum_v p_r (l_r - l_ref) - lse_r + lse_ref for logits l."""
    exits = sorted(states)
    flat = {e: s.reshape(-1, s.shape[-1]) for e, s in states.items()}
    tgt = targets.reshape(-1)
    w = weight.float().t()
    rows, V = tgt.numel(), w.shape[1]
    chunk = min(chunk, rows)
    ref_buf, buf, p_buf = (torch.empty(chunk, V, device=w.device) for _ in range(3))
    losses = torch.empty(rows, len(exits))
    kl = {e: 0.0 for e in exits}
    agree = {e: 0.0 for e in exits}
    for a in range(0, rows, chunk):
        n = min(chunk, rows - a)
        t = tgt[a:a + n, None]
        ref_l = ref_buf[:n]
        torch.matmul(flat[ref][a:a + n].float(), w, out=ref_l)
        ref_lse = logsumexp_into(ref_l, p_buf[:n])
        ref_top = ref_l.argmax(dim=-1)
        for j, e in enumerate(exits):
            if e == ref:
                losses[a:a + n, j] = (ref_lse - ref_l.gather(1, t)).squeeze(1).cpu()
                agree[e] += n
                continue
            logits, p = buf[:n], p_buf[:n]
            torch.matmul(flat[e][a:a + n].float(), w, out=logits)
            lse = logsumexp_into(logits, p)  # p = exp(l - max) / sum: the probabilities
            losses[a:a + n, j] = (lse - logits.gather(1, t)).squeeze(1).cpu()
            agree[e] += (logits.argmax(dim=-1) == ref_top).sum().item()
            logits.sub_(ref_l)
            kl[e] += (p.mul_(logits).sum(dim=-1, keepdim=True) - lse + ref_lse).sum().item()
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
               noise: bool = False) -> dict:
    """Token-weighted means over ``batches`` of each exit's loss, KL to ``ref`` and top-1 agreement with ``ref``;
    the gate's mean per step where there is one. ``exits`` may include 0 (GRT: the state before any step).
    With ``keep_tokens`` the per-token losses [tokens, exits] and target ids are returned too (for the
    frequency-band and difficulty-decile breakdowns). ``noise``: the model's training noise on (``eval.noise``; the
    caller seeds the global RNG), for the model types whose ``exit_states`` take it."""
    model.eval()
    exits = sorted(set(exits) | {ref})
    weight = model.lm_head.weight
    loss_sum = torch.zeros(len(exits), dtype=torch.float64)
    kl_sum, agree_sum, gate_sum = [0.0] * len(exits), [0.0] * len(exits), [0.0] * len(exits)
    has_gate, tokens, per_token, ids = False, 0, [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        gates: dict[int, float] = {}
        states = dict(model.exit_states(x, exits, gates, noise=True) if noise else model.exit_states(x, exits, gates))
        losses, kl, agree = exit_stats(states, weight, y, ref)
        n = y.numel()
        loss_sum += losses.double().sum(dim=0)
        for j, e in enumerate(exits):
            kl_sum[j] += kl[e]
            agree_sum[j] += agree[e]
            if e in gates:
                gate_sum[j] += gates[e] * n
                has_gate = True
        tokens += n
        if keep_tokens:
            per_token.append(losses)
            ids.append(y.reshape(-1).cpu())
    result = {"exit": exits, "loss": (loss_sum / tokens).tolist(), "kl": [k / tokens for k in kl_sum],
              "top1": [a / tokens for a in agree_sum], "ref_exit": ref, "val_tokens": tokens}
    if has_gate:
        result["gate_mean"] = [g / tokens if e > 0 else None for g, e in zip(gate_sum, exits)]
    if keep_tokens:
        result["token_losses"] = torch.cat(per_token)
        result["token_ids"] = torch.cat(ids)
    return result


def exit_flops(cfg, exits: list[int]) -> list[int]:
    """Inference FLOPs per token (Eq. 1 + head) of exiting at each point."""
    cls = model_class(cfg.type)
    return [cls.flops_per_token(cfg, e, with_head=True) for e in exits]
