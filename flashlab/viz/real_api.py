"""Figures of lesson 18 (the FlashAttention library's options), one function per figure.

Every picture is computed from flashlab's own semantics (reference.attention_mask, reference.alibi_bias,
dropout.keep_scale, the cu_seqlens and block_table layouts), never redrawn from a description; the varlen
timings come from benchmarks/results/varlen.json (benchmarks/timing/bench_varlen.py on a GPU), and launch_model
is the two-line model a learner checks them against.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

from ..dropout import keep_scale
from ..reference import alibi_bias, attention_mask
from ._base import own_axes, subplots

VARLEN_JSON = Path(__file__).resolve().parent.parent / "data" / "varlen.json"  # of benchmarks/results/
# bench_varlen.py's timings, in the order the figure draws them
VARLEN_PATHS = ("flashlab varlen", "flashlab loop", "flashlab padded", "torch SDPA loop", "torch SDPA padded + mask")

SKIPPED, PARTIAL, FULL = 0, 1, 2
TILE_COLORS = ListedColormap(["#eeeeee", "#ffbf69", "#2a9d8f"])  # skipped, partly masked, fully visible


def tile_classes(nq, nk, block_q, block_k, *, causal=False, window_size=(-1, -1), align="top_left"):
    """(Tr, Tc) ints: SKIPPED (no visible key in the tile), PARTIAL (a mask is needed) or FULL."""
    mask = attention_mask(nq, nk, causal=causal, window_size=window_size, align=align)
    tr, tc = math.ceil(nq / block_q), math.ceil(nk / block_k)
    out = np.empty((tr, tc), int)
    for i in range(tr):
        for j in range(tc):
            tile = mask[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k]
            out[i, j] = FULL if tile.all() else (PARTIAL if tile.any() else SKIPPED)
    return out


def plot_tile_grid(nq, nk, block_q, block_k, *, causal=False, window_size=(-1, -1), align="top_left", ax=None):
    """The (query block, key block) tiles: skipped, partly masked, or fully visible; the band drawn over them."""
    fig, ax = own_axes(ax)
    cls = tile_classes(nq, nk, block_q, block_k, causal=causal, window_size=window_size, align=align)
    ax.imshow(cls, cmap=TILE_COLORS, vmin=0, vmax=2, extent=(0, nk, nq, 0), aspect="auto")
    for j in range(0, nk + 1, block_k):
        ax.axvline(min(j, nk), color="white", lw=1.5)
    for i in range(0, nq + 1, block_q):
        ax.axhline(min(i, nq), color="white", lw=1.5)
    mask = attention_mask(nq, nk, causal=causal, window_size=window_size, align=align)
    ax.contour(np.arange(nk) + 0.5, np.arange(nq) + 0.5, mask.astype(float), levels=[0.5], colors="k",
               linewidths=0.8)
    n = [(cls == c).sum() for c in (FULL, PARTIAL, SKIPPED)]
    ax.set(xlabel="key j", ylabel="query i",
           title=f"{align}, window={tuple(window_size)}{', causal' if causal else ''}\n"
                 f"{n[0]} full, {n[1]} masked, {n[2]} skipped tiles")
    ax.title.set_fontsize(9)
    return fig


def plot_gqa_map(H, H_kv, ax=None):
    """Arrows from each query head h to the K/V head h // (H / H_kv) it reads."""
    fig, ax = own_axes(ax, width=6, height=2.4)
    group = H // H_kv
    colors = [f"C{g % 10}" for g in range(H_kv)]
    for h in range(H):
        g = h // group
        ax.add_patch(Rectangle((h - 0.4, 1.6), 0.8, 0.6, color=colors[g]))
        ax.text(h, 1.9, f"q{h}", ha="center", va="center", color="white", fontsize=8)
        x_kv = (g + 0.5) * H / H_kv - 0.5
        ax.annotate("", (x_kv, 0.65), (h, 1.58), arrowprops=dict(arrowstyle="->", color=colors[g], lw=0.8))
    for g in range(H_kv):
        x = (g + 0.5) * H / H_kv - 0.5
        ax.add_patch(Rectangle((x - 0.45, 0.0), 0.9, 0.6, color=colors[g]))
        ax.text(x, 0.3, f"kv{g}", ha="center", va="center", color="white", fontsize=8)
    kind = "MHA" if H_kv == H else ("MQA" if H_kv == 1 else "GQA")
    ax.set(xlim=(-0.8, H - 0.2), ylim=(-0.2, 2.4), title=f"{kind}: H = {H} query heads, H_kv = {H_kv}")
    ax.axis("off")
    return fig


