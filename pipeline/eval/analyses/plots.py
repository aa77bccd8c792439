"""Plots a person would rather see than read: early-exit curves, one run or several overlaid."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipeline.model import exits_are_layers  # noqa: E402


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """tight_layout, write the PNG (creating its folder) and close the figure: every plot of ``grt eval``."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_exit_curves(results: list[dict], path: str | Path, title: str = "Early exit") -> Path:
    """Left: loss vs exit (recurrence step / recursion / loop for a recurrent model, layer for dense). Right: loss
    vs inference GFLOPs/token.

    Each result needs ``name``, ``type``, ``shorthand``, ``exit``, ``loss``, ``exit_flops``; ``trained_depth`` (R)
    is marked where present.
    """
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for res in results:
        label = f"{res['name']} ({res['shorthand']})"
        style = "s--" if exits_are_layers(res["type"]) else "o-"
        line, = ax1.plot(res["exit"], res["loss"], style, label=label, markersize=4)
        ax2.plot([f / 1e9 for f in res["exit_flops"]], res["loss"], style, color=line.get_color(), label=label,
                 markersize=4)
        if res.get("trained_depth"):
            ax1.axvline(res["trained_depth"], color=line.get_color(), alpha=0.3, linestyle=":")
    ax1.set_xlabel("exit: recurrence step r (recurrent) / layer (dense)")
    ax1.set_ylabel("validation loss (nats/token)")
    ax1.set_title(f"{title}: loss at each exit (dotted: trained R)")
    ax2.set_xlabel("inference GFLOPs per token at the exit (Eq. 1 + LM head)")
    ax2.set_ylabel("validation loss (nats/token)")
    ax2.set_title("loss vs inference compute")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_diagnostics(res: dict, path: str | Path) -> Path:
    """Panels of whatever ``res`` holds: agreement with the reference exit (KL, top-1), gate mean/std and saturation,
    openness rho and fixed-point ratio, proposal/update norms, loss per token-frequency band, improvement per
    difficulty decile."""
    diag = res.get("diagnostics", {})
    steps = diag.get("steps", {})
    panels = []

    def agreement(ax):
        ax.plot(res["exit"], res["kl"], "o-", label="KL(p_r || p_ref)")
        ax.set_ylabel("KL (nats/token)")
        ax2 = ax.twinx()
        ax2.plot(res["exit"], res["top1"], "s--", color="tab:orange", label="top-1 agreement")
        ax2.set_ylabel("top-1 agreement")
        ax2.set_ylim(0, 1.02)
        ax.set_title(f"agreement with exit {res['ref_exit']}")
        ax.legend(loc="center left", fontsize=8)
        ax2.legend(loc="center right", fontsize=8)
    panels.append(agreement)
    if steps.get("gate_mean"):
        def gate(ax):
            m, s = steps["gate_mean"], steps["gate_std"]
            ax.errorbar(steps["step"], m, yerr=s, fmt="o-", capsize=3, label="gate mean ± std")
            ax.plot(steps["step"], steps["gate_frac_above_095"], "^:", label="fraction g > 0.95")
            ax.plot(steps["step"], steps["gate_frac_below_005"], "v:", label="fraction g < 0.05")
            ax.set_title("gate per step (1 = copy, 0 = write)")
            ax.legend(fontsize=8)
        panels.append(gate)
    if steps.get("rho"):
        def openness(ax):
            ax.plot(steps["step"], steps["rho"], "o-", linewidth=2, label="openness ρ, Eq. 3: |Δh|_F / |o - h|_F")
            if steps.get("update_over_proposal"):
                ax.plot(steps["step"], steps["update_over_proposal"], "^--",
                        label="mean |Δh| / mean |o| (the paper's printed ρ)")
            ax.plot(steps["step"], steps["delta_fp"], "s-", label="fixed-point ratio δ_fp (Eq. 4)")
            ax.set_title("update size per step")
            ax.legend(fontsize=8)

        def norms(ax):
            ax.plot(steps["step"], steps["proposal_norm"], "o-", label="|o| proposal")
            ax.plot(steps["step"], steps["update_norm"], "s-", label="|h_r - h_(r-1)| applied update")
            ax.set_title("mean per-token L2 norms")
            ax.legend(fontsize=8)
        panels += [openness, norms]
    if diag.get("bands"):
        def bands(ax):
            b = diag["bands"]
            for name, row in b["bands"].items():
                if row["loss"]:
                    ax.plot(b["exit"], row["loss"], "o-", markersize=3, label=f"{row['what']} (n={row['tokens']:,})")
            ax.set_title("loss by target-token frequency band")
            ax.legend(fontsize=7)
        panels.append(bands)
    if diag.get("deciles"):
        def deciles(ax):
            d = diag["deciles"]
            to = d.get("to_exit", d["exit"][-1])
            ax.bar(range(1, 11), d["improvement"], label=f"exit {d['by_exit']} -> {to}")
            if d.get("improvement_to_last") and d.get("last_exit", to) != to:
                ax.bar(range(1, 11), d["improvement_to_last"], fill=False, edgecolor="tab:red",
                       label=f"exit {d['by_exit']} -> {d['last_exit']}")
                ax.legend(fontsize=8)
            r2 = d.get("improvement_r2")
            ax.set_title("loss improvement by difficulty decile" + (f" (R² {r2:.3f} vs initial loss)" if r2 is not None
                                                                   else ""))
            ax.set_ylabel("nats/token")
            ax.set_xlabel(f"decile of loss at exit {d['by_exit']} (1 = easiest)")
        panels.append(deciles)
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        panel(ax)
        ax.grid(alpha=0.3)
        if panel.__name__ not in ("deciles",):
            ax.set_xlabel(ax.get_xlabel() or "exit: recurrence step r / layer")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{res['name']} ({res['shorthand']}): diagnostics on {res['val_tokens']:,} validation tokens")
    return save_figure(fig, path, dpi=100)


def plot_gate_heatmaps(maps: list[dict], path: str | Path) -> Path:
    """Per-token gate mean (over features) at each recurrence step for a few prompts (the paper's Figure 8)."""
    fig, axes = plt.subplots(len(maps), 1, figsize=(max(6, 0.7 * max(len(m["tokens"]) for m in maps)),
                                                      1.2 + 0.45 * len(maps[0]["gate"]) * len(maps)), squeeze=False)
    for ax, m in zip(axes.flat, maps):
        im = ax.imshow(m["gate"], aspect="auto", cmap="viridis", vmin=min(min(r) for r in m["gate"]),
                       vmax=max(max(r) for r in m["gate"]))
        ax.set_xticks(range(len(m["tokens"])), [repr(t)[1:-1] for t in m["tokens"]], rotation=45, ha="right",
                      fontsize=8)
        ax.set_yticks(range(len(m["gate"])), [f"r={i + 1}" for i in range(len(m["gate"]))], fontsize=7)
        fig.colorbar(im, ax=ax, fraction=0.03, label="mean g")
    fig.suptitle("gate per token and step (bright: copy, dark: write)")
    return save_figure(fig, path, dpi=100)
