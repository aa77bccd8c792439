"""Figures of the mechanism analyses (:mod:`pipeline.eval.analyses.mechanism`): gate attribution (paper Figure 15),
W_proj spectra (Figure 16), attention entropy per head and step (Figure 17) and next-token traces (Figure 4)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pipeline.eval.analyses.plots import save_figure  # noqa: E402


def plot_gate_attribution(res: dict, path: str | Path) -> Path:
    """(a) share of f_g's first-layer pre-activation variance from the state vs the anchor half per step; (b)
    x-dominance and sign agreement; (c) singular values of W1_x, W1_a and fc2 when ``res`` has ``spectra``
    (the ``gate_attribution`` entry of :func:`pipeline.eval.analyses.suite.traced_pass`)."""
    spectra = res.get("spectra")
    fig, axes = plt.subplots(1, 3 if spectra else 2, figsize=(15 if spectra else 10, 4))
    steps = np.array(res["step"])
    sx = np.array([v if v is not None else np.nan for v in res["state_var_frac"]])
    ax = axes[0]
    ax.bar(steps, sx, color="tab:blue", label="state  W1_x LN(h^(r-1))")
    ax.bar(steps, 1 - sx, bottom=sx, color="tab:orange", label="anchor  W1_a LN(h_pre) + b1")
    for r, v in zip(steps, sx):
        if np.isfinite(v):
            ax.text(r, v / 2, f"{v:.0%}", ha="center", va="center", fontsize=8, color="white")
    ax.set_ylim(0, 1)
    ax.set_xlabel("recurrence step r")
    ax.set_ylabel("share of first-layer pre-activation variance")
    ax.set_title("(a) gate attribution (E.7)")
    ax.legend(fontsize=8, loc="lower right")
    ax = axes[1]
    ax.plot(steps, res["x_dominance"], "o-", label="x-dominance: ||a_x|| > ||a_h|| (positions)")
    ax.plot(steps, res["sign_agreement"], "s--", label="sign agreement a_x a_h > 0 (units)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("recurrence step r")
    ax.set_ylabel("fraction")
    ax.set_title("(b) token-level attribution")
    ax.legend(fontsize=8)
    if spectra:
        ax = axes[2]
        for name, label in (("W1_x", "W1_x (state)"), ("W1_a", "W1_a (anchor)"), ("fc2", "fc2")):
            s = spectra[name]
            ax.plot(np.arange(1, len(s) + 1), s, label=f"{label}, s1 = {s[0]:.2f}")
        ax.set_yscale("log")
        ax.set_xlabel("singular value index")
        ax.set_ylabel("singular value")
        ax.set_title("(c) gate weight spectra")
        ax.legend(fontsize=8)
    for ax in axes[:2]:
        ax.set_xticks(steps)
    for ax in axes:
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_projection(res: dict, path: str | Path) -> Path:
    """(a) singular values and (b) cumulative energy of W_proj's state and anchor halves; (c) Frobenius norms of
    all present halves (W_proj and f_g's first layer). Absent parts are named in the panel."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    proj = res.get("proj")
    if proj:
        for half, label in (("W_x", "W_x (state)"), ("W_h", "W_h (anchor)")):
            st = proj[half]
            k = np.arange(1, len(st["singular_values"]) + 1)
            axes[0].plot(k, st["singular_values"], label=f"{label}: eff. rank {st['effective_rank']:.1f}")
            axes[1].plot(k, st["cumulative_energy"], label=f"{label}: 90% at {st['energy_dim_90']}")
        axes[0].set_title(f"(a) W_proj spectra, mean row cosine {proj['row_cosine']['mean']:+.3f}")
        axes[1].axhline(0.9, color="grey", linestyle=":")
        for ax in axes[:2]:
            ax.legend(fontsize=8)
    else:
        for ax in axes[:2]:
            ax.text(0.5, 0.5, res.get("absent", {}).get("proj", "no W_proj"), ha="center", va="center",
                    transform=ax.transAxes, fontsize=9)
        axes[0].set_title("(a) W_proj spectra")
    axes[0].set_xlabel("singular value index")
    axes[0].set_ylabel("singular value")
    axes[1].set_title("(b) cumulative energy")
    axes[1].set_xlabel("number of singular values k")
    axes[1].set_ylabel("sum_{i<=k} s_i^2 / sum s^2")
    frob = res.get("frobenius", {})
    colors = ["tab:blue" if k.endswith("W_x") else "tab:orange" for k in frob]
    axes[2].bar(list(frob), list(frob.values()), color=colors)
    missing = list(res.get("absent", {}).values())
    if missing:
        axes[2].text(0.5, 0.5, "\n".join(missing), ha="center", va="center", transform=axes[2].transAxes, fontsize=8)
    axes[2].set_title("(c) Frobenius norms (blue: state, orange: anchor)")
    axes[2].set_ylabel("||W||_F")
    axes[2].tick_params(axis="x", labelsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_attention(res: dict, path: str | Path) -> Path:
    """(a) entropy heatmap, steps x heads (all core blocks, white lines between blocks); (b) per-step mean entropy
    and diagonal mass; (c) head classes (stats averaged over steps)."""
    n_core, n_head = res["n_core"], res["n_head"]
    ent = np.array(res["entropy"]).reshape(len(res["step"]), n_core * n_head)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    ax = axes[0]
    im = ax.imshow(ent, aspect="auto", cmap="viridis", interpolation="nearest",
                   extent=(-0.5, n_core * n_head - 0.5, res["step"][-1] + 0.5, res["step"][0] - 0.5))
    for b in range(1, n_core):
        ax.axvline(b * n_head - 0.5, color="white", linewidth=1.5)
    ax.set_xlabel(f"head (block-major: block b, head h -> b x {n_head} + h)")
    ax.set_yticks(res["step"])
    ax.set_ylabel("recurrence step r")
    ax.set_title("(a) attention entropy per head (nats, rows t >= 1)")
    fig.colorbar(im, ax=ax, label="entropy (nats)")
    ax = axes[1]
    ax.plot(res["step"], res["mean_entropy"], "o-", color="tab:blue", label="mean entropy")
    ax.set_xlabel("recurrence step r")
    ax.set_ylabel("mean entropy (nats)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(res["step"], res["mean_diag_mass"], "s--", color="tab:orange", label="mean diagonal mass")
    ax2.set_ylabel("mean diagonal mass", color="tab:orange")
    ax.set_xticks(res["step"])
    ax.set_title("(b) per-step means over all heads")
    ax.grid(alpha=0.3)
    ax = axes[2]
    counts = res["class_counts"]
    ax.bar(list(counts), list(counts.values()), color="tab:green")
    for i, v in enumerate(counts.values()):
        ax.text(i, v, str(v), ha="center", va="bottom", fontsize=9)
    ax.set_title(f"(c) head classes ({res['stable_heads']}/{n_core * n_head} stable over steps)")
    ax.set_ylabel("heads")
    ax.tick_params(axis="x", labelsize=8, rotation=20)
    return save_figure(fig, path)


def plot_traces(traces: list[dict], path: str | Path, max_candidates: int = 6) -> Path:
    """One row per prompt: the probability of its top candidates (rows, by probability at the last exit) at every
    exit (columns, prelude-only first where the model has it), printed in each cell, as in Figure 4."""
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.2 + 0.35 * max_candidates * len(traces)), squeeze=False)
    for ax, tr in zip(axes[:, 0], traces):
        cands = tr["candidates"][:max_candidates]
        probs = np.array([c["prob"] for c in cands])
        ax.imshow(probs, aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
        for i in range(probs.shape[0]):
            for j in range(probs.shape[1]):
                ax.text(j, i, f"{probs[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if probs[i, j] > 0.5 else "black")
        ax.set_yticks(range(len(cands)), [ascii(c["token"]) for c in cands], fontsize=8)  # ascii: any glyph prints
        ax.set_xticks(range(len(tr["exit"])), [f"r={r}" + (" (prelude)" if r == 0 else "") for r in tr["exit"]],
                      fontsize=8)
        ax.set_title(f"{tr['prompt']!r} -> p(next token) per exit; argmax at the last: "
                     f"{tr['argmax'][-1]['token']!a}", fontsize=9)
    return save_figure(fig, path)
