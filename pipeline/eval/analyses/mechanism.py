"""Why the recurrence behaves as it does (paper Appendix E.7-E.9) and what it predicts at every step (Figure 4).

- E.7 gate attribution: how much of f_g's first-layer pre-activation comes from the state half W1_x LN(h^(r-1))
  versus the anchor half W1_a LN(h_pre) + b1, per step (Figure 15(a)-(b)); singular values of f_g's weights (15(c)).
- E.8 W_proj: spectra, effective rank and 90%-energy dimension of its state and anchor halves, the Frobenius norms
  of both halves of W_proj and of f_g's first layer, and the row cosine between the halves (Figure 16).
- E.9 attention of the shared core: per step, block and head the entropy of the attention rows, the mass on the
  previous token and on the diagonal, the mean attention distance, and a head classification (Figure 17).
- Figure 4: the next-token distribution after a prompt at every exit r = 0..n, in one pass.

Everything runs under torch.no_grad() on the model's device and reads the states of one traced pass
(:func:`.dynamics.trace_steps` or ``model.exit_states``); the accumulators take one batch at a time.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.eval.analyses.representation import rank_of_spectrum
from pipeline.model.layers import predicted_weight

# Paper E.9 thresholds (nats / attention mass), measured there at S = 1024. A row over t+1 keys has at most
# log(t+1) nats, so at short contexts (mean log(t+1) < 4 below ~150 tokens) no head can be "broad".
HEAD_THRESHOLDS = {"sharp_entropy_below": 1.0, "prev_mass_above": 0.35, "diag_mass_above": 0.35,
                   "broad_entropy_above": 4.0}
# Order of precedence (the paper's classes overlap): a positional role first, since a previous-token head is also
# sharp and the paper calls Block 0 Head 14 (entropy 0.30, prev-mass 0.88) a previous-token specialist; when both
# positional masses pass, the larger one wins. Then sharp, then broad, else general.
HEAD_CLASSES = ("previous_token", "self", "local_sharp", "broad", "general")
ATTENTION_STATS = ("entropy", "entropy_normalised", "prev_mass", "diag_mass", "distance")


@torch.no_grad()
def _svdvals(w: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(w.detach().double().cpu())


# ---------------------------------------------------------------------------------------------- E.7 gate attribution
class GateAttribution:
    """Accumulates, per step r, the two halves of f_g's first layer on [LN(h^(r-1)), LN(h_pre)]:
        a_x = W1_x LN(h^(r-1))        (state half)
        a_h = W1_a LN(h_pre) + b1     (anchor half; the bias goes here, as in ``Gate.anchor_term``: it is the same
                                       at every step, like the anchor)
    and reports per step (lists over the steps seen, in order):
        state_var_frac  = V_x / (V_x + V_h), V = sum over units j of Var_tokens(a[:, j])   (Figure 15(a))
        anchor_var_frac = V_h / (V_x + V_h)
        cross_cov_frac  = 2 sum_j Cov(a_x[:, j], a_h[:, j]) / sum_j Var(a_x + a_h)[:, j]: the share of the full
                          pre-activation variance the two-way split leaves out (the halves are correlated)
        x_dominance     = fraction of positions with ||a_x||_2 > ||a_h||_2 over units            (Figure 15(b))
        x_dominance_units = the same per (position, unit): |a_x| > |a_h|
        sign_agreement  = fraction of (position, unit) with a_x * a_h > 0                       (Figure 15(b))
    The paper attributes "the variance of the gate logit"; f_g is nonlinear after its first layer, so the split is
    made where it is exact (the first layer is a sum of the two halves). Variance is taken per unit over tokens, so
    a constant offset (the bias, a constant part of the anchor) explains none of the token-to-token variation.
    """

    def __init__(self, gate):
        if gate is None:
            raise ValueError("gate attribution needs f_g: this model has model.gate=none (no gate to attribute)")
        self.gate = gate
        self._acc: dict[int, dict] = {}
        self._anchor_of = self._anchor = None

    @torch.no_grad()
    def update(self, r: int, h_prev: torch.Tensor, h_pre: torch.Tensor) -> None:
        """Add one batch at step ``r``: ``h_prev`` = h^(r-1), ``h_pre`` = the prelude anchor, both [B, T, d]."""
        if h_pre is not self._anchor_of:  # the anchor half is the same at every step of a pass: compute it once
            self._anchor_of, self._anchor = h_pre, self.gate.anchor_term(h_pre).double().flatten(0, -2)
        a_h = self._anchor
        a_x = self.gate.fc1(self.gate.ln_h(h_prev), part="x").double().flatten(0, -2)
        acc = self._acc.setdefault(r, {"n": 0, "dom": 0.0, "dom_units": 0.0, "sign": 0.0})
        for name, v in (("sx", a_x.sum(0)), ("qx", a_x.pow(2).sum(0)), ("sh", a_h.sum(0)), ("qh", a_h.pow(2).sum(0)),
                        ("cxh", (a_x * a_h).sum(0))):
            acc[name] = acc.get(name, 0) + v
        acc["n"] += a_x.shape[0]
        acc["dom"] += (a_x.norm(dim=-1) > a_h.norm(dim=-1)).sum().item()
        acc["dom_units"] += (a_x.abs() > a_h.abs()).sum().item()
        acc["sign"] += (a_x * a_h > 0).sum().item()

    def result(self) -> dict:
        if not self._acc:
            raise RuntimeError("GateAttribution.result(): no update() was made; feed it every step of a traced pass")
        out = {k: [] for k in ("step", "state_var_frac", "anchor_var_frac", "cross_cov_frac", "x_dominance",
                               "x_dominance_units", "sign_agreement")}
        for r in sorted(self._acc):
            a = self._acc[r]
            n = a["n"]
            mx, mh = a["sx"] / n, a["sh"] / n
            vx = (a["qx"] / n - mx * mx).clamp_min(0).sum().item()
            vh = (a["qh"] / n - mh * mh).clamp_min(0).sum().item()
            cov = (a["cxh"] / n - mx * mh).sum().item()
            units = n * mx.numel()
            out["step"].append(r)
            out["state_var_frac"].append(vx / (vx + vh) if vx + vh > 0 else None)
            out["anchor_var_frac"].append(vh / (vx + vh) if vx + vh > 0 else None)
            out["cross_cov_frac"].append(2 * cov / (vx + vh + 2 * cov) if vx + vh + 2 * cov > 0 else None)
            out["x_dominance"].append(a["dom"] / n)
            out["x_dominance_units"].append(a["dom_units"] / units)
            out["sign_agreement"].append(a["sign"] / units)
        return out


def gate_weight_spectra(gate) -> dict:
    """Singular values (descending) of f_g's first-layer halves W1_x, W1_a ([d_gate, d] each) and of its second
    layer fc2 (Figure 15(c)), and the same halves with their LayerNorm gains folded in (W1 diag(gamma)): the map the
    normalised input actually sees, since LN(h) and LN(h_pre) carry different gains. ``leading``: the largest of
    each; ``leading_ratio_x_over_a``: the paper's 9.87 / 6.85 = 1.44."""
    if gate is None:
        raise ValueError("gate weight spectra need f_g: this model has model.gate=none")
    w1 = gate.fc1.weight
    d = w1.shape[1] // 2
    mats = {"W1_x": w1[:, :d], "W1_a": w1[:, d:], "fc2": gate.fc2.weight,
            "W1_x_ln": w1[:, :d] * gate.ln_h.weight, "W1_a_ln": w1[:, d:] * gate.ln_pre.weight}
    out = {name: _svdvals(m).tolist() for name, m in mats.items()}
    out["leading"] = {name: out[name][0] for name in mats}
    out["leading_ratio_x_over_a"] = out["W1_x"][0] / out["W1_a"][0] if out["W1_a"][0] > 0 else None
    return out


