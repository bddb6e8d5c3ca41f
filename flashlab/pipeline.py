"""FlashAttention-3's producer/consumer pipeline as small models (lesson 20), each matching kernels/wgmma.py.

    slot, full, empty = ring_fill(j, stages)       # where tile j lands, and the mbarrier parities to wait for
    slips = schedule_slips(order)                  # what is wrong with a consumer's order of steps ([] = none)
    run = measured_timeline(d=128)                 # the H200's %globaltimer stamps of one block, as intervals
    plot_measured_timeline(run)                    # drawn as lesson 11 draws its model
    BACKWARD_OPERANDS, dq_traffic(...)             # the backward: where each product's operands live, dQ's cost

The ring. The producer copies K/V tile j into slot j % stages; it is that slot's fill number j // stages. An
mbarrier counts phases: the first phase to complete has parity 0, the next parity 1, and so on, and
`mbarrier.try_wait.parity p` returns once the phase of parity p has completed. So a consumer waits for tile j
with parity (j // stages) % 2 on the slot's "full" barrier, and the producer, before it refills the slot with
tile j, waits for the consumers' release of tile j - stages: parity (j // stages - 1) % 2 on the "empty" barrier.
The first `stages` fills wait for nothing (a wait on a phase that never ran would never end).

A consumer's iteration. One steady-state iteration j of a consumer warpgroup (kernels/wgmma.py's loop) is a
list of the STEPS below; the rules that make it correct (data is there before it is read, registers are not
touched while a wgmma in flight reads them) and fast (the softmax runs while P V is on the tensor cores, the
other consumer is not kept waiting, the producer can refill early) are RULES, each with what goes wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"

# ------------------------------------------------------------------------------------------------- the ring


def ring_fill(j: int, stages: int):
    """(slot, full_parity, empty_parity) of K/V tile j in a ring of `stages` slots: the slot it lands in, the
    parity a consumer waits for on the slot's full barrier, and the parity the producer waits for on its empty
    barrier before the copy (None for the first `stages` tiles: the slot was never used)."""
    if stages < 1 or j < 0:
        raise ValueError(f"need stages >= 1 and j >= 0; got stages={stages}, j={j}")
    fill = j // stages
    return j % stages, fill % 2, None if fill == 0 else (fill - 1) % 2


# ----------------------------------------------------------------------------------- a consumer's iteration
STEPS = {
    "wait K": "wait on the full barrier until K_j has landed",
    "wait V": "wait on the full barrier until V_{j-1} has landed",
    "my turn": "pingpong: wait at this warpgroup's named barrier until the previous consumer has issued",
    "fence": "wgmma.fence: the registers written since the last wgmma (O, P) are ready for the tensor cores",
    "issue S": "issue S = Q K_j^T (d/16 wgmma) and commit them as one group",
    "issue PV": "issue O += P_{j-1} V_{j-1} (block_k/16 wgmma, P from registers) and commit them as a group",
    "your turn": "pingpong: arrive at the next consumer's named barrier",
    "wait S": "wgmma_wait(1): all groups but the newest have completed",
    "release K": "arrive on K_j's empty barrier",
    "softmax": "mask S, the online softmax: m, l, and exp in place (writes S's registers only)",
    "wait PV": "wgmma_wait(0): every group has completed",
    "release V": "arrive on V_{j-1}'s empty barrier",
    "rescale+pack": "O *= alpha, P_j packed to 16 bits into the A registers",
}
KERNEL_ORDER = ("wait K", "wait V", "my turn", "fence", "issue S", "issue PV", "your turn", "wait S", "release K",
                "softmax", "wait PV", "release V", "rescale+pack")


def _before(order, a, b) -> bool:
    return order.index(a) < order.index(b)


# (name, holds(order), what goes wrong otherwise); the order is checked to hold every step once first
RULES = [
    ("K before S", lambda o: _before(o, "wait K", "issue S"),
     "S = Q K_j^T is issued before K_j has landed: the tensor cores read a slot the copy is still filling"),
    ("V before PV", lambda o: _before(o, "wait V", "issue PV"),
     "P V is issued before V_{j-1} has landed"),
    ("fence first", lambda o: _before(o, "fence", "issue S") and _before(o, "fence", "issue PV"),
     "a wgmma is issued before wgmma.fence: the O and P registers written since the last wgmma may not be "
     "visible to it"),
    ("turn first", lambda o: _before(o, "my turn", "issue S") and _before(o, "my turn", "issue PV"),
     "a GEMM is issued before this warpgroup's turn: pingpong's order is lost, and with it the other "
     "consumer's softmax running under these GEMMs"),
    ("turn after", lambda o: _before(o, "issue S", "your turn") and _before(o, "issue PV", "your turn"),
     "the turn is passed on before both GEMMs are issued: the next consumer's GEMMs cut in between"),
    ("S committed first", lambda o: _before(o, "issue S", "issue PV"),
     "P V is committed before S: groups complete in order, so wgmma_wait(1) now waits for P V as well, and "
     "the softmax no longer runs under it"),
    ("wait S first", lambda o: _before(o, "wait S", "softmax") and _before(o, "wait S", "release K")
     and _before(o, "issue PV", "wait S"),
     "S is read (or K released) before wgmma_wait(1) says S is done, or the wait comes before P V is issued"),
    ("overlap", lambda o: _before(o, "softmax", "wait PV"),
     "the softmax waits for P V (wgmma_wait(0) first): the tensor cores and the softmax take turns instead of "
     "overlapping"),
    ("PV done first", lambda o: _before(o, "wait PV", "rescale+pack") and _before(o, "wait PV", "release V"),
     "O or P's registers change (or V is released) while P V, which reads them, may still be running"),
    ("turn not held", lambda o: _before(o, "your turn", "wait S"),
     "the turn is passed on only after waiting for S: the next consumer cannot issue its GEMMs until this "
     "one's S is done, and pingpong serialises"),
    ("K released early", lambda o: _before(o, "release K", "softmax"),
     "K_j is held through the softmax: the producer cannot refill its half of the slot until much later, and "
     "with two stages the next K arrives late"),
    ("softmax before rescale", lambda o: _before(o, "softmax", "rescale+pack"),
     "O is rescaled and P packed before the softmax has computed alpha and P"),
]


def schedule_slips(order) -> list:
    """What is wrong with one iteration's order of STEPS, as sentences ([] when it is the kernel's schedule or
    another that is as correct and as overlapped)."""
    order = list(order)
    unknown = [s for s in order if s not in STEPS]
    if unknown:
        return [f"unknown step(s) {unknown}; the steps are {list(STEPS)}"]
    missing = [s for s in STEPS if s not in order]
    twice = sorted({s for s in order if order.count(s) > 1})
    if missing or twice:
        return [f"each step once: missing {missing}" + (f", more than once {twice}" if twice else "")]
    return [why for _, holds, why in RULES if not holds(order)]


# ----------------------------------------------------------------------------------- the measured timeline
TIMELINE_JSON = "wgmma_timeline.json"
PRODUCER = "issues K, V (waiting for a free slot)"
PHASES = (("waits for its turn", 0, 1), ("S on the tensor cores", 1, 2), ("softmax", 2, 3),
          ("P V finishing", 3, 4))


def measured_timeline(d: int = 128, path=None) -> dict:
    """One run of the timeline build (scripts/gpu_check_wgmma_forward.py) as intervals in microseconds: the
    run's facts plus "rows": {warpgroup label: [(phase, tile, start, end), ...]}; the producer's spans run from
    K's slot being free to V's copy issued (mostly waiting for V's slot). The gaps between a consumer's spans
    are O's rescale, P's packing and the mbarrier waits."""
    path = Path(path) if path else DATA / TIMELINE_JSON
    record = json.loads(path.read_text())
    runs = [r for r in record["runs"] if r["d"] == d]
    if not runs:
        raise ValueError(f"no timeline for d = {d} in {path}; it has d = {[r['d'] for r in record['runs']]}")
    run = dict(runs[0], gpu=record["gpu"], date=record["date"])
    st = np.asarray(run.pop("stamps_ns"), dtype=np.float64) / 1e3
    rows = {"producer": [(PRODUCER, j, st[0, j, 0], max(st[0, j, 1], st[0, j, 0] + 0.02))
                         for j in range(st.shape[1]) if st[0, j, 0] >= 0 and st[0, j, 1] >= 0]}
    for w in range(1, st.shape[0]):
        spans = []
        for j in range(st.shape[1]):
            for name, a, b in PHASES:
                if st[w, j, a] >= 0 and st[w, j, b] >= 0:
                    spans.append((name, j, st[w, j, a], st[w, j, b]))
        rows[f"consumer {w}"] = spans
    run["rows"] = rows
    return run


_COLORS = {PRODUCER: "#9e9e9e", "waits for its turn": "#e0e0e0", "S on the tensor cores": "#4c72b0",
           "softmax": "#dd8452", "P V finishing": "#55a868"}


def plot_measured_timeline(run, ax=None, until=None):
    """Draw measured_timeline's intervals, one row per warpgroup (lesson 11's style), up to `until` us."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(11, 0.6 + 0.5 * len(run["rows"])))[1]
    labels = list(run["rows"])
    for i, label in enumerate(labels):
        for name, _, a, b in run["rows"][label]:
            if until is None or a < until:
                ax.barh(i, b - a, left=a, color=_COLORS[name], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds since the block's first copy")
    if until:
        ax.set_xlim(0, until)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    return ax


def phase_means(run) -> dict:
    """Mean microseconds of each phase over the steady tiles (not the first two or the last) of every consumer."""
    out = {}
    for name, _, _ in PHASES:
        spans = [b - a for label, rows in run["rows"].items() if label != "producer"
                 for phase, j, a, b in rows if phase == name and 2 <= j < max(r[1] for r in rows)]
        out[name] = float(np.mean(spans)) if spans else float("nan")
    return out


# -------------------------------------------------------------------------------------------- the backward
# Where each of the backward's five products finds its operands in kernels/wgmma_backward.py: (A's place, A's
# major, B's place, B's major). "K" major: the summed dimension runs along the stored rows; "MN": down them.
BACKWARD_OPERANDS = {
    "S^T = K Q^T": ("shared", "K", "shared", "K"),
    "dP^T = V dO^T": ("shared", "K", "shared", "K"),
    "dV += P^T dO": ("registers", "K", "shared", "MN"),
    "dK += dS^T Q": ("registers", "K", "shared", "MN"),
    "dQ += dS K": ("shared", "MN", "shared", "MN"),
}


def dq_traffic(n_q: int, n_k: int, d: int, block_q: int, block_k: int, itemsize: int = 2):
    """(bytes of dQ's float32 atomic adds, bytes a second pass would re-read instead), without a causal mask.
    Atomics: every key block adds a float32 share of every query row's d values. A second pass (a kernel over query
    blocks that recomputes dS and forms dQ itself) re-reads every K and V tile once per query block."""
    atomics = -(-n_k // block_k) * n_q * d * 4
    second_pass = -(-n_q // block_q) * n_k * d * 2 * itemsize
    return atomics, second_pass
