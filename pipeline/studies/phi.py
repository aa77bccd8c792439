"""The recurrence-equivalence exponent phi (companion abstract "Temporal Recurrence Favors Fewer Layers"): fit

    L = E + A (N_once + r^phi N_rec)^(-alpha) + B D^(-beta)

over a set of runs (final validation loss L, parameters run once N_once, recurrent parameters N_rec, recurrence
count r, training tokens D). phi = 1: looping a block r times is worth r unique blocks; phi = 0: worth one block.

The fit follows the scaling-law practice the abstract's family uses (Hoffmann et al. 2022, "Chinchilla", Approach
3): the terms are written as exponentials, E = e^e, A = e^a, B = e^b, and the Huber loss (delta 1e-3) of
log L_pred - log L_obs is minimised with L-BFGS-B from a grid of initialisations, the best kept. Confidence
intervals: a bootstrap over runs (resampled with replacement, refit from the best point), percentile intervals.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from dataclasses import field

import numpy as np

PARAMS = ("E", "A", "alpha", "B", "beta", "phi")
HUBER_DELTA = 1e-3
PHI_BOUNDS = (-1.0, 3.0)  # wide of [0, 1]: a fit outside it says the data do not pin phi


@dataclass
class Run:
    loss: float
    n_once: float
    n_rec: float
    r: int
    tokens: float
    name: str = ""
    branch_of: str = ""  # a decay branch (grt branch): "STABLE@STEP", one of several budgets of one stable run


@dataclass
class PhiFit:
    params: dict  # E, A, alpha, B, beta, phi
    objective: float
    n_runs: int
    ci: dict = field(default_factory=dict)  # name -> (low, high), from the bootstrap
    n_boot: int = 0

    def predict(self, n_once, n_rec, r, tokens):
        return predict(self.params, n_once, n_rec, r, tokens)


def predict(p: dict, n_once, n_rec, r, tokens):
    """The law at the given runs (arrays or scalars)."""
    n_eff = np.asarray(n_once, float) + np.asarray(r, float) ** p["phi"] * np.asarray(n_rec, float)
    return p["E"] + p["A"] * n_eff ** -p["alpha"] + p["B"] * np.asarray(tokens, float) ** -p["beta"]


def _arrays(runs: list[Run]):
    return (np.array([x.loss for x in runs], float), np.array([x.n_once for x in runs], float),
            np.array([x.n_rec for x in runs], float), np.array([x.r for x in runs], float),
            np.array([x.tokens for x in runs], float))


def _objective(theta, L, n_once, n_rec, r, D):
    e, a, alpha, b, beta, phi = theta
    log_neff = np.log(n_once + r ** phi * n_rec)
    terms = np.stack([np.full_like(L, e), a - alpha * log_neff, b - beta * np.log(D)])
    pred = np.logaddexp.reduce(terms, axis=0)  # log(E + A Neff^-alpha + B D^-beta)
    res = pred - np.log(L)
    small = np.abs(res) <= HUBER_DELTA
    return float(np.sum(np.where(small, 0.5 * res ** 2, HUBER_DELTA * (np.abs(res) - 0.5 * HUBER_DELTA))))


def _minimise(data, starts):
    from scipy.optimize import minimize

    bounds = [(None, None), (None, None), (0.0, 3.0), (None, None), (0.0, 3.0), PHI_BOUNDS]
    best = None
    for x0 in starts:
        res = minimize(_objective, np.asarray(x0, float), args=data, method="L-BFGS-B", bounds=bounds,
                       options={"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-12})
        if best is None or res.fun < best.fun:
            best = res
    return best


def initial_grid() -> list[tuple]:
    """Initialisations (e, a, alpha, b, beta, phi): a small grid over the exponents and phi, scales spread."""
    return list(itertools.product([0.0, 1.0], [5.0, 15.0], [0.2, 0.5], [5.0, 15.0], [0.2, 0.5], [0.2, 0.5, 0.9]))


def fit_phi(runs: list[Run], n_boot: int = 200, seed: int = 0, starts: list | None = None) -> PhiFit:
    """The law's best fit over ``runs`` and percentile 95% bootstrap intervals of every parameter."""
    if len(runs) < len(PARAMS) + 1:
        raise ValueError(f"{len(runs)} runs cannot pin {len(PARAMS)} parameters; fit at least {len(PARAMS) + 1} "
                         f"(recipes/sweeps/phi/ has 16)")
    if len({x.r for x in runs}) < 2:
        raise ValueError("every run has the same recurrence count r: phi is not identifiable; sweep r (e.g. 1, 2, 4, "
                         "8)")
    data = _arrays(runs)
    best = _minimise(data, starts or initial_grid())
    fit = PhiFit(_named(best.x), float(best.fun), len(runs))
    if n_boot:
        rng = np.random.default_rng(seed)
        draws = []
        for _ in range(n_boot):
            pick = rng.integers(0, len(runs), len(runs))
            sample = tuple(x[pick] for x in data)
            if len(set(sample[3])) < 2:
                continue
            draws.append(_minimise(sample, [best.x]).x)
        draws = np.array(draws)
        fit.n_boot = len(draws)
        for i, name in enumerate(PARAMS):
            v = np.exp(draws[:, i]) if name in ("E", "A", "B") else draws[:, i]
            fit.ci[name] = (float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5)))
    return fit