# ------------------------------------------------------------------------------------------------- E.8 W_proj
def matrix_spectrum(w: torch.Tensor, energy: float = 0.9) -> dict:
    """Singular values s (descending); effective rank exp(-sum p_i log p_i) with p = s / sum(s) (Roy & Vetterli),
    also over min(shape); cumulative energy sum_{i<=k} s_i^2 / sum s^2 and the smallest k reaching ``energy``;
    Frobenius norm sqrt(sum s^2)."""
    s = _svdvals(w)
    erank = rank_of_spectrum(s)
    cum = (s.pow(2).cumsum(0) / s.pow(2).sum())
    dim = int((cum < energy - 1e-12).sum()) + 1  # the tolerance keeps an exact 90% at its own k
    return {"singular_values": s.tolist(), "effective_rank": erank, "effective_rank_frac": erank / len(s),
            "cumulative_energy": cum.tolist(), f"energy_dim_{round(energy * 100)}": dim,
            "frobenius": s.pow(2).sum().sqrt().item()}


def row_cosine(w_x: torch.Tensor, w_h: torch.Tensor) -> dict:
    """cos(W_x[i], W_h[i]) for each output row i (the paper's "row cosine": how unit i weighs the state against the
    anchor; negative = it reads their difference). Mean, and the fraction of rows above 0.5 (paper: -0.189, 0.16%)."""
    cos = F.cosine_similarity(w_x.detach().double().cpu(), w_h.detach().double().cpu(), dim=1, eps=1e-12)
    return {"mean": cos.mean().item(), "frac_above_0.5": (cos > 0.5).double().mean().item(),
            "min": cos.min().item(), "max": cos.max().item()}


