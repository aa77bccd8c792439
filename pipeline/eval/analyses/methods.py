"""What `grt eval` measures for one recurrent method beyond its exit curve:

- MoR: the fraction of tokens that reach each recursion, under expert-choice top-k (as trained: fixed capacities, but
  not causal: a token's selection depends on later tokens) and under the causal rule (a token takes recursion r when
  its router says sigmoid >= 0.5 and it took r - 1), with the validation loss at full depth under that causal rule;
- Ouro: its learned exit distribution (mean p_t over tokens) and the Q-exit rule (exit at the first loop whose
  cumulative exit probability reaches q) at q = 0.5, 0.7, 0.9: loss, mean loops and FLOPs per token. Each token's
  loss is read at its exit loop out of one pass where every token ran every loop, so a token's later loops still
  saw the deeper states of earlier tokens that had exited: the rule's read-out loss, not that of a decoder that
  stops computing exited tokens (which would have to supply their missing keys and values somehow), and the FLOPs
  are what such a decoder would run;
- RecurTrace: its halting rule at thresholds 0, 0.25, 0.5, 0.75, 1 and the recipe's: loss, mean loops per token (of
  at most n_recurrence) and FLOPs per token. Here a halted token does stop computing (it offers its last K/V to the
  others, pipeline/model/recurtrace.py), so the loss is that of such a decoder, cached or not.

Each from extra passes over the same validation batches as the exit curve (one; RecurTrace one per threshold).
"""
from __future__ import annotations

import contextlib

import torch

from pipeline.eval.exit_losses import exit_stats
from pipeline.model import model_class
from pipeline.model.layers import predicted_weight
from pipeline.train.data import batch_parts

Q_LEVELS = (0.5, 0.7, 0.9)


@contextlib.contextmanager
def routing(model, mode: str):
    """MoR's routing switched to ``mode`` ("topk" | "threshold") inside the block; other models are left as they are."""
    if model.routing is None:
        yield model
        return
    before = model.routing
    model.routing = mode
    try:
        yield model
    finally:
        model.routing = before


@torch.no_grad()
def mor_report(model, batches, device) -> dict:
    """Token fractions per recursion under both routings; loss at full depth under the causal one."""
    depth = model.cfg.n_recurrence
    out = {}
    for mode in ("topk", "threshold"):
        sums, tokens, loss_sum = torch.zeros(depth, dtype=torch.float64), 0, 0.0
        with routing(model, mode):
            for batch in batches():
                x, y, docs = batch_parts(batch, device)
                stats = model.routing_statistics(x, **docs)
                sums += torch.tensor(stats["fraction"], dtype=torch.float64) * y.numel()
                tokens += y.numel()
                if mode == "threshold":
                    _, loss = model(x, y, **docs)
                    loss_sum += loss.item() * y.numel()
        out[mode] = {"recursion": list(range(1, depth + 1)), "fraction": (sums / tokens).tolist()}
        if mode == "threshold":
            out[mode]["loss"] = loss_sum / tokens
    return out


@torch.no_grad()
def ouro_report(model, cfg, batches, device) -> dict:
    """Mean exit distribution over tokens and the Q-exit rule's loss, mean depth and FLOPs at each q."""
    T = cfg.n_recurrence
    loops = list(range(1, T + 1))
    p_sum = torch.zeros(T, dtype=torch.float64)
    q_loss = {q: 0.0 for q in Q_LEVELS}
    q_depth = {q: 0.0 for q in Q_LEVELS}
    tokens = 0
    for batch in batches():
        x, y, docs = batch_parts(batch, device)
        states = dict(model.exit_states(x, loops, **docs))
        losses, _, _ = exit_stats(states, predicted_weight(model.lm_head), y, ref=T)  # [tokens, T]: CE at each loop
        losses = losses.cpu()  # beside the exit distribution, read on the host
        p = model.exit_distribution(x, T, **docs).reshape(-1, T).double().cpu()
        p_sum += p.sum(dim=0)
        cdf = p.cumsum(dim=-1)
        cdf[:, -1] = 1.0  # the last loop takes the remaining mass (no rounding can leave a token without an exit)
        for q in Q_LEVELS:
            first = (cdf >= q).double().argmax(dim=-1)  # the first loop whose cumulative probability reaches q
            q_loss[q] += losses.double().gather(1, first[:, None]).sum().item()
            q_depth[q] += (first + 1).double().sum().item()
        tokens += y.numel()
    cls = model_class(cfg.type)
    first_loop = cls.flops_per_token(cfg, 1, with_head=True)
    per_loop = cls.flops_per_token(cfg, 2, with_head=True) - first_loop  # FLOPs grow linearly with the loops
    rows = []
    for q in Q_LEVELS:
        mean_loops = q_depth[q] / tokens
        rows.append({"q": q, "loss": q_loss[q] / tokens, "mean_loops": mean_loops,
                     "flops_per_token": int(first_loop + (mean_loops - 1) * per_loop)})
    return {"loop": loops, "exit_probability": (p_sum / tokens).tolist(), "q_exit": rows, "val_tokens": tokens}


HALT_THRESHOLDS = (0.0, 0.25, 0.5, 0.75, 1.0)  # RecurTrace: the recipe's threshold is added to these


