"""What the recurrence does, step by step (paper Appendix E), on validation tokens with noise off.

Per step r: gate mean/std and saturation (E.2), effective openness rho (Eq. 3), proposal and applied-update norms
(E.3), fixed-point ratio delta_fp (Eq. 4); loss per token-frequency band (E.10) and per difficulty decile (E.5) from
the per-token exit losses; the anchor ablations of Table 11 plus the gate forced to 0 and 1 (E.1); per-token gate
maps of a few prompts (Figure 8).
"""
from __future__ import annotations

import torch

from ops import gated_update
from pipeline.eval.exit_losses import exit_stats
from pipeline.model.layers import predicted_weight
from pipeline.model.layers import token_layout
from pipeline.train.data import batch_parts

# Token-id bands of the target token (Appendix E.10): name -> (first id, last id, description)
BANDS = {"bytes": (0, 255, "byte/punctuation, ids 0-255"), "common": (256, 2000, "common, ids 256-2,000"),
         "medium": (2001, 10000, "medium, ids 2,001-10,000"), "rare": (10001, 1 << 62, "rare, ids > 10,000")}
ANCHORS = {"prelude": "trained: fixed h_pre", "zeros": "zeros", "embedding": "input embedding",
           "previous": "previous state h^(r-1)"}
GATE_FORCED = {"gate0": (0.0, "gate = 0: always write"), "gate1": (1.0, "gate = 1: always copy")}


def trace_steps(model, idx: torch.Tensor, n_steps: int, anchor: str = "prelude", gate_value: float | None = None,
                noise: bool = False, h_pre: torch.Tensor | None = None, layout=None):
    """Yield (r, h^(r-1), o^(r), g^(r), h^(r)) for r = 1..n_steps, in one pass. ``anchor`` replaces h_pre where
    each step reads it (projection and gate): 'prelude' (the model as trained), 'zeros', 'embedding' (token +
    position embedding) or 'previous' (h^(r-1), a drifting anchor); ``gate_value`` forces g everywhere. ``noise``:
    the training noise (eps_x as the model draws it, eps_g ~ N(0, sigma_g^2) on the gate logits / tau) from the
    global torch RNG, which the caller seeds; off by default (Appendix E). ``h_pre``: the prelude output when the
    caller has it already. ``layout``: the pass's ``token_layout(model.cfg, idx, docs=docs)`` (documents under
    document masking); built here without documents when not given."""
    if anchor not in ANCHORS:
        raise ValueError(f"anchor {anchor!r}: choose one of {list(ANCHORS)}")
    step, tau = model.recurrent_core(), model.cfg.tau
    layout = token_layout(model.cfg, idx) if layout is None else layout
    h_pre = model.encode(idx, layout=layout) if h_pre is None else h_pre
    h = model.initial_state(h_pre, noise=noise)
    fixed = {"prelude": h_pre, "zeros": torch.zeros_like(h_pre)}.get(anchor)
    if anchor == "embedding":
        fixed = model.embed(idx, 0, layout)
    terms = step.anchor_terms(fixed) if fixed is not None else None  # the step's anchor halves, once
    for r in range(1, n_steps + 1):
        if anchor == "previous":
            terms = step.anchor_terms(h)
        o = step.proposal(h, None, noise, None, terms, layout=layout)
        if gate_value is not None:
            g = torch.full_like(h, gate_value)
            h_new = g * h + (1 - g) * o
        elif step.gate is None:
            g, h_new = None, o
        elif noise and model.cfg.sigma_g > 0:
            z = step.gate(h, terms[1])
            g = torch.sigmoid(z / tau + model.cfg.sigma_g * torch.randn_like(z))
            h_new = g * h + (1 - g) * o
        else:
            h_new, g = gated_update(step.gate(h, terms[1]), h, o, tau)
        yield r, h, o, g, h_new
        h = h_new


class StepStatistics:
    """Gate and update statistics per step (Appendix E.2, E.3, E.6), accumulated step by step over batches."""

    KEYS = ("g_sum", "g_sq", "g_hi", "g_lo", "g_n", "upd_sq", "prop_diff_sq", "h_sq", "o_norm", "u_norm", "tok")

    def __init__(self, n_steps: int):
        self.n_steps = n_steps
        self.acc = {k: [0.0] * n_steps for k in self.KEYS}

    def update(self, r: int, h: torch.Tensor, o: torch.Tensor, g: torch.Tensor | None, h_new: torch.Tensor) -> None:
        acc, i = self.acc, r - 1
        upd = (h_new - h).float()
        acc["upd_sq"][i] += upd.pow(2).sum().item()
        acc["prop_diff_sq"][i] += (o - h).float().pow(2).sum().item()
        acc["h_sq"][i] += h.float().pow(2).sum().item()
        acc["o_norm"][i] += o.float().norm(dim=-1).sum().item()
        acc["u_norm"][i] += upd.norm(dim=-1).sum().item()
        acc["tok"][i] += h.shape[0] * h.shape[1]
        if g is not None:
            gf = g.float()
            acc["g_sum"][i] += gf.sum().item()
            acc["g_sq"][i] += gf.pow(2).sum().item()
            acc["g_hi"][i] += (gf > 0.95).sum().item()
            acc["g_lo"][i] += (gf < 0.05).sum().item()
            acc["g_n"][i] += gf.numel()

    def result(self) -> dict:
        acc = self.acc
        out = {"step": list(range(1, self.n_steps + 1)),
               # Eq. 3 over all positions: ||(1-g)(o-h)||_F / ||o-h||_F
               "rho": [(u / p) ** 0.5 if p else None for u, p in zip(acc["upd_sq"], acc["prop_diff_sq"])],
               # what the paper's printed rho (0.182 -> 0.066) matches: its Figure 11(a) norms, applied update
               # 17.6 -> 6.5 over proposal ~93-99, i.e. mean per-token ||h^(r) - h^(r-1)|| over mean per-token ||o^(r)||
               "update_over_proposal": [u / o if o else None for u, o in zip(acc["u_norm"], acc["o_norm"])],
               # Eq. 4: ||h^(r) - h^(r-1)||_F / ||h^(r-1)||_F
               "delta_fp": [(u / h) ** 0.5 if h else None for u, h in zip(acc["upd_sq"], acc["h_sq"])],
               "proposal_norm": [s / t for s, t in zip(acc["o_norm"], acc["tok"])],
               "update_norm": [s / t for s, t in zip(acc["u_norm"], acc["tok"])]}
        if any(acc["g_n"]):
            mean = [s / n for s, n in zip(acc["g_sum"], acc["g_n"])]
            out.update(gate_mean=mean,
                       gate_std=[max(q / n - m * m, 0.0) ** 0.5 for q, n, m in zip(acc["g_sq"], acc["g_n"], mean)],
                       gate_frac_above_095=[s / n for s, n in zip(acc["g_hi"], acc["g_n"])],
                       gate_frac_below_005=[s / n for s, n in zip(acc["g_lo"], acc["g_n"])])
        return out