def projection_analysis(step) -> dict:
    """E.8 on a RecurrentStep: ``proj`` = {W_x, W_h: :func:`matrix_spectrum` of W_proj's state / anchor half,
    row_cosine: :func:`row_cosine`} (Figure 16(a)-(b)); ``gate_fc1`` the same for f_g's first layer; ``frobenius``:
    the four halves' norms (Figure 16(c)). A part the model lacks is None, with the reason under ``absent``."""
    cfg = getattr(step, "cfg", None)
    out, absent, frob = {}, {}, {}
    parts = {"proj": (getattr(step, "proj", None), "model.reinject=false: no W_proj, the core reads h + eps_x"),
             "gate_fc1": (getattr(getattr(step, "gate", None), "fc1", None), "model.gate=none: no gate f_g")}
    for name, (lin, reason) in parts.items():
        if lin is None:
            out[name] = None
            absent[name] = reason if cfg is not None else f"{type(step).__name__} has no {name}"
            continue
        d = lin.weight.shape[1] // 2
        w_x, w_h = lin.weight[:, :d], lin.weight[:, d:]
        out[name] = {"W_x": matrix_spectrum(w_x), "W_h": matrix_spectrum(w_h), "row_cosine": row_cosine(w_x, w_h)}
        frob[f"{name}.W_x"], frob[f"{name}.W_h"] = out[name]["W_x"]["frobenius"], out[name]["W_h"]["frobenius"]
    out["frobenius"], out["absent"] = frob, absent
    return out


