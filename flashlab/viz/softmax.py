"""Figures for lesson 03: overflow, the online softmax's running statistics, merging partial states, and the
step-by-step online softmax explorer."""
from __future__ import annotations

import numpy as np

from ..softmax import merge_softmax_states, online_softmax_stats, safe_softmax
from ._base import explore, own_axes, subplots


def plot_overflow(ax=None):
    """exp(x) in float16, float32 and float64: where each one becomes inf."""
    fig, ax = own_axes(ax, width=6, height=3.2)
    for dtype, color, lw in ((np.float16, "#d62728", 7), (np.float32, "#1f77b4", 4), (np.float64, "#2ca02c", 1.5)):
        limit = float(np.log(np.finfo(dtype).max))
        x = np.linspace(0, 120, 1201)
        with np.errstate(over="ignore"):
            y = np.exp(x.astype(dtype)).astype(np.float64)
        finite = np.isfinite(y)
        ax.plot(x[finite], y[finite], color=color, lw=lw, alpha=0.8,
                label=f"{np.dtype(dtype).name}: inf beyond x ≈ {limit:.1f}")
        if limit < x[-1]:
            ax.axvline(limit, color=color, ls=":", lw=1)
            ax.plot([limit], [np.exp(limit)], "X", color=color, ms=10)
            ax.annotate(" → inf", (limit, np.exp(limit)), color=color, fontsize=9, va="bottom")
    ax.set_yscale("log")
    ax.set_xlabel("x")
    ax.set_ylabel("exp(x)")
    ax.set_title("exp overflows: float16 at ≈11.1, float32 at ≈88.7")
    ax.legend(fontsize=8)
    return fig


def online_softmax_trace(x):
    """Stream a 1-D x one element at a time through merge_softmax_states, recording the running state.

    Returns a dict of arrays of length len(x): m (running max), l (running sum after the element),
    l_rescaled (the previous sum after rescaling to the new max, before adding the element), and alpha
    (the rescale factor exp(m_old - m_new); 1 where the max did not change).
    """
    x = np.asarray(x, dtype=np.float64)
    m, l = -np.inf, 0.0
    out = {k: np.empty(len(x)) for k in ("m", "l", "l_rescaled", "alpha")}
    for j, xj in enumerate(x):
        m_new, l_new = merge_softmax_states(m, l, xj, 1.0)  # a single element is the state (x_j, 1)
        alpha = 1.0 if j == 0 else float(np.exp(m - m_new))
        out["m"][j], out["l"][j], out["alpha"][j], out["l_rescaled"][j] = m_new, l_new, alpha, l * alpha
        m, l = m_new, l_new
    return out


def plot_online_softmax(x):
    """Two panels: the stream x_j with its running max m_j; the running sum l_j, rescaled when m_j grows."""
    x = np.asarray(x, dtype=np.float64)
    t = online_softmax_trace(x)
    j = np.arange(len(x))
    jumps = np.flatnonzero(t["alpha"] < 1)
    fig, (a, b) = subplots(2, 1, width=7.5, height=5.2, sharex=True)
    a.bar(j, x, width=0.9, align="edge", color="#c6dbef", edgecolor="#6baed6", label="$x_j$ (arrives left to right)")
    a.step(np.append(j, len(x)), np.append(t["m"], t["m"][-1]), where="post", color="#d62728", lw=2, label="running max $m_j$")
    a.plot(jumps, t["m"][jumps], "v", color="#d62728")
    a.set_ylabel("value")
    a.legend(fontsize=8, loc="lower right")
    a.set_title("Online softmax: one pass keeps the running max m and the running sum l")

    b.step(np.append(j, len(x)), np.append(t["l"], t["l"][-1]), where="post", color="#2ca02c", lw=2, label=r"running sum $l_j=\sum_{i\leq j} e^{x_i-m_j}$")
    for k in jumps:  # the sum so far is multiplied by exp(m_old - m_new) < 1, then the new term is added
        b.annotate("", xy=(k, t["l_rescaled"][k]), xytext=(k, t["l"][k - 1]),
                   arrowprops=dict(arrowstyle="-|>", color="#d62728", lw=1.8))
        b.text(k + 0.12, (t["l"][k - 1] + t["l_rescaled"][k]) / 2, f"×{t['alpha'][k]:.2f}", color="#d62728",
               fontsize=8, va="center")
    b.plot([], [], color="#d62728", label=r"rescale by $e^{m_{old}-m_{new}}$ when the max grows")
    b.set_ylim(0, t["l"].max() * 1.1)
    b.set_xlabel("position j in the row")
    b.set_ylabel("running sum")
    b.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_merge(x, bounds):
    """x split at `bounds` into chunks: each chunk's own (m, l), and the merged state against the full row."""
    x = np.asarray(x, dtype=np.float64)
    edges = [0, *bounds, len(x)]
    fig, ax = subplots(1, 1, width=7.5, height=3.4)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b"]
    m, l = -np.inf, 0.0
    for c, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        chunk = x[lo:hi]
        m_c, l_c = online_softmax_stats(chunk)
        m, l = merge_softmax_states(m, l, m_c, l_c)
        col = colors[c % len(colors)]
        ax.bar(np.arange(lo, hi), chunk, color=col, alpha=0.55)
        ax.hlines(m_c, lo - 0.4, hi - 0.6, color=col, lw=2)
        ax.text((lo + hi - 1) / 2, m_c, f"m={float(m_c):.2f}\nl={float(l_c):.2f}", ha="center", va="bottom",
                fontsize=8, color=col)
    m_full, l_full = online_softmax_stats(x)
    ax.axhline(float(m), color="black", ls="--", lw=1)
    ax.set_title(f"merged: m={float(m):.3f}, l={float(l):.3f}   ·   whole row: m={float(m_full):.3f}, "
                 f"l={float(l_full):.3f}", fontsize=10)
    ax.set_xlabel("position j")
    ax.set_ylabel("$x_j$")
    ax.set_ylim(min(0, x.min()) - 0.5, x.max() * 1.35 + 0.5)
    fig.tight_layout()
    return fig


