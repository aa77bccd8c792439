"""What the recurrent state looks like step by step (paper Appendix E.3-E.6, E.10), from the states of one pass.

- E.3 / E.6 Figure 14(b): :class:`SuccessiveStates` — cosine of successive states, of the proposal with the state,
  of successive updates, and the ratio of successive update norms (our reading of the "local step gain").
- E.4: linear CKA (:func:`linear_cka`) between the states of every pair of steps (:func:`cka_matrix`) and against a
  dense baseline's per-layer residual states (:func:`cross_cka`, :func:`dense_layer_states`).
- E.5: gate–difficulty correlation (:class:`TokenGateMean`, :func:`gate_difficulty`, :func:`gate_difficulty_by_step`).
- E.6: effective rank of the state and of the step deltas (:func:`effective_rank`, :func:`effective_rank_by_step`).
- E.10: relative improvement per step Δ_rel(r) = (L_(r-1) - L_r) / L_(r-1), overall and per frequency band.

States are the raw residual states h^(r) (before coda and final LN), the paper's "hidden-state representations".
CKA and effective rank need [tokens, d] matrices: :class:`TokenSample` keeps the first ``eval.analysis_tokens`` token
rows of each step. Everything is accumulated batch by batch; sums and decompositions run in float64.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.model.layers import token_layout


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [tokens, d]."""
    return x.reshape(-1, x.shape[-1])


def _num(x) -> float | None:
    """A float for JSON: None where the value is undefined (JSON has no NaN)."""
    x = float(x)
    return None if math.isnan(x) else x