def _named(theta) -> dict:
    e, a, alpha, b, beta, phi = (float(v) for v in theta)
    return {"E": math.exp(e), "A": math.exp(a), "alpha": alpha, "B": math.exp(b), "beta": beta, "phi": phi}


def parameter_split(model_cfg, with_embeddings: bool = False) -> tuple[int, int]:
    """(N_once, N_rec) of a GRT or dense config: N_rec the looped module's parameters (``model.recur``: GRT's core,
    W_proj and gate, hyper-connections included), N_once the rest (a dense model: all, N_rec 0). Embeddings (token and
    position; the head is tied to the token embedding) are left out unless ``with_embeddings``: at toy widths the
    50,257-row embedding dwarfs the blocks and would leave phi unidentifiable (Kaplan et al.'s non-embedding
    convention); the abstract does not say which it counts."""
    from pipeline.model.registry import build_model
    from pipeline.model.registry import count_params

    if model_cfg.type not in ("grt", "gpt"):
        raise ValueError(f"model.type={model_cfg.type}: phi is fitted over looped GRT runs and dense (gpt) runs, where "
                         f"N_rec (the looped step, run r times) and N_once are defined; the other types loop other "
                         f"things (per-recursion LoRAs, routers, the whole stack) or sample their depth")
    model = build_model(model_cfg, device="meta")
    total = count_params(model)["params"]
    recur = model.recurrent_core()
    n_rec = 0 if recur is None else sum(p.numel() for p in recur.parameters())
    emb = 0 if with_embeddings else sum(p.numel() for p in model.embed.parameters())
    return total - n_rec - emb, n_rec


def runs_from_results(results: list[dict], with_embeddings: bool = False) -> list[Run]:
    """:class:`Run` rows from evaluated runs (``pipeline.eval.results.collect``): final validation loss at the trained
    depth, tokens trained, r = the trained recurrence count (1 for a dense model), N_once / N_rec from the run's
    recipe (:func:`parameter_split`)."""
    from pathlib import Path

    from pipeline.config import load_recipe

    rows = []
    for res in results:
        if res.get("val_loss") is None:
            raise ValueError(f"run {res['name']} has no validation loss; run `grt eval` on it first")
        ckpt = Path(res["checkpoint"])
        run_dir = next((p for p in (ckpt, *ckpt.parents) if (p / "recipe.yaml").is_file()), None)
        if run_dir is None:
            raise FileNotFoundError(f"no recipe.yaml above {ckpt} (run {res['name']}): phi needs the run's model shape")
        cfg = load_recipe(run_dir / "recipe.yaml", saved=True)
        if getattr(cfg.model, "depth_sampling", "fixed") != "fixed":
            raise ValueError(f"run {res['name']} trained with model.depth_sampling={cfg.model.depth_sampling} (r ~ "
                             f"U{{1..{cfg.model.n_recurrence}}}): phi's r is the recurrence count every step trained "
                             f"at; train the sweep with model.depth_sampling=fixed (recipes/sweeps/phi/ does)")
        n_once, n_rec = parameter_split(cfg.model, with_embeddings)
        r = cfg.model.n_recurrence if n_rec else 1  # n_rec > 0: a looped (GRT) model
        branch_of = f"{res['branch_parent']}@{res['branch_step']}" if res.get("branch_parent") else ""
        rows.append(Run(float(res["val_loss"]), n_once, n_rec, int(r), float(res["tokens_trained"]), res["name"],
                        branch_of))
    return rows


def plot_fit(fit: PhiFit, runs: list[Run], path) -> None:
    """Data and fitted law, one panel per recurrence count r: loss against tokens, one line per model size."""
    from pipeline.eval.analyses.plots import plt
    from pipeline.eval.analyses.plots import save_figure

    rs = sorted({x.r for x in runs})
    fig, axes = plt.subplots(1, len(rs), figsize=(4 * len(rs), 3.6), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], rs):
        mine = [x for x in runs if x.r == r]
        for size in sorted({(x.n_once, x.n_rec) for x in mine}):
            pts = sorted((x.tokens, x.loss) for x in mine if (x.n_once, x.n_rec) == size)
            line, = ax.plot([t for t, _ in pts], [l for _, l in pts], "o", label=f"{(size[0] + size[1]) / 1e6:.2f}M")
            grid = np.geomspace(pts[0][0], pts[-1][0], 50)
            ax.plot(grid, fit.predict(size[0], size[1], r, grid), "-", color=line.get_color())
        ax.set_xscale("log")
        ax.set_title(f"r = {r}")
        ax.set_xlabel("training tokens")
        ax.legend(fontsize=7, title="N_once + N_rec", title_fontsize=7)
    lo, hi = fit.ci.get("phi", (float("nan"), float("nan")))
    axes[0][0].set_ylabel("validation loss")
    fig.suptitle(f"phi = {fit.params['phi']:.3f} (95% CI {lo:.3f}-{hi:.3f}, {fit.n_boot} bootstrap fits); "
                 f"points: runs, lines: the fitted law")
    save_figure(fig, path)