def plot_alibi(slope, nq, nk, tile, *, align="top_left", ax=None):
    """The ALiBi bias -slope * |pos_i - j| over the whole score matrix, with one tile (i0, j0, bq, bk) framed."""
    fig, ax = own_axes(ax)
    bias = alibi_bias(slope, (), nq, nk, align=align)
    im = ax.imshow(bias, cmap="magma", extent=(0, nk, nq, 0), aspect="auto")
    i0, j0, bq, bk = tile
    ax.add_patch(Rectangle((j0, i0), min(bk, nk - j0), min(bq, nq - i0), fill=False, ec="cyan", lw=2))
    ax.figure.colorbar(im, ax=ax, shrink=0.8)
    ax.set(xlabel="key j", ylabel="query i", title=f"ALiBi bias, slope {slope:g}, {align}")
    return fig


def plot_softcap(softcap, ax=None):
    """softcap * tanh(s / softcap) against s: the identity near 0, flat at +-softcap."""
    fig, ax = own_axes(ax, width=4.5, height=3)
    s = np.linspace(-4 * softcap, 4 * softcap, 400)
    ax.plot(s, s, "--", color="gray", label="no cap")
    ax.plot(s, softcap * np.tanh(s / softcap), label=f"softcap = {softcap:g}")
    ax.axhline(softcap, color="k", lw=0.5)
    ax.axhline(-softcap, color="k", lw=0.5)
    ax.set(xlabel="score s", ylabel="capped score", ylim=(-2 * softcap, 2 * softcap), title="logit soft-capping")
    ax.legend(fontsize=8)
    return fig


def plot_dropout_tiles(seed, p, nq, nk, block_q, block_k, *, batch=0, head=0):
    """The whole (Nq, Nk) keep mask, and the same mask regenerated tile by tile from the key alone."""
    fig, axes = subplots(1, 2, width=9, height=3.4)
    whole = keep_scale(seed, p, batch, head, np.arange(nq)[:, None], np.arange(nk)[None, :]) > 0
    axes[0].imshow(whole, cmap="Greys_r", aspect="auto")
    axes[0].set(title=f"keep mask (white = kept), p = {p:g}", xlabel="key j", ylabel="query i")
    tiles = np.zeros((nq, nk), bool)
    for q0 in range(0, nq, block_q)[::-1]:  # in any order: each tile needs only its own indices
        for k0 in range(0, nk, block_k):
            r, c = np.arange(q0, min(q0 + block_q, nq)), np.arange(k0, min(k0 + block_k, nk))
            tiles[q0:q0 + len(r), k0:k0 + len(c)] = keep_scale(seed, p, batch, head, r[:, None], c[None, :]) > 0
    axes[1].imshow(tiles, cmap="Greys_r", aspect="auto")
    for x in range(0, nk, block_k):
        axes[1].axvline(x - 0.5, color="C1", lw=1)
    for y in range(0, nq, block_q):
        axes[1].axhline(y - 0.5, color="C1", lw=1)
    same = "identical" if np.array_equal(whole, tiles) else "DIFFERENT"
    axes[1].set(title=f"regenerated tile by tile: {same}", xlabel="key j")
    fig.tight_layout()
    return fig


def plot_varlen_mask(cu_seqlens_q, cu_seqlens_k, *, ax=None, **mask_options):
    """Which packed key each packed query may see: one block per sequence on the diagonal, masked within by
    mask_options (causal, window_size, align, as for reference.attention_mask)."""
    fig, ax = own_axes(ax)
    cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    seen = np.full((cq[-1], ck[-1]), np.nan)
    for b in range(len(cq) - 1):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        seen[cq[b]:cq[b + 1], ck[b]:ck[b + 1]] = np.where(attention_mask(nq, nk, **mask_options), b, np.nan)
    ax.imshow(seen, cmap="tab10", vmin=0, vmax=9, extent=(0, ck[-1], cq[-1], 0), aspect="auto", interpolation="none")
    for c in cq[1:-1]:
        ax.axhline(c, color="gray", lw=0.5)
    for c in ck[1:-1]:
        ax.axvline(c, color="gray", lw=0.5)
    ax.set(xlabel="packed key row", ylabel="packed query row",
           title=f"cu_seqlens_q = {[int(c) for c in cq]}, cu_seqlens_k = {[int(c) for c in ck]}\n"
                 f"{mask_options or 'no mask'} (white: never computed)")
    ax.title.set_fontsize(9)
    return fig