# ------------------------------------------------------------------------------------------------ E.3 successive states
class SuccessiveStates:
    """How each step's state relates to the previous one (Appendix E.3, Figure 11(b, c); E.6, Figure 14(b)).

    Call ``update(r, h_prev, h, o=None)`` with h^(r-1), h^(r) (and the proposal o^(r)) [B, T, d] for r = 1..n in
    order within each batch. ``result()`` gives per step r, with Δh^(r) = h^(r) - h^(r-1):

    - ``cosine``: mean over tokens of cos(h^(r)_t, h^(r-1)_t) — Figure 11(b)'s "applied update cosine", 0.94 -> 0.99.
    - ``proposal_cosine``: mean over tokens of cos(o^(r)_t, h^(r-1)_t) — Figure 11(b)'s "proposal cosine" (the block
      and the state agreeing on direction, 0.19 -> 0.51); only when ``o`` is passed.
    - ``delta_cosine``: mean over tokens of cos(Δh^(r)_t, Δh^(r-1)_t), from r = 2 — Figure 14(b)'s "Δh cosine".
    - ``delta_ratio``: ||Δh^(r)||_F / ||Δh^(r-1)||_F over all tokens, from r = 2. The paper does not define its
      "local step gain estimate" (Figure 11(c), 10.4 at step 2 -> 4.7 at step 6, not reproducible from the text).
      We use the finite-difference gain of the step map F along the trajectory: Δh^(r) = F(h^(r-1)) - F(h^(r-2))
      ≈ J_F Δh^(r-1), so this ratio is the local gain of one step; < 1 means contractive (what E.6 claims).
      Pooled (Frobenius) rather than a per-token mean so tokens whose last update was ~0 cannot dominate it.
    Cosines of zero vectors count as 0 (torch's eps); e.g. h^(0) = 0 under ``init_state: zeros``.
    """

    WHAT = {"cosine": "mean per-token cos(h^(r), h^(r-1))",
            "proposal_cosine": "mean per-token cos(o^(r), h^(r-1))",
            "delta_cosine": "mean per-token cos(h^(r) - h^(r-1), h^(r-1) - h^(r-2))",
            "delta_ratio": "local step gain: ||h^(r) - h^(r-1)||_F / ||h^(r-1) - h^(r-2)||_F over all tokens"}

    def __init__(self):
        self._acc: dict[int, dict[str, float]] = {}
        self._prev: tuple[int, torch.Tensor] | None = None  # (r, Δh^(r)) of the current batch

    def update(self, r: int, h_prev: torch.Tensor, h: torch.Tensor, o: torch.Tensor | None = None) -> None:
        h_prev, h = h_prev.float(), h.float()
        delta = h - h_prev
        n = delta.numel() // delta.shape[-1]
        acc = self._acc.setdefault(r, dict.fromkeys(
            ("tokens", "cos", "delta_sq", "prop_cos", "prop_tokens", "dcos", "pair_tokens", "pair_sq", "prev_sq"),
            0.0))
        acc["tokens"] += n
        acc["cos"] += F.cosine_similarity(h, h_prev, dim=-1).double().sum().item()
        if o is not None:
            acc["prop_cos"] += F.cosine_similarity(o.float(), h_prev, dim=-1).double().sum().item()
            acc["prop_tokens"] += n
        if r > 1:
            if self._prev is None or self._prev[0] != r - 1 or self._prev[1].shape != delta.shape:
                raise ValueError(f"SuccessiveStates.update(r={r}) without step {r - 1} of the same batch before it: "
                                 f"call update for r = 1, 2, ..., n in order for every batch")
            prev = self._prev[1]
            acc["dcos"] += F.cosine_similarity(delta, prev, dim=-1).double().sum().item()
            acc["pair_tokens"] += n
            acc["pair_sq"] += delta.double().pow(2).sum().item()
            acc["prev_sq"] += prev.double().pow(2).sum().item()
        self._prev = (r, delta)

    def result(self) -> dict:
        steps = sorted(self._acc)
        a = [self._acc[r] for r in steps]
        out = {"step": steps, "tokens": int(a[0]["tokens"]) if a else 0,
               "cosine": [x["cos"] / x["tokens"] for x in a],
               "delta_cosine": [x["dcos"] / x["pair_tokens"] if x["pair_tokens"] else None for x in a],
               "delta_ratio": [math.sqrt(x["pair_sq"] / x["prev_sq"]) if x["prev_sq"] else None for x in a],
               "what": dict(self.WHAT)}
        if any(x["prop_tokens"] for x in a):
            out["proposal_cosine"] = [x["prop_cos"] / x["prop_tokens"] if x["prop_tokens"] else None for x in a]
        else:
            del out["what"]["proposal_cosine"]
        return out


# -------------------------------------------------------------------------------------------------- token samples
class TokenSample:
    """The first ``max_tokens`` token rows of each step's states, collected across batches: ``add(step, [B, T, d])``
    per batch and step, ``matrix(step)`` -> [N, d] float32 (N <= max_tokens). Row i is the same token at every step as
    long as every step is added for every batch. The first rows, not a random subset: the sample is the same on
    every rerun and across models fed the same batches (what cross-model CKA needs)."""

    def __init__(self, max_tokens: int, device: torch.device | str | None = None):
        if max_tokens < 2:
            raise ValueError(f"TokenSample needs max_tokens >= 2 (CKA and effective rank centre over tokens), "
                             f"got {max_tokens}: raise eval.analysis_tokens")
        self.max_tokens, self.device = max_tokens, device
        self._rows: dict[int, list[torch.Tensor]] = {}

    def add(self, step: int, states: torch.Tensor) -> None:
        parts = self._rows.setdefault(step, [])
        take = self.max_tokens - sum(p.shape[0] for p in parts)
        if take > 0:  # a copy, so the sample does not keep the whole batch's storage alive
            parts.append(_rows(states.detach())[:take].to(self.device or states.device, torch.float32, copy=True))

    def steps(self) -> list[int]:
        return sorted(self._rows)

    def full(self) -> bool:
        """Every step seen so far holds ``max_tokens`` rows (False before the first ``add``)."""
        return bool(self._rows) and all(sum(p.shape[0] for p in parts) >= self.max_tokens
                                        for parts in self._rows.values())

    def matrix(self, step: int) -> torch.Tensor:
        if step not in self._rows:
            raise KeyError(f"TokenSample has no rows for step {step}; it has steps {self.steps()}")
        return torch.cat(self._rows[step])