# --- explorer -----------------------------------------------------------------------------------------

PREFIX_LABEL = "softmax of $x_0..x_j$ (normalised now)"
FINAL_LABEL = "final safe softmax"


def _plot_step_probs(ax, x, t, j, compact=False):
    """Bars: the softmax of the prefix seen so far, e^(x_i - m_j) / l_j, against the final safe softmax."""
    pos = np.arange(len(x))
    ax.bar(pos, safe_softmax(x), width=0.8, fill=False, edgecolor="black", ls="--", lw=1, label=FINAL_LABEL)
    prefix = np.exp(x[: j + 1] - t["m"][j]) / t["l"][j]
    colors = ["#6baed6"] * j + ["#ff7f0e"]
    ax.bar(pos[: j + 1], prefix, width=0.8, color=colors, alpha=0.85, label=PREFIX_LABEL)
    ax.set_xticks(pos)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("position i in the row")
    ax.set_ylabel("probability")
    alpha = t["alpha"][j]
    rescale = f", rescale ×{alpha:.2f}" if alpha < 1 else ""
    ax.set_title(f"j = {j}: m = {t['m'][j]:.2f}, l = {t['l'][j]:.3f}{rescale}", fontsize=9 if compact else 10,
                 color="#d62728" if alpha < 1 else "black")
    if not compact:
        ax.legend(fontsize=8, loc="upper left")


def _step_text(x, t, j):
    """The arithmetic of step j, with numbers."""
    if j == 0:
        return f"start from (m, l) = (−∞, 0)\nm = x₀ = {x[0]:.2f},  l = e^(x₀ − m) = 1"
    m_old, l_old, m, l = t["m"][j - 1], t["l"][j - 1], t["m"][j], t["l"][j]
    return (f"m = max({m_old:.2f}, x_j = {x[j]:.2f}) = {m:.2f}\n"
            f"l = {l_old:.3f} × e^({m_old:.2f} − {m:.2f}) + e^({x[j]:.2f} − {m:.2f})\n"
            f"  = {l_old:.3f} × {t['alpha'][j]:.3f} + {np.exp(x[j] - m):.3f} = {l:.3f}")


def _draw_online_step(ax=None, x=(), j=0):
    x = np.asarray(x, dtype=np.float64)
    t = online_softmax_trace(x)
    if ax is not None:
        _plot_step_probs(ax, x, t, j, compact=True)
        return ax.figure
    fig, (a, b) = subplots(2, 1, width=8, height=6.2)
    pos = np.arange(len(x))
    colors = ["#6baed6"] * j + ["#ff7f0e"] + ["#eeeeee"] * (len(x) - j - 1)
    a.bar(pos, x, width=0.8, color=colors, edgecolor="#999999")
    a.step(np.arange(j + 2) - 0.5, np.append(t["m"][: j + 1], t["m"][j]), where="post", color="#d62728", lw=2,
           label="running max $m$")
    a.axhline(x.max(), color="#d62728", ls=":", lw=1, label=f"final max = {x.max():.2f}")
    a.text(0.01, 0.97, _step_text(x, t, j), transform=a.transAxes, va="top", fontsize=8, family="monospace",
           bbox=dict(boxstyle="round", fc="white", ec="#d62728" if t["alpha"][j] < 1 else "#999999"))
    a.set_xticks(pos)
    a.set_ylim(min(0, x.min()) - 0.3, x.max() + (x.max() - min(0, x.min())) * 0.9 + 0.3)
    a.set_ylabel("$x_i$")
    a.set_title(f"step j = {j}: seen (blue), new (orange), not yet read (grey)", fontsize=10)
    a.legend(fontsize=8, loc="upper right")
    _plot_step_probs(b, x, t, j)
    fig.tight_layout()
    return fig


def online_softmax_explorer(x, interactive=None):
    """Lesson 03: a slider walks the online softmax along the row x one element at a time, showing the running
    max m, the running sum l, the rescale factor exp(m_old - m_new) when the max grows, and the softmax of the
    prefix against the final one. Static fallback: four steps side by side."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or len(x) < 2 or not np.isfinite(x).all():
        raise ValueError(f"x must be a 1-D row of at least 2 finite numbers; got shape {x.shape}")
    steps = list(range(len(x)))
    jumps = [int(k) for k in np.flatnonzero(online_softmax_trace(x)["alpha"] < 1)]
    shown = sorted({0, *jumps[-2:], len(x) - 1})  # the start, the last two rescales, the end
    # One grid row: the grid's first name is the (fixed) row itself, its second the steps shown.
    return explore(_draw_online_step, {"j": (steps, jumps[0] if jumps else 0)}, {"x": [x], "j": shown},
                   fixed={"x": x}, interactive=interactive,
                   title="Online softmax, step by step (red title: the max grew and l was rescaled)")
