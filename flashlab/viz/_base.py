"""Shared plumbing for the figures: style, PNG export, and interactive-or-static explorers."""
from __future__ import annotations

import io as _io
import itertools

import matplotlib.pyplot as plt
import numpy as np

from ..config import fast_mode

#: One color per algorithm, used by every figure so a learner can match curves across lessons.
COLORS = {"naive": "#d62728", "fa1": "#1f77b4", "fa2": "#2ca02c", "fa2_backward": "#9467bd",
          "memory": "#ff7f0e", "compute": "#7f7f7f"}
LABELS = {"naive": "naive (S, P in HBM)", "fa1": "FlashAttention-1", "fa2": "FlashAttention-2",
          "fa2_backward": "FA2 backward"}


def subplots(nrows=1, ncols=1, *, width=None, height=None, **kw):
    """plt.subplots with the course's default size: about 4.2 x 3.2 inches per panel."""
    width = width or min(4.2 * ncols, 13)
    height = height or 3.2 * nrows
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), **kw)
    return fig, axes


def own_axes(ax, **kw):
    """(fig, ax): the caller's axes, or a new single-panel figure."""
    if ax is not None:
        return ax.figure, ax
    return subplots(1, 1, **kw)


def to_png(fig, dpi=80) -> bytes:
    """Render a figure to PNG bytes (what a notebook would show); raises if drawing fails."""
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def human_bytes(n) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"  # pragma: no cover


def relative_luminance(rgba) -> float:
    """WCAG 2 relative luminance of an sRGB colour (components in 0..1): 0 for black, 1 for white."""
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def text_color_on(rgba) -> str:
    """"black" or "white", whichever contrasts more with a background of colour `rgba` (WCAG contrast ratio
    (L1 + 0.05) / (L2 + 0.05)); labels stay readable on every cell of a colour map."""
    lum = relative_luminance(rgba)
    return "black" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "white"


def widgets_available() -> bool:
    """True inside a Jupyter/Colab kernel with ipywidgets importable."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None or not hasattr(shell, "kernel"):
            return False
        import ipywidgets  # noqa: F401
    except Exception:
        return False
    return True


def use_widgets(interactive=None) -> bool:
    """Decide between sliders and a static grid: sliders only in a live kernel and outside the fast mode."""
    if interactive is not None:
        return bool(interactive) and widgets_available()
    return widgets_available() and not fast_mode()


def _is_switch(options) -> bool:
    opts = list(options)
    return len(opts) == 2 and all(isinstance(o, (bool, np.bool_)) for o in opts) and set(opts) == {False, True}


def explore(draw, controls: dict, grid: dict, *, fixed=None, interactive=None, ncols=None, title=None):
    """Show `draw(**params)` with sliders, or a static grid of small plots.

    draw(ax=None, **params) -> Figure draws one panel when given `ax` and its full view otherwise.
    controls: {name: (options, default)}: a slider for each (ipywidgets SelectionSlider, common to 7.7 and 8),
    or a checkbox (ipywidgets Checkbox) when the options are (False, True).
    grid: {name: options} for at most two names: the static fallback draws every combination, one row per
    value of the first name. Parameters missing from `grid` take their slider default (or `fixed`).
    Returns the ipywidgets interact object, or the grid Figure.
    """
    fixed = dict(fixed or {})
    defaults = {name: default for name, (opts, default) in controls.items()}
    if use_widgets(interactive):
        import ipywidgets as widgets

        def control(name, opts, default):
            if _is_switch(opts):  # an on/off choice is a checkbox, not a two-stop slider
                return widgets.Checkbox(value=bool(default), description=name)
            return widgets.SelectionSlider(options=list(opts), value=default, description=name,
                                           continuous_update=False)

        sliders = {name: control(name, opts, default) for name, (opts, default) in controls.items()}

        def show(**params):
            draw(**fixed, **params)
            plt.show()

        return widgets.interact(show, **sliders)

    names = list(grid)
    rows = grid[names[0]] if names else [None]
    cols = grid[names[1]] if len(names) > 1 else [None]
    ncols = ncols or len(cols)
    fig, axes = subplots(len(rows), ncols, width=min(3.4 * ncols, 13), height=2.8 * len(rows), squeeze=False)
    for (r, rv), (c, cv) in itertools.product(enumerate(rows), enumerate(cols)):
        params = {**defaults, **fixed}
        if names:
            params[names[0]] = rv
        if len(names) > 1:
            params[names[1]] = cv
        draw(ax=axes[r][c], **params)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
