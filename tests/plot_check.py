"""What a plot drew, read back from its matplotlib figure and its PNG, for tests that compare it with the data the
plot was given (a PNG header alone passes a plot that draws nothing)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def capture_figures(monkeypatch) -> list:
    """Every figure saved from now on, kept (artists intact) after the plot closes it."""
    from matplotlib.figure import Figure

    saved, real = [], Figure.savefig

    def savefig(fig, *args, **kwargs):
        saved.append(fig)
        return real(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def drawn(fig) -> list[np.ndarray]:
    """Each line's y values, each image's array and each bar() call's heights, over every axes of ``fig``."""
    out = []
    for ax in fig.axes:
        out += [np.asarray(line.get_ydata(), dtype=float) for line in ax.lines]
        out += [np.ma.filled(np.ma.asarray(im.get_array(), dtype=float), np.nan) for im in ax.images]
        out += [np.array([bar.get_height() for bar in c], dtype=float) for c in ax.containers]
    return out


def texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)


def assert_drawn(fig, *series, what: str = "") -> None:
    """Each expected series (None -> NaN) is, value for value, one of the arrays the figure drew."""
    def nan(s):
        return [nan(v) if isinstance(v, (list, tuple)) else math.nan if v is None else v for v in s]

    arrays = drawn(fig)
    for s in series:
        want = np.asarray(s, dtype=float) if isinstance(s, np.ndarray) else np.array(nan(s), dtype=float)
        assert any(a.shape == want.shape and np.allclose(a, want, rtol=1e-6, atol=1e-9, equal_nan=True)
                   for a in arrays), f"{what}: {want.tolist()} is not among the drawn {[a.tolist() for a in arrays]}"


def assert_png_of(fig, path: Path, dpi: int) -> None:
    """The file decodes as a PNG of the figure's size at ``dpi``, and is not one flat colour."""
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG", path
        w, h = fig.get_size_inches() * dpi
        assert im.size == (round(w), round(h)), (path, im.size, (w, h))
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 24)) > 2, path