# ----------------------------------------------------------------------------------------------------- E.4 CKA
def _centred(x: torch.Tensor) -> torch.Tensor:
    x = _rows(x).to(torch.float64)
    return x - x.mean(dim=0, keepdim=True)


def _gram_norm(xc: torch.Tensor) -> torch.Tensor:
    """||X^T X||_F = ||X X^T||_F, by the smaller product."""
    n, d = xc.shape
    return (xc.T @ xc).norm() if d <= n else (xc @ xc.T).norm()


def _use_gram(n: int, dims: list[int], pairs: int) -> bool:
    """Whether the Gram form costs fewer multiply-adds: n^2 d_i per representation to build K_i = X_i X_i^T plus n^2
    per pair, against n d_i d_j per pair for ||X_j^T X_i||_F^2. Wide states (d ~ n, as with 4,096 sampled tokens of a
    d = 1280 model against ~37 baseline layers) are several times cheaper as Grams. At most 8,192 rows: each Gram
    is [n, n] float64 and one is kept per step."""
    d = max(dims)
    return n <= 8192 and len(dims) * n * n * d + pairs * n * n < pairs * n * d * d


def _prepared(x: torch.Tensor, gram: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(form, ||X^T X||_F) of centred X: X itself, or its Gram matrix K = X X^T when ``gram``."""
    xc = _centred(x)
    if gram:
        k = xc @ xc.T
        return k, k.norm()
    return xc, _gram_norm(xc)


def _cka(a: tuple, b: tuple, gram: bool) -> float:
    """CKA of two :func:`_prepared` sides: <K_x, K_y>_F (Gram form) = ||Y^T X||_F^2 (feature form), over the norms."""
    (x, x_norm), (y, y_norm) = a, b
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA compares the same tokens: got {x.shape[0]} rows vs {y.shape[0]}; sample both sides "
                         f"from the same batches (TokenSample of every step and layer)")
    denom = x_norm * y_norm.to(x_norm.device)
    if denom <= 0:
        return float("nan")  # a constant representation: CKA is undefined
    y = y.to(x.device)
    cross = (x * y).sum() if gram else (y.T @ x).pow(2).sum()
    return (cross / denom).item()


def linear_cka(X: torch.Tensor, Y: torch.Tensor) -> float:
    """Linear CKA (Kornblith et al. 2019, the paper's [42]) of X [n, d1] and Y [n, d2], rows = the same tokens:
    ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) with columns centred, in float64. 1 for representations equal up to
    an orthogonal transform and isotropic scale; NaN when one side is constant."""
    gram = _use_gram(_rows(X).shape[0], [X.shape[-1], Y.shape[-1]], 1)
    return _cka(_prepared(X, gram), _prepared(Y, gram), gram)


def cka_matrix(states: list[torch.Tensor], steps: list[int] | None = None) -> dict:
    """Within-model CKA (Figure 12(a)): ``cka[i][j]`` = linear CKA of the states of ``steps[i]`` and ``steps[j]``
    (default steps 0..len-1, i.e. h^(0..n)). Each state is centred once; None where undefined."""
    steps = list(range(len(states))) if steps is None else list(steps)
    n, m = (_rows(states[0]).shape[0] if states else 0), len(states)
    gram = _use_gram(n, [s.shape[-1] for s in states], m * (m + 1) // 2) if states else False
    sides = [_prepared(s, gram) for s in states]
    out = [[None] * m for _ in range(m)]
    for i in range(m):
        for j in range(i, m):
            out[i][j] = out[j][i] = _num(_cka(sides[i], sides[j], gram))
    return {"step": steps, "cka": out, "tokens": n}


def cross_cka(states: list[torch.Tensor], layer_states: list[torch.Tensor], steps: list[int] | None = None) -> dict:
    """Cross-model CKA (Figure 12(b)): ``cka[i][l]`` = linear CKA of step ``steps[i]``'s states and the dense
    baseline's residual states after layer l (l = 0: after the embedding), on the same tokens; ``best_layer[i]`` is
    the baseline layer step i aligns with most (the paper: layer 2 for r <= 1, layer 11 for r >= 2). The steps are
    prepared once; the layers one at a time."""
    steps = list(range(len(states))) if steps is None else list(steps)
    n = _rows(states[0]).shape[0] if states else 0
    dims = [s.shape[-1] for s in states + layer_states]
    gram = _use_gram(n, dims, len(states) * len(layer_states)) if states and layer_states else False
    sides = [_prepared(s, gram) for s in states]
    columns = []
    for layer in layer_states:
        side = _prepared(layer, gram)
        columns.append([_num(_cka(s, side, gram)) for s in sides])
    out = [list(row) for row in zip(*columns)] if columns else [[] for _ in states]
    best = [max(range(len(row)), key=lambda l: -1.0 if row[l] is None else row[l]) if row else None for row in out]
    return {"step": steps, "layer": list(range(len(layer_states))), "cka": out, "best_layer": best, "tokens": n}


@torch.no_grad()
def dense_layer_states(gpt_model, idx: torch.Tensor, docs: torch.Tensor | None = None) -> list[torch.Tensor]:
    """A dense GPT's residual states in one pass: [after the embedding, after block 1, ..., after block L], each
    [B, T, d] (before the final LN, like the recurrent states h^(r) they are compared with); ``docs`` as in its
    forward."""
    if gpt_model.training:
        raise ValueError("dense_layer_states on a model in training mode: dropout would perturb the states; call "
                         "model.eval() first")
    layout = token_layout(gpt_model.cfg, idx, docs=docs)
    h = gpt_model.embed(idx, 0, layout)
    out = [h]
    for block in gpt_model.blocks:
        h = block(h, layout=layout)
        out.append(h)
    return out


# ----------------------------------------------------------------------------------------- E.5 gate vs difficulty
class TokenGateMean:
    """Per-token gate mean over features, kept per step: ``update(r, g^(r) [B, T, d])`` for each batch and step,
    tokens flattened in batch order (the order of ``exit_curve(..., keep_tokens=True)``'s per-token losses).
    ``step_values(r)`` -> [tokens]; ``values()`` -> mean over steps and features, [tokens]."""

    def __init__(self):
        self._steps: dict[int, list[torch.Tensor]] = {}

    def update(self, r: int, g: torch.Tensor) -> None:
        self._steps.setdefault(r, []).append(g.detach().float().mean(dim=-1).reshape(-1).cpu())

    def steps(self) -> list[int]:
        return sorted(self._steps)

    def step_values(self, r: int) -> torch.Tensor:
        return torch.cat(self._steps[r])

    def values(self) -> torch.Tensor:
        per_step = [self.step_values(r) for r in self.steps()]
        if not per_step:
            raise ValueError("TokenGateMean has no gate values: the model has no gate (model.gate: none) or update "
                             "was never called; skip the gate_difficulty analysis for it")
        if len({v.numel() for v in per_step}) > 1:
            raise ValueError(f"TokenGateMean: steps saw different token counts {[v.numel() for v in per_step]}; "
                             f"update every step for every batch")
        return torch.stack(per_step).mean(dim=0)


def gate_difficulty(token_gate_mean: torch.Tensor, token_loss_r0: torch.Tensor, bins: int = 10) -> dict:
    """Does the gate open more (lower g) for harder tokens? (Appendix E.5; the paper: r = -0.07 .. -0.04.)

    Over tokens t with x_t = loss at r = 0 (nats) and y_t = mean gate: Pearson r = S_xy / sqrt(S_xx S_yy), R² = r²,
    the least-squares line y = slope x + intercept (slope = S_xy / S_xx), and the mean gate (and loss) in ``bins``
    equal-count bins of x (deciles; bin 1 = easiest). None where a variance is zero. Float64."""
    x, y = token_loss_r0.detach().reshape(-1).cpu().double(), token_gate_mean.detach().reshape(-1).cpu().double()
    if x.numel() != y.numel():
        raise ValueError(f"gate_difficulty: {y.numel()} gate values vs {x.numel()} losses; both must come from the "
                         f"same tokens in the same order (the same validation batches)")
    xm, ym = x - x.mean(), y - y.mean()
    sxx, syy, sxy = (xm * xm).sum().item(), (ym * ym).sum().item(), (xm * ym).sum().item()
    r = sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None
    slope = sxy / sxx if sxx > 0 else None
    parts = [p for p in torch.tensor_split(x.argsort(), bins) if p.numel()]
    return {"tokens": x.numel(), "pearson_r": r, "r2": r * r if r is not None else None, "slope": slope,
            "intercept": y.mean().item() - slope * x.mean().item() if slope is not None else None,
            "bins": {"loss_mean": [x[p].mean().item() for p in parts], "gate_mean": [y[p].mean().item() for p in parts],
                     "tokens": [p.numel() for p in parts]}}


def gate_difficulty_by_step(gates: TokenGateMean, token_loss_r0: torch.Tensor, through: int | None = None) -> dict:
    """r / R² / slope per step (the paper reports the correlation "across all steps"), and ``all_steps``:
    :func:`gate_difficulty` of the gate averaged over steps 1..``through`` (the trained R: the paper's steps are
    those of its R = 6 model; default every step)."""
    per = [gate_difficulty(gates.step_values(r), token_loss_r0) for r in gates.steps()]
    upto = [r for r in gates.steps() if through is None or r <= through]
    mean = torch.stack([gates.step_values(r) for r in upto]).mean(dim=0)
    return {"all_steps": gate_difficulty(mean, token_loss_r0), "all_steps_through": upto[-1], "step": gates.steps(),
            **{k: [p[k] for p in per] for k in ("pearson_r", "r2", "slope")}}


# ---------------------------------------------------------------------------------------------- E.6 effective rank
def rank_of_spectrum(s: torch.Tensor) -> float:
    """exp(-sum_i p_i log p_i), p = s / sum(s), of singular values ``s`` (Roy & Vetterli 2007); 0 for a zero matrix."""
    total = s.sum()
    if total <= 0:
        return 0.0
    p = s / total
    return math.exp(-torch.special.xlogy(p, p).sum().item())


def effective_rank(X: torch.Tensor, centre: bool = True) -> dict:
    """Effective rank (Roy & Vetterli 2007) of X [n, d] ([..., d] is flattened): exp(-sum_i p_i log p_i) with
    p_i = s_i / sum_j s_j over the singular values s of X, columns centred first when ``centre`` (so the mean state,
    one large shared direction, does not count as structure). Float64.

    ``effective_rank_fraction`` divides by the largest value possible, ``max_rank`` = min(n - 1, d) centred
    (centring removes one dimension), min(n, d) not: with more tokens than dimensions, as with the default
    eval.analysis_tokens, that is d — our reading of the paper's normalised 0.546 -> 0.635 (its raw figures such
    as 1002.9 of E.8 are ``effective_rank`` of uncentred weight matrices). A zero matrix has effective rank 0."""
    x = _rows(X).to(torch.float64)
    if centre:
        x = x - x.mean(dim=0, keepdim=True)
    n, d = x.shape
    # s_i^2 = eigenvalues of the smaller Gram matrix: 3-4x faster than an SVD of a [4096, 1280] float64 matrix on a
    # CPU. Eigenvalues below max(n, d) eps lambda_max (numpy's matrix_rank tolerance for a Hermitian matrix) are the
    # Gram route's roundoff (singular values under ~1e-7 s_max) and count as 0.
    lam = torch.linalg.eigvalsh(x.T @ x if d <= n else x @ x.T)
    lam = torch.where(lam > lam.max() * max(n, d) * torch.finfo(torch.float64).eps, lam, torch.zeros_like(lam))
    erank = rank_of_spectrum(lam.sqrt())
    max_rank = max(min(n - 1, d) if centre else min(n, d), 1)
    return {"effective_rank": erank, "effective_rank_fraction": erank / max_rank, "max_rank": max_rank,
            "tokens": n, "dim": d, "centred": centre}


def effective_rank_by_step(sample: TokenSample, late_step: int | None = None) -> dict:
    """Figure 14(a): centred :func:`effective_rank` of each step's sampled states, and of each step's update
    Δh^(r) = h^(r) - h^(r-1) on the same tokens (where step r - 1 is sampled too). ``late_delta`` is the update of
    step ``late_step`` (the trained R; default the last step), the paper's "delta subspace — the directions along
    which the hidden state changes in later steps" (0.69 against 0.635 for the state)."""
    steps = sample.steps()
    states = [effective_rank(sample.matrix(r)) for r in steps]
    delta_steps = [r for r in steps if r - 1 in steps]
    deltas = [effective_rank(sample.matrix(r) - sample.matrix(r - 1)) for r in delta_steps]
    return {"step": steps, "effective_rank": [e["effective_rank"] for e in states],
            "effective_rank_fraction": [e["effective_rank_fraction"] for e in states],
            "delta_step": delta_steps, "delta_effective_rank": [e["effective_rank"] for e in deltas],
            "delta_effective_rank_fraction": [e["effective_rank_fraction"] for e in deltas],
            "late_delta": next(({"step": r, **e} for r, e in zip(delta_steps, deltas) if r == late_step),
                               {"step": delta_steps[-1], **deltas[-1]} if deltas else None),
            "tokens": states[0]["tokens"] if states else 0, "max_rank": states[0]["max_rank"] if states else None,
            "what": "exp(entropy of normalised singular values) of the centred [tokens, d] state; fraction = "
                    "/ min(tokens - 1, d)"}


# ------------------------------------------------------------------------------------ E.10 relative improvement
def relative_improvement(exits: list[int], losses: list[float | None], bands: dict | None = None) -> dict:
    """Appendix E.10, Figure 18(b): for consecutive exits e_(i-1) < e_i (sorted; exit 0 first when present)
    Δ_rel = (L_(i-1) - L_i) / L_(i-1), the fraction of the previous exit's loss the step resolves, and
    ``cumulative`` = (L_first - L_i) / L_first (the paper: 67% for byte/punctuation tokens over six steps). With
    ``bands`` (:func:`.dynamics.band_losses`'s output) the same per frequency band under ``bands``."""
    pairs = sorted(zip(exits, losses), key=lambda pair: pair[0])
    first = pairs[0][1] if pairs else None

    def ratio(a, b):
        return (a - b) / a if a is not None and b is not None and a != 0 else None

    out = {"step": [e for e, _ in pairs[1:]], "from_exit": [e for e, _ in pairs[:-1]],
           "relative_improvement": [ratio(a, b) for (_, a), (_, b) in zip(pairs, pairs[1:])],
           "cumulative": [ratio(first, b) for _, b in pairs[1:]], "base_exit": pairs[0][0] if pairs else None}
    if bands is not None:
        out["bands"] = {}
        for name, row in bands["bands"].items():
            sub = relative_improvement(bands["exit"], row["loss"]) if row["loss"] else None
            out["bands"][name] = {"what": row["what"], "tokens": row["tokens"], "step": sub and sub["step"],
                                  "relative_improvement": sub and sub["relative_improvement"],
                                  "cumulative": sub and sub["cumulative"]}
    return out
