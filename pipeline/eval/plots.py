"""Plots a person would rather see than read: early-exit curves, one run or several overlaid."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_exit_curves(results: list[dict], path: str | Path, title: str = "Early exit") -> Path:
    """Left: loss vs exit (recurrence step r for GRT, layer for dense). Right: loss vs inference GFLOPs/token.

    Each result needs ``name``, ``type``, ``shorthand``, ``exit``, ``loss``, ``exit_flops``; ``trained_depth`` (R)
    is marked where present.
    """
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for res in results:
        label = f"{res['name']} ({res['shorthand']})"
        style = "o-" if res["type"] != "gpt" else "s--"
        line, = ax1.plot(res["exit"], res["loss"], style, label=label, markersize=4)
        ax2.plot([f / 1e9 for f in res["exit_flops"]], res["loss"], style, color=line.get_color(), label=label,
                 markersize=4)
        if res.get("trained_depth"):
            ax1.axvline(res["trained_depth"], color=line.get_color(), alpha=0.3, linestyle=":")
    ax1.set_xlabel("exit: recurrence step r (GRT) / layer (dense)")
    ax1.set_ylabel("validation loss (nats/token)")
    ax1.set_title(f"{title}: loss at each exit (dotted: trained R)")
    ax2.set_xlabel("inference GFLOPs per token at the exit (Eq. 1 + LM head)")
    ax2.set_ylabel("validation loss (nats/token)")
    ax2.set_title("loss vs inference compute")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