def plot_block_table(block_table, cache_seqlens, page_size, num_pages, ax=None):
    """Each sequence's logical pages (rows above) and the physical pages of the cache they point to (below)."""
    bt = np.asarray(block_table)
    B = len(bt)
    width = max(num_pages, bt.shape[1] + 2)
    fig, ax = own_axes(ax, width=max(6, 0.7 * width + 1.5), height=1.4 + 0.6 * B)
    y_cache = -1.6
    for p in range(num_pages):
        ax.add_patch(Rectangle((p, y_cache), 0.9, 0.8, fill=False, ec="gray"))
        ax.text(p + 0.45, y_cache - 0.25, f"{p}", ha="center", va="top", fontsize=7)
    for b in range(B):
        n, y = int(cache_seqlens[b]), B - 1 - b
        for lp in range(math.ceil(n / page_size)):
            used = min(page_size, n - lp * page_size) / page_size
            p = int(bt[b, lp])
            ax.add_patch(Rectangle((lp, y), used * 0.9, 0.8, color=f"C{b}"))
            ax.text(lp + 0.45, y + 0.4, f"{lp}→{p}", ha="center", va="center", fontsize=7, color="white")
            ax.add_patch(Rectangle((p, y_cache), used * 0.9, 0.8, color=f"C{b}", alpha=0.8))
            ax.annotate("", (p + 0.45, y_cache + 0.8), (lp + 0.45, y),
                        arrowprops=dict(arrowstyle="->", color=f"C{b}", lw=0.7, alpha=0.7))
        ax.text(-0.2, y + 0.4, f"seq {b}: {n} keys", ha="right", va="center", fontsize=8)
    ax.text(-0.2, y_cache + 0.4, "physical pages", ha="right", va="center", fontsize=8)
    ax.set(xlim=(-2.6, width), ylim=(y_cache - 0.8, B), title=f"block_table (page_size {page_size}): logical page → "
           "physical page; a partly filled page is drawn short")
    ax.title.set_fontsize(9)
    ax.axis("off")
    return fig


def load_varlen_results(path=None, variant="tensor") -> list:
    """The runs of flashlab/data/varlen.json (package data: a copy of benchmarks/results/varlen.json) for one
    kernel variant ([] if `path` names no file), each with its sequence lengths, d, H, causal, the GPU and ms
    per path."""
    path = Path(path) if path else VARLEN_JSON
    if not path.exists():
        return []
    return [r for r in json.loads(path.read_text()) if r.get("variant") == variant]


def launch_model(lens, H, d, causal, rate, t_launch, sms, block_q=128) -> dict:
    """A two-line model of a batch of sequences run as a loop of launches and as one packed launch, in ms:

        loop   = sum_i max(t_launch, t_i / f_i)      packed = t_launch + sum_i t_i

    t_i = sequence i's FLOPs (half under causal, as bench_varlen.py counts them) / `rate` (FLOP/s of a launch that
    fills the GPU); f_i = min(1, its thread blocks, H * ceil(n_i / block_q), / sms): a grid of fewer blocks than
    SMs leaves the rest idle; t_launch: seconds one launch of the loop costs at least (host work, launch latency)."""
    from ..bench import attention_flops

    loop, packed = 0.0, t_launch
    for n in lens:
        t = attention_flops(1, H, n, n, d, causal=causal) / rate
        fill = min(1.0, H * -(-n // block_q) / sms)
        loop += max(t_launch, t / fill)
        packed += t
    return {"loop_ms": 1e3 * loop, "packed_ms": 1e3 * packed}


def varlen_batch_name(run) -> str:
    lens = run["lens"]
    return f"{len(lens)} x {min(lens)}..{max(lens)}" + (", causal" if run["causal"] else "")


def plot_varlen_speed(runs, ax=None):
    """Bars: each batch's time (log scale) for one packed launch, a loop of launches, padding to the longest,
    and torch SDPA's loop and padded call, from one run each of bench_varlen.py."""
    fig, ax = own_axes(ax, width=9, height=3.6)
    if not runs:
        ax.text(0.5, 0.5, "no varlen benchmark: run benchmarks/timing/bench_varlen.py on a GPU\n"
                "(benchmarks/results/varlen.json, in a clone of the repository)", ha="center", va="center",
                transform=ax.transAxes, fontsize=9)
        ax.axis("off")
        return fig
    width = 0.8 / len(VARLEN_PATHS)
    colors = ["#2a9d8f", "#e76f51", "#f4a261", "#6c757d", "#adb5bd"]
    for i, (name, color) in enumerate(zip(VARLEN_PATHS, colors)):
        xs = [g + (i - (len(VARLEN_PATHS) - 1) / 2) * width for g in range(len(runs))]
        ax.bar(xs, [r["ms"].get(name, np.nan) for r in runs], width, color=color, label=name)
    ax.set_yscale("log")
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([varlen_batch_name(r) for r in runs], fontsize=8)
    ax.set_ylabel("ms (log scale)")
    ax.set_title(f"variable-length batches, H={runs[0]['H']} d={runs[0]['d']} float16, {runs[0]['gpu']}",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    return fig