@torch.no_grad()
def recurtrace_report(model, cfg, batches, device) -> dict:
    """RecurTrace's halting at several thresholds (the recipe's among them): validation loss with per-token (or
    per-row, halt_mode) stopping, the mean loops per scored token (of at most n_recurrence) and the FLOPs per token
    of a decoder that runs each token only through its loops; threshold 0 runs every loop, 1 stops after the first."""
    import dataclasses

    cls = model_class(cfg.type)
    flops = torch.tensor([cls.flops_per_token(cfg, k, with_head=True) for k in range(cfg.n_recurrence + 1)],
                         dtype=torch.float64)
    rows = []
    original = model.cfg
    try:
        for th in sorted({*HALT_THRESHOLDS, cfg.halt_threshold}):
            model.cfg = dataclasses.replace(original, halt_threshold=th)
            loss_sum, loops_sum, flops_sum, tokens = 0.0, 0.0, 0.0, 0
            for batch in batches():
                x, y, docs = batch_parts(batch, device)
                _, loss = model(x, y, **docs)
                scored = y >= 0
                n = int(scored.sum())
                loops = model.last_loops[scored].long().cpu()  # loops each scored token ran
                loss_sum += loss.item() * n
                loops_sum += loops.sum().item()
                flops_sum += flops[loops].sum().item()
                tokens += n
            rows.append({"threshold": th, "loss": loss_sum / tokens, "mean_loops": loops_sum / tokens,
                         "flops_per_token": int(flops_sum / tokens), "recipe": th == cfg.halt_threshold})
    finally:
        model.cfg = original
    return {"halting": rows, "halt_mode": cfg.halt_mode, "max_loops": cfg.n_recurrence, "val_tokens": tokens}


def method_report(model, cfg, batches, device) -> dict | None:
    """The method's own measurements (see the module docstring), or None for a model without any."""
    if cfg.model.type == "mor":
        return {"mor": mor_report(model, batches, device)}
    if cfg.model.type == "ouro":
        return {"ouro": ouro_report(model, cfg.model, batches, device)}
    if cfg.model.type == "recurtrace":
        return {"recurtrace": recurtrace_report(model, cfg.model, batches, device)}
    return None


def print_method_report(report: dict) -> None:
    mor = report.get("mor")
    if mor:
        for mode, label in (("topk", "expert-choice top-k (as trained)"), ("threshold", "causal sigmoid >= 0.5")):
            fr = ", ".join(f"r{r} {f:.3f}" for r, f in zip(mor[mode]["recursion"], mor[mode]["fraction"]))
            print(f"  MoR tokens reaching each recursion, {label}: {fr}")
        print(f"  MoR loss at full depth with causal routing: {mor['threshold']['loss']:.4f}")
    ouro = report.get("ouro")
    if ouro:
        dist = ", ".join(f"t{t} {p:.3f}" for t, p in zip(ouro["loop"], ouro["exit_probability"]))
        print(f"  Ouro learned exit distribution (mean p_t): {dist}")
        for row in ouro["q_exit"]:
            print(f"  Ouro Q-exit q={row['q']:.1f}: loss {row['loss']:.4f}, mean loops {row['mean_loops']:.2f}, "
                  f"{row['flops_per_token'] / 1e6:,.1f}M FLOPs/token (read out of a full-depth pass)")
    _print_recurtrace(report)


def _print_recurtrace(report: dict) -> None:
    rt = report.get("recurtrace")
    if rt:
        R = rt["max_loops"]
        print(f"  RecurTrace halting ({'each token' if rt['halt_mode'] == 'token' else 'each row'} stops once "
              f"P(continue) < threshold; at most {R} loops; {rt['val_tokens']:,} validation tokens):")
        for row in rt["halting"]:
            mark = "  <- the recipe's threshold" if row["recipe"] else ""
            print(f"    threshold {row['threshold']:.2f}: loss {row['loss']:.4f}, mean loops per token "
                  f"{row['mean_loops']:.2f} of {R}, {row['flops_per_token'] / 1e6:,.1f}M FLOPs/token{mark}")


def method_metrics(report: dict) -> list[tuple[dict, int]]:
    """(metrics, step) pairs for MLflow: step = recursion / loop, or q (Q-exit) or the halting threshold
    (RecurTrace: ``eval.recurtrace_halt_*``) in percent; RecurTrace's recipe threshold also as single values
    (``eval.recurtrace_loss``, ``eval.recurtrace_mean_loops``, step 0)."""
    out = []
    mor = report.get("mor")
    if mor:
        for i, r in enumerate(mor["topk"]["recursion"]):
            out.append(({"eval.mor_fraction_topk": mor["topk"]["fraction"][i],
                         "eval.mor_fraction_threshold": mor["threshold"]["fraction"][i]}, r))
        out.append(({"eval.mor_threshold_loss": mor["threshold"]["loss"]}, 0))
    for row in report.get("recurtrace", {}).get("halting", []):
        out.append(({"eval.recurtrace_halt_loss": row["loss"], "eval.recurtrace_halt_mean_loops": row["mean_loops"]},
                    int(round(row["threshold"] * 100))))
        if row["recipe"]:  # one value per run (a stepped metric's table value is its last step: threshold 1)
            out.append(({"eval.recurtrace_loss": row["loss"], "eval.recurtrace_mean_loops": row["mean_loops"]}, 0))
    ouro = report.get("ouro")
    if ouro:
        for t, p in zip(ouro["loop"], ouro["exit_probability"]):
            out.append(({"eval.ouro_exit_probability": p}, t))
        for row in ouro["q_exit"]:
            out.append(({"eval.ouro_q_exit_loss": row["loss"], "eval.ouro_q_exit_mean_loops": row["mean_loops"]},
                        int(round(row["q"] * 100))))
    return out