# ---------------------------------------------------------------------------------------------- E.9 attention
@torch.no_grad()
def attention_probabilities(attn, x: torch.Tensor, layout=None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + mask) [B, H, T, T] in fp32, from an attention module's own projections of its input
    ``x`` [B, T, d] (``attn.projections``: the gpt2 block's c_attn; the llama block's QK-norm and rotary angles from
    the forward's ``layout``, its key heads shared by n_head / n_kv_head query heads each): the weights its kernel
    applies to V (no cache). The mask is causal, and within documents when the layout has them."""
    with torch.autocast(x.device.type, enabled=False):
        q, k, _ = attn.projections(x.float(), layout)
    q, k = q.float(), k.float()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA: query head h reads key head h // group
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~visible_keys(layout, x.shape[1], x.device), float("-inf")).softmax(dim=-1)


def visible_keys(layout, T: int, device) -> torch.Tensor:
    """[B|1, 1, T, T] bool: the keys each query attends to (causal; within its document when the layout has
    documents)."""
    if layout is not None and layout.docs is not None:
        return layout.dense_mask()
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]


def attention_row_statistics(probs: torch.Tensor, first_query: int = 1,
                             visible: torch.Tensor | None = None) -> tuple[dict, int]:
    """Per head, means over batch and query rows of causal attention ``probs`` [B, H, T, T]: entropy
    -sum_j p_tj ln p_tj (nats); entropy_normalised = entropy / ln(n_t) (n_t the keys row t may see: t + 1 causally,
    its document's tokens up to t within documents; 1 = uniform over them); prev_mass p_t,t-1; diag_mass p_tt;
    distance sum_j p_tj (t - j) (tokens). ``visible`` [B|1, 1, T, T]: the mask the probabilities were taken under
    (default causal). Only rows that see more than ``first_query`` keys count: a row with one key (t = 0, a
    document's first token) has entropy 0 and diagonal 1 whatever the head does, so it is left out by default.
    Returns ({name: [H] float64}, rows counted per head)."""
    B, H, T, _ = probs.shape
    if visible is None:
        visible = torch.ones(T, T, dtype=torch.bool, device=probs.device).tril()[None, None]
    n_keys = visible.sum(-1).expand(B, 1, T)  # [B, 1, T]
    counted = (n_keys > first_query).to(probs.dtype)
    rows = int(counted.sum().item())
    # per-row sums in the probabilities' dtype (fp32: a [B, H, T, T] fp64 copy would double the peak memory), the
    # means over rows in fp64
    t = torch.arange(T, device=probs.device)
    ent = -torch.special.xlogy(probs, probs).sum(-1)  # 0 log 0 = 0
    prev = probs.gather(-1, (t - 1).clamp_min(0).view(1, 1, -1, 1).expand(B, H, -1, 1))[..., 0] * (t >= 1)
    dist = (t[:, None] - t[None, :]).clamp_min(0).to(probs.dtype)
    stats = {"entropy": ent, "entropy_normalised": ent / torch.log(n_keys.to(probs.dtype)).clamp_min(1e-12),
             "prev_mass": prev, "diag_mass": probs.diagonal(dim1=-2, dim2=-1), "distance": (probs * dist).sum(-1)}
    return {k: ((v * counted).double().sum(dim=(0, 2)) / max(rows, 1)).cpu() for k, v in stats.items()}, rows


def classify_head(entropy: float, prev_mass: float, diag_mass: float, thresholds: dict = HEAD_THRESHOLDS) -> str:
    """One of HEAD_CLASSES, in the precedence stated at HEAD_CLASSES (paper E.9 thresholds)."""
    prev, diag = prev_mass > thresholds["prev_mass_above"], diag_mass > thresholds["diag_mass_above"]
    if prev or diag:
        return "previous_token" if prev and (not diag or prev_mass >= diag_mass) else "self"
    if entropy < thresholds["sharp_entropy_below"]:
        return "local_sharp"
    if entropy > thresholds["broad_entropy_above"]:
        return "broad"
    return "general"


class AttentionStatistics:
    """Context manager: while open, each call of a core block's attention (``recurrent_core().blocks[i].attn``) is
    mapped by order to (step, block) — a traced pass calls the n_core blocks in order once per step — and its
    attention probabilities are recomputed (:func:`attention_probabilities`) and reduced at once to per-head sums
    (:func:`attention_row_statistics`); no [B, H, T, T] tensor outlives its call. Run exactly ``n_steps`` steps per
    batch inside it (several batches are fine), then :meth:`result`."""

    def __init__(self, model, n_steps: int, thresholds: dict = HEAD_THRESHOLDS, classify_through: int | None = None):
        core = model.recurrent_core()
        blocks = None if core is None else core.blocks
        if blocks is None or len(blocks) == 0:
            raise ValueError(f"attention statistics need a recurrent model with core blocks (model.recur.blocks); "
                             f"{type(model).__name__} has none")
        self.attns = [b.attn for b in blocks]
        self.n_steps, self.n_core, self.n_head = n_steps, len(blocks), self.attns[0].n_head
        self.thresholds, self.classify_through = thresholds, classify_through
        self.sums = {k: torch.zeros(n_steps, self.n_core, self.n_head, dtype=torch.float64) for k in ATTENTION_STATS}
        self.rows = torch.zeros(n_steps, self.n_core, dtype=torch.float64)
        self.calls, self._handles = 0, []

    def __enter__(self):
        self._handles = [a.register_forward_hook(self._hook_for(i), with_kwargs=True)
                         for i, a in enumerate(self.attns)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook_for(self, block: int):
        def hook(module, args, kwargs, output):
            x, kv, key_mask, layout = (tuple(args) + (None,) * 3)[:4]
            layout = kwargs.get("layout", layout)
            if kv is not None or key_mask is not None:
                raise ValueError("attention statistics read uncached, unmasked passes only: trace with "
                                 "pipeline.eval.analyses.dynamics.trace_steps (no KV cache, no key mask)")
            pos = self.calls % (self.n_steps * self.n_core)
            step, expected = divmod(pos, self.n_core)
            if block != expected:
                raise RuntimeError(f"core block {block} ran where block {expected} of step {step + 1} was expected: "
                                   f"every step must run all {self.n_core} core blocks in order")
            stats, rows = attention_row_statistics(attention_probabilities(module, x, layout),
                                                   visible=visible_keys(layout, x.shape[1], x.device))
            for k, v in stats.items():
                self.sums[k][step, block] += v * rows
            self.rows[step, block] += rows
            self.calls += 1
        return hook

    def result(self) -> dict:
        """Tables [step][block][head] of each statistic in ATTENTION_STATS; per-step means over all heads
        (``mean_<stat>``); ``classes`` [block][head] from each head's stats averaged over steps, ``class_counts``,
        ``classes_per_step`` [step][block][head] and ``stable_heads`` (heads whose class is the same at every step)."""
        per_pass = self.n_steps * self.n_core
        if self.calls == 0 or self.calls % per_pass or bool((self.rows == 0).any()):
            raise RuntimeError(f"{self.calls} core-attention calls is not a whole number of traced passes of "
                               f"{self.n_steps} steps x {self.n_core} blocks (with T >= 2): run trace_steps with "
                               f"n_steps={self.n_steps} on every batch inside the context")
        mean = {k: v / self.rows[..., None] for k, v in self.sums.items()}
        out = {"step": list(range(1, self.n_steps + 1)), "n_core": self.n_core, "n_head": self.n_head,
               "query_rows": "rows with 2 or more keys (row 0, a document's first token: one)",
               "passes": self.calls // per_pass,
               "thresholds": dict(self.thresholds), "precedence": list(HEAD_CLASSES)}
        out.update({k: v.tolist() for k, v in mean.items()})
        out.update({f"mean_{k}": v.mean(dim=(1, 2)).tolist() for k, v in mean.items()})
        def cls(e, p, d):
            return classify_head(e.item(), p.item(), d.item(), self.thresholds)
        # a head's class: its statistics averaged over steps 1..classify_through (the trained R; the paper's table
        # is its R = 6 model's 6 steps), while the per-step tables above run to every traced step
        upto = min(self.classify_through or self.n_steps, self.n_steps)
        out["classified_over_steps"] = upto
        over = {k: mean[k][:upto].mean(0) for k in ("entropy", "prev_mass", "diag_mass")}
        out["classes"] = [[cls(over["entropy"][b, h], over["prev_mass"][b, h], over["diag_mass"][b, h])
                           for h in range(self.n_head)] for b in range(self.n_core)]
        out["classes_per_step"] = [[[cls(mean["entropy"][s, b, h], mean["prev_mass"][s, b, h],
                                         mean["diag_mass"][s, b, h]) for h in range(self.n_head)]
                                    for b in range(self.n_core)] for s in range(self.n_steps)]
        flat = [c for row in out["classes"] for c in row]
        out["class_counts"] = {c: flat.count(c) for c in HEAD_CLASSES}
        out["stable_heads"] = sum(len({out["classes_per_step"][s][b][h] for s in range(upto)}) == 1
                                  for b in range(self.n_core) for h in range(self.n_head))
        return out


# ---------------------------------------------------------------------------------------- Figure 4 traces
@torch.no_grad()
def next_token_traces(model, prompts: list[str], n_steps: int, encode, decode_token, top_k: int = 5) -> list[dict]:
    """For each prompt, p(next token | prompt) = softmax(lm_head(states at the last position)) at every exit
    model.exit_states yields for r = 0..n_steps (GRT: 0 = prelude only; a dense model yields layers 1..n), in one
    pass. ``candidates``: the union of every exit's top-k, each with its probability at every exit, ordered by
    probability at the last exit; ``argmax``: the most likely token per exit. A prompt longer than the context keeps
    its last block_size tokens (the ones the next token follows)."""
    device = model.lm_head.weight.device
    was_training = model.training
    model.eval()  # dropout off (GRT/Poisson exit_states are noise-free by construction)
    try:
        out = []
        for text in prompts:
            ids = list(encode(text))[-model.cfg.block_size:]
            if not ids:
                raise ValueError(f"trace prompt {text!r} encodes to no tokens; give a non-empty prompt")
            x = torch.tensor([ids], device=device)
            exits, probs = [], []
            for r, states in model.exit_states(x, range(0, n_steps + 1)):
                exits.append(r)
                probs.append((states[0, -1] @ predicted_weight(model.lm_head).t()).float().softmax(-1).cpu())
            p = torch.stack(probs)  # [exits, V]
            union = torch.unique(p.topk(min(top_k, p.shape[1]), dim=-1).indices)
            union = union[p[-1, union].argsort(descending=True)]
            top = p.argmax(-1)
            out.append({"prompt": text, "prompt_tokens": len(ids), "exit": exits, "top_k": top_k,
                        "candidates": [{"token_id": int(t), "token": decode_token(int(t)), "prob": p[:, t].tolist()}
                                       for t in union],
                        "argmax": [{"token_id": int(t), "token": decode_token(int(t)), "prob": p[i, t].item()}
                                   for i, t in enumerate(top)]})
        return out
    finally:
        model.train(was_training)
