"""Plots of the representation analyses (paper Appendix E.3-E.6, E.10; :mod:`pipeline.eval.analyses.representation`):
the CKA heatmaps of Figure 12 and one sheet of panels for Figures 11(b, c), 13/E.5, 14 and 18(b)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from pipeline.eval.analyses.plots import save_figure  # noqa: E402


def _step_label(r: int) -> str:
    return "r=0 (prelude)" if r == 0 else f"r={r}"


def _heatmap(fig, ax, matrix, annotate: bool):
    values = [[float("nan") if v is None else v for v in row] for row in matrix]
    im = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    if annotate:
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                if v is not None:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if v > 0.6 else "white")
    fig.colorbar(im, ax=ax, fraction=0.046, label="linear CKA")


def plot_cka(within: dict, cross: dict | None, path: str | Path) -> Path:
    """Figure 12: (a) within-model linear CKA between the states h^(r) of every pair of steps
    (:func:`~.representation.cka_matrix`'s dict); (b) when ``cross`` is given
    (:func:`~.representation.cross_cka`'s dict), CKA of each step against the dense baseline's residual
    state after each layer (0 = embedding), with each step's best-aligned layer marked."""
    fig, axes = plt.subplots(1, 2 if cross else 1, figsize=(13 if cross else 6.5, 5.2), squeeze=False)
    ax = axes[0, 0]
    steps = within["step"]
    _heatmap(fig, ax, within["cka"], annotate=len(steps) <= 13)
    labels = [_step_label(r) for r in steps]
    ax.set_xticks(range(len(steps)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(steps)), labels, fontsize=8)
    ax.set_xlabel("recurrence step")
    ax.set_ylabel("recurrence step")
    ax.set_title(f"within-model CKA of states h^(r)\n({within['tokens']:,} validation tokens)")
    if cross:
        ax = axes[0, 1]
        layers = cross["layer"]
        _heatmap(fig, ax, cross["cka"], annotate=len(layers) <= 16 and len(cross["step"]) <= 13)
        best = [(b, i) for i, b in enumerate(cross["best_layer"]) if b is not None]
        ax.plot([b for b, _ in best], [i for _, i in best], "r*", markersize=9, label="best layer per step")
        every = max(1, len(layers) // 24)
        ax.set_xticks(range(0, len(layers), every), ["emb" if l == 0 else str(l) for l in layers[::every]],
                      fontsize=8)
        ax.set_yticks(range(len(cross["step"])), [_step_label(r) for r in cross["step"]], fontsize=8)
        ax.set_xlabel("dense baseline: residual state after layer (emb = embedding)")
        ax.set_ylabel("recurrence step")
        ax.set_title(f"cross-model CKA: step states vs dense baseline layers\n({cross['tokens']:,} validation tokens)")
        ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, path, dpi=100)


def plot_representation(res: dict, path: str | Path) -> Path:
    """Panels for whatever ``res`` holds (keys as the analysis names of ``eval.analyses``):

    - ``similarity`` (:class:`~.representation.SuccessiveStates`'s result): the cosines per step and,
      on the right axis, the local step gain ||Δh^(r)|| / ||Δh^(r-1)|| (Figures 11(b, c), 14(b));
    - ``effective_rank`` (:func:`~.representation.effective_rank_by_step`): effective rank per step as a
      fraction of its maximum, and of the step deltas (dashed; Figure 14(a));
    - ``relative_improvement`` (:func:`~.representation.relative_improvement`, with ``bands``):
      Δ_rel per step, overall and per frequency band (Figure 18(b));
    - ``gate_difficulty`` (:func:`~.representation.gate_difficulty_by_step`): mean gate per r = 0 loss
      decile with the per-token least-squares line, R² in the title (Appendix E.5).
    ``name`` and ``val_tokens`` in ``res``, when present, go into the sheet's title."""
    panels = []
    sim = res.get("similarity")
    if sim:
        def similarity(ax):
            ax.plot(sim["step"], sim["cosine"], "o-", label="cos(h^(r), h^(r-1))")
            if sim.get("proposal_cosine"):
                ax.plot(sim["step"], sim["proposal_cosine"], "s-", label="cos(o^(r), h^(r-1)) proposal")
            ax.plot(*_defined(sim["step"], sim["delta_cosine"]), "^-", label="cos(Δh^(r), Δh^(r-1))")
            ax.set_ylabel("mean per-token cosine")
            ax.legend(fontsize=7, loc="lower left")
            twin = ax.twinx()
            twin.plot(*_defined(sim["step"], sim["delta_ratio"]), "d--", color="tab:red",
                      label="gain ||Δh^(r)|| / ||Δh^(r-1)||")
            twin.set_ylabel("local step gain (ratio)")
            twin.ticklabel_format(axis="y", useOffset=False)
            twin.legend(fontsize=7, loc="lower right")
            ax.set_title(f"successive states ({sim['tokens']:,} tokens)")
        panels.append(similarity)
    er = res.get("effective_rank")
    if er:
        def rank(ax):
            ax.plot(er["step"], er["effective_rank_fraction"], "o-", label="state h^(r)")
            if er["delta_step"]:
                ax.plot(er["delta_step"], er["delta_effective_rank_fraction"], "s--", label="update h^(r) - h^(r-1)")
            ax.set_ylabel(f"effective rank / {er['max_rank']} (max)")
            ax.set_title(f"effective rank, centred states ({er['tokens']:,} tokens)")
            ax.legend(fontsize=7)
        panels.append(rank)
    rel = res.get("relative_improvement")
    if rel:
        def relative(ax):
            ax.plot(rel["step"], [_pct(v) for v in rel["relative_improvement"]], "ko-", label="all tokens")
            for row in (rel.get("bands") or {}).values():
                if row["relative_improvement"]:
                    ax.plot(row["step"], [_pct(v) for v in row["relative_improvement"]], ".--",
                            label=f"{row['what']} (n={row['tokens']:,})")
            ax.set_ylabel("Δ_rel = (L_(r-1) - L_r) / L_(r-1)  (%)")
            ax.set_title("relative loss improvement per step")
            ax.legend(fontsize=7)
        panels.append(relative)
    gd = res.get("gate_difficulty")
    if gd and gd["all_steps"]["bins"]["loss_mean"]:
        def difficulty(ax):
            a = gd["all_steps"]
            b = a["bins"]
            ax.plot(b["loss_mean"], b["gate_mean"], "o", label="mean per r = 0 loss decile")
            if a["slope"] is not None:
                xs = [min(b["loss_mean"]), max(b["loss_mean"])]
                ax.plot(xs, [a["slope"] * x + a["intercept"] for x in xs], "-", color="tab:red",
                        label=f"per-token fit, slope {a['slope']:.3g}")
            ax.set_xlabel("loss at r = 0 (nats/token)")
            ax.set_ylabel("token's gate, mean over steps and features")
            r2 = "n/a" if a["r2"] is None else f"{a['r2']:.3f}"
            r = "n/a" if a["pearson_r"] is None else f"{a['pearson_r']:+.3f}"
            ax.set_title(f"gate vs difficulty: r = {r}, R² = {r2} ({a['tokens']:,} tokens)")
            ax.legend(fontsize=7)
        panels.append(difficulty)
    if not panels:
        raise ValueError("plot_representation: res has none of similarity, effective_rank, relative_improvement, "
                         "gate_difficulty; run those analyses (eval.analyses) first")
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        panel(ax)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)  # values near 1 (cosines, gates) read as themselves
        if not ax.get_xlabel():
            ax.set_xlabel("recurrence step r")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    where = f" on {res['val_tokens']:,} validation tokens" if res.get("val_tokens") else ""
    fig.suptitle(f"{res.get('name', 'model')}: representation analyses{where}, noise off")
    return save_figure(fig, path, dpi=100)


def _defined(xs, ys):
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _pct(v):
    return float("nan") if v is None else 100.0 * v  # a gap in the line


