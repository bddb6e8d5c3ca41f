"""Lesson 13's training comparison: loss curves of one GPT on several attentions, their gap, and tokens/s.

plot_bf16_run draws a record of flashlab.gpt.compare_attention (or the committed flashlab/data/gpt_bf16.json,
loaded with flashlab.gpt.load_bf16_run). It imports flashlab.gpt, hence torch, only when called.
"""
from __future__ import annotations

import math

import numpy as np

from ._base import subplots

_COLORS = {"torch": "#1f77b4", "flashlab": "#2ca02c", "torch_again": "#7f7f7f"}
_OTHER = ("#d62728", "#9467bd", "#ff7f0e", "#8c564b")


def _color(name, i):
    return _COLORS.get(name, _OTHER[i % len(_OTHER)])


def plot_bf16_run(record: dict, tolerance: float | None = None, window: int | None = None, speed: bool = True):
    """Loss of every run (faint: each step; bold: the moving average), the moving average of each run's loss
    minus the "torch" run's with the band +-tolerance, and (speed=True) tokens/s per run. Returns the Figure."""
    from ..gpt import BF16_LOSS_TOLERANCE, BF16_LOSS_WINDOW, moving_average

    tolerance = BF16_LOSS_TOLERANCE if tolerance is None else tolerance
    window = BF16_LOSS_WINDOW if window is None else window
    runs = record["runs"]
    if "torch" not in runs:
        raise ValueError(f"record['runs'] needs a 'torch' run to compare with; got {sorted(runs)}")
    fig, axes = subplots(1, 3 if speed else 2, width=13 if speed else 9.5, height=3.4)
    ax_loss, ax_gap = axes[0], axes[1]
    x_avg = np.arange(window - 1, record["training"]["steps"])  # the average of steps i-window+1 .. i sits at i
    base = np.array(runs["torch"]["losses"])
    for i, (name, run) in enumerate(runs.items()):
        losses, color = np.array(run["losses"]), _color(name, i)
        if name != "torch_again":  # it would hide under torch's curve
            ax_loss.plot(losses, color=color, alpha=0.25, lw=0.7)
            ax_loss.plot(x_avg, moving_average(losses, window), color=color, lw=1.6,
                         ls="-" if name == "torch" else "--", label=run["label"])
        if name != "torch":
            ax_gap.plot(x_avg, moving_average(losses - base, window), color=color, lw=1.4, label=run["label"])
    vocab = record["config"]["vocab_size"]
    ax_loss.axhline(math.log(vocab), color="gray", lw=0.8, ls=":", label="uniform guess: log(vocab)")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats)", title=f"Training loss ({record['dtype']})")
    ax_loss.legend(fontsize=7)
    ax_gap.axhspan(-tolerance, tolerance, color="#2ca02c", alpha=0.12, label=f"tolerance ±{tolerance:g}")
    ax_gap.axhline(0, color="black", lw=0.6)
    lim = max(2 * tolerance, *(abs(v) for name, r in runs.items() if name != "torch"
                               for v in moving_average(np.array(r["losses"]) - base, window)))
    ax_gap.set(ylim=(-1.1 * lim, 1.1 * lim), xlabel="step", ylabel="nats",
               title=f"Loss minus torch SDPA's, {window}-step average")
    ax_gap.legend(fontsize=7)
    if speed:
        ax = axes[2]
        names = list(runs)
        values = [runs[n]["tokens_per_s"] for n in names]
        bars = ax.bar(range(len(names)), values, color=[_color(n, i) for i, n in enumerate(names)])
        for bar, v in zip(bars, values):
            ax.annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), [runs[n]["label"] for n in names], fontsize=7)
        ax.yaxis.set_major_formatter(lambda v, _: f"{v:,.0f}")
        ax.set(ylabel="tokens / s", title=f"Training speed (after {record['training']['warmup']} warm-up steps)")
        ax.set_ylim(0, 1.15 * max(values))
    cfg = record["config"]
    where = record.get("gpu") or record.get("device", "")
    heads = f"{cfg['n_head']} head{'s' if cfg['n_head'] > 1 else ''}"
    fig.suptitle(f"{where}: GPT of {cfg['n_layer']} layers, d_model {cfg['n_embd']}, {heads} of "
                 f"d = {cfg['head_dim']}, N = {cfg['block_size']}, batch {record['training']['batch_size']}",
                 fontsize=10)
    fig.tight_layout()
    return fig