def band_losses(token_losses: torch.Tensor, token_ids: torch.Tensor, exits: list[int]) -> dict:
    """Mean loss per exit within each token-id band of the *target* token (Appendix E.10)."""
    out = {}
    for name, (lo, hi, what) in BANDS.items():
        mask = (token_ids >= lo) & (token_ids <= hi)
        n = int(mask.sum())
        out[name] = {"what": what, "tokens": n,
                     "loss": token_losses[mask].double().mean(dim=0).tolist() if n else None}
    return {"exit": exits, "bands": out}


def decile_losses(token_losses: torch.Tensor, exits: list[int], by_exit: int, to_exit: int | None = None) -> dict:
    """Tokens split into ten deciles of their loss at ``by_exit`` (GRT: r = 0, after the prelude): mean loss per
    decile and exit, and each decile's improvement from ``by_exit`` to ``to_exit`` (Appendix E.5: "over six recurrence
    steps", i.e. to the trained R; default the last exit) and to the last exit; ``improvement_r2``: R^2 of the
    least-squares line of the improvement (to ``to_exit``) on the decile's mean loss at ``by_exit`` (Figure 13(a):
    0.998)."""
    col = exits.index(by_exit)
    to_exit = exits[-1] if to_exit is None else to_exit
    to_col = exits.index(to_exit)
    difficulty = token_losses[:, col]
    order = difficulty.argsort()
    parts = torch.tensor_split(order, 10)
    edges = [difficulty[p].max().item() for p in parts[:-1]]
    loss = [token_losses[p].double().mean(dim=0).tolist() for p in parts]
    improvement = [row[col] - row[to_col] for row in loss]
    return {"exit": exits, "by_exit": by_exit, "to_exit": to_exit, "upper_edges": edges, "loss": loss,
            "improvement": improvement, "improvement_to_last": [row[col] - row[-1] for row in loss],
            "last_exit": exits[-1], "improvement_r2": r_squared([row[col] for row in loss], improvement),
            "tokens": [len(p) for p in parts]}


def r_squared(x: list[float], y: list[float]) -> float | None:
    """R^2 of the least-squares line y ~ a + b x (the squared Pearson correlation); None when x or y is constant."""
    xs, ys = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    xc, yc = xs - xs.mean(), ys - ys.mean()
    den = (xc.pow(2).sum() * yc.pow(2).sum()).item()
    return (xc @ yc).item() ** 2 / den if den > 0 else None


@torch.no_grad()
def anchor_ablation(model, batches, n_steps: int, device) -> dict:
    """Validation loss at depth ``n_steps`` with h_pre replaced by each alternative anchor (Table 11), and with the
    gate forced to 0 (always write the proposal) and to 1 (never update: the r = 0 loss)."""
    variants = {anchor: (anchor, None) for anchor in ANCHORS}
    if model.recurrent_core().gate is not None:
        variants.update({name: ("prelude", value) for name, (value, _) in GATE_FORCED.items()})
    sums, tokens = {k: 0.0 for k in variants}, 0
    weight = predicted_weight(model.lm_head)
    for batch in batches:
        x, y, docs = batch_parts(batch, device)
        layout = token_layout(model.cfg, x, **docs)
        for label, (anchor, gate_value) in variants.items():
            h = None
            for _, _, _, _, h in trace_steps(model, x, n_steps, anchor, gate_value, layout=layout):
                pass
            losses, _, _ = exit_stats({n_steps: model.readout(h, layout=layout)}, weight, y, ref=n_steps)
            sums[label] += losses.double().sum().item()
        tokens += y.numel()
    labels = {**ANCHORS, **{k: what for k, (_, what) in GATE_FORCED.items()}}
    return {"depth": n_steps, "loss": {k: v / tokens for k, v in sums.items()},
            "what": {k: labels[k] for k in sums}}


@torch.no_grad()
def gate_heatmaps(model, prompts: list[str], n_steps: int, device, encode, decode_token) -> list[dict]:
    """Per-token gate mean over features at each step for a few prompts (Figure 8): rows are steps."""
    out = []
    for text in prompts:
        ids = encode(text)[: model.cfg.block_size]
        x = torch.tensor([ids], device=device)
        rows = [g.float().mean(dim=-1)[0].tolist() for _, _, _, g, _ in trace_steps(model, x, n_steps)
                if g is not None]
        out.append({"prompt": text, "tokens": [decode_token(t) for t in ids], "gate": rows})
    return out
