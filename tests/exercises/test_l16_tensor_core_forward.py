"""Lesson 16's exercises (the tensor-core forward: the S tile kernel; the inner loop of one warp, as the online
softmax on C fragments, P packed into A registers, O += PV through ldmatrix.trans and the assembled one-warp forward;
the row padding; the forward's K/V copies): each checker passes the solution, grades the blank "not implemented", and
rejects kept wrong solutions for several seeds, naming the slip. The kernels and device functions run in the
simulator without a GPU, and their kept wrong solutions are edits of the solution's source. The checkers' NumPy
models and the statement of the copies are checked against independent statements and the kernel.
"""
import math

import numpy as np
import pytest

from conftest import load_exercise
from exercise_harness import EXERCISE_SOURCES, Lesson
from flashlab import fragments as F
from flashlab.build import parse_cells, strip_solutions
from flashlab.device import has_gpu
from flashlab.grading import check
from flashlab.grading import l16_tensor_core_forward as G

LESSON = Lesson("16_tensor_core_forward")
STEM = LESSON.stem
SOLUTIONS = load_exercise(STEM)
mutant, alternative = LESSON.mutant, LESSON.alternative
LESSON.source_exercise("s_tile", "s_tile", mutant_seeds=(1, 2))
for _name, _function in (("softmax_step", "softmax_step"), ("pack_p", "pack_p"), ("pv_kstep", "pv_kstep"),
                         ("forward_warp", "build_forward")):
    LESSON.source_exercise(_name, _function, mutant_seeds=(1, 2))

# -- 1: the kernel (edits of the solution's source, run in the simulator) -------------------------
KERNEL_MUTANTS = [  # (what the learner got wrong, edits, words the verdict must contain)
    ("a1 and a2 swapped (the +4 words before the +8 rows)",
     [("MMA16(q[g, w], q[g + 8, w], q[g, w + 4], q[g + 8, w + 4],",
       "MMA16(q[g, w], q[g, w + 4], q[g + 8, w], q[g + 8, w + 4],")], "A registers are in the wrong order"),
    ("accumulators restarted at every k-step",
     [("k[key, w], k[key, w + 4], c0, c1, c2, c3)",
       "k[key, w], k[key, w + 4], np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0))")],
     "k-step"),
    ("B read as the next word instead of 4 words on",
     [("k[key, w], k[key, w + 4], c0", "k[key, w], k[key, w + 1], c0")], "B registers"),
    ("C written to columns t, t + 1", [("col = 8 * n + 2 * t", "col = 8 * n + t")], "never written"),
    ("only the first n-tile", [("for n in range(k.shape[0] // 8):", "for n in range(1):")], "never written"),
]
for _label, _edits, _says in KERNEL_MUTANTS:
    LESSON.edit_mutant("s_tile", _label, _edits, _says)


# -- 6: the row padding ---------------------------------------------------------------------------
@mutant("row_padding", "multiple of 4 words")
def padding_in_single_words(W):
    """4-byte banks taken one by one: the first p (any integer) that puts 8 rows' starts in 8 different banks"""
    return next(p for p in range(33) if len({(r * (W + p)) % 32 for r in range(8)}) == 8)


@mutant("row_padding", "not in bytes")
def padding_in_bytes(W):
    """the right padding, in bytes"""
    return 4 * SOLUTIONS["row_padding"](W)


@mutant("row_padding", "when W / 4 is odd")
def padding_always_four(W):
    """the kernel's constant: 4 words, whatever W"""
    return 4


@mutant("row_padding", "not just two neighbouring rows")
def padding_two_rows(W):
    """only rows 0 and 1 kept apart"""
    return next(p for p in range(0, 33, 4) if (W + p) % 32 // 4 != 0)


@alternative("row_padding")
def padding_from_parity(W):
    """the rows' starts step by (W + p) / 4 bank groups: 8 distinct groups mod 8 exactly when that step is odd"""
    return 0 if (W // 4) % 2 else 4


# -- 7: the swizzle -----------------------------------------------------------------------------------------
@mutant("swizzled_offset", "with the ROW")
def swizzle_by_column(row, col, row_bytes):
    """the chunk XORed with its own index"""
    chunk, inside = divmod(2 * col, 16)
    return row * row_bytes + 16 * (chunk ^ (chunk % 8)) + inside


@mutant("swizzled_offset", "row % 8")
def swizzle_by_row(row, col, row_bytes):
    """XOR with the whole row number"""
    chunk, inside = divmod(2 * col, 16)
    return row * row_bytes + 16 * (chunk ^ row) + inside


@mutant("swizzled_offset", "not 4-byte words")
def swizzle_words(row, col, row_bytes):
    """4-byte words swizzled instead of 16-byte chunks"""
    word, inside = divmod(2 * col, 4)
    return row * row_bytes + 4 * (word ^ (row % 8)) + inside


@mutant("swizzled_offset", "inside its 16-byte chunk")
def swizzle_chunk_start(row, col, row_bytes):
    """the chunk's first byte for every value in it"""
    return row * row_bytes + 16 * ((2 * col // 16) ^ (row % 8))


@alternative("swizzled_offset")
def swizzle_on_bits(row, col, row_bytes):
    """on the bits of the byte's place in its row, as CuTe's Swizzle<3, 4, 3> does: bits 4-6 ^= row % 8"""
    return row * row_bytes + ((2 * col) ^ ((row & 7) << 4))


# -- 8: the forward's K/V copies ----------------------------------------------------------------------
_plan = SOLUTIONS["copy_plan"]


@mutant("copy_plan", "padded by 4 words")
def plan_unpadded(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """shared rows W words apart instead of W + 4"""
    W = d if wide else d // 2
    return [((s // (W + 4)) * W + s % (W + 4), src, n) for s, src, n in _plan(tid, threads, d, block_k, k0, n_k,
                                                                              row_stride, wide)]


@mutant("copy_plan", "row_stride words apart")
def plan_contiguous_source(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """the source's rows taken as W words apart, whatever row_stride says"""
    return _plan(tid, threads, d, block_k, k0, n_k, d if wide else d // 2, wide)


@mutant("copy_plan", "consecutive 16-byte chunks of one row")
def plan_rows_first(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """consecutive threads on consecutive rows (column = tid // rows per step): uncoalesced"""
    W = d if wide else d // 2
    rows = threads // (W // 4)
    out, row, col = [], tid % rows, 4 * (tid // rows)
    while row < block_k:
        ok = k0 + row < n_k
        out.append((row * (W + 4) + col, (k0 + row) * row_stride + col if ok else k0 * row_stride + col,
                    16 if ok else 0))
        row += rows
    return out


@mutant("copy_plan", "0 bytes")
def plan_copies_past_the_end(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """rows past n_k read 16 bytes from past the end"""
    W = d if wide else d // 2
    return [(s, src if n else src + (s // (W + 4)) * row_stride, 16) for s, src, n in
            _plan(tid, threads, d, block_k, k0, n_k, row_stride, wide)]


def test_the_copy_checkers_plan_is_the_kernels(rng, monkeypatch):
    """The checker's copy_plan is what the tensor forward copies: every cp_async16_flat call of a simulated launch
    (two K/V tiles, the second past the keys) is a (shared word, source word, bytes) of the plan, K's at the
    tile's stage and V's block_k padded rows further on."""
    if has_gpu():
        pytest.skip("records the simulator's copies")
    from flashlab.grading.l16_tensor_core_forward import copy_plan
    from flashlab.kernels import flash_attention, mma, tensor

    d, block_k, n_k, tile = 16, 16, 20, tensor.TensorTile(1, 16)
    W = d // 2
    stage, vo = 2 * block_k * (W + 4), block_k * (W + 4)
    seen, copy = [], mma.cp_async16_flat

    def recording(dst, dst_index, src, base, offset, src_bytes):
        seen.append((int(dst_index), int(base) + int(offset), int(src_bytes)))
        return copy(dst, dst_index, src, base, offset, src_bytes)

    monkeypatch.setattr(mma, "cp_async16_flat", recording)
    q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float16) for n in (16, n_k, n_k))
    flash_attention(q, k, v, variant="tensor", block_q=16, block_k=block_k)
    want = []
    for j, k0 in enumerate(range(0, n_k, block_k)):
        for tid in range(tile.threads):
            for s, src, n in copy_plan(tid, tile.threads, d, block_k, k0, n_k, W, False):
                want += [((j % 2) * stage + s, src, n), ((j % 2) * stage + vo + s, src, n)]
    assert sorted(seen) == sorted(want)
    assert any(n == 0 for _, _, n in want) and any(n == 16 for _, _, n in want)


# -- 2: the online softmax -------------------------------------------------------------------------------------
SOFTMAX_MUTANTS = [  # (what the learner got wrong, edits, words the verdict must contain)
    ("one shfl_xor: the butterfly stops after mask 1",
     [("        mx = max(mx, mma.shfl_xor(mx, 2))\n", "")], "a butterfly step is missing"),
    ("one shfl_xor: mask 2 only",
     [("        mx = max(mx, mma.shfl_xor(mx, 1))  # the quad's 4 lanes hold the row's columns\n", "")],
     "a butterfly step is missing"),
    ("no shuffle: each lane's own max", [("        mx = max(mx, mma.shfl_xor(mx, 1))  # the quad's 4 lanes hold the "
                                          "row's columns\n        mx = max(mx, mma.shfl_xor(mx, 2))\n", "")],
     "the row max is this lane's own"),
    ("the max taken before masking",
     [("                if key >= n_keys or (causal and key > row):\n                    s[n, 2 * r + c] = NEG\n"
       "                mx = max(mx, s[n, 2 * r + c])\n",
       "                mx = max(mx, s[n, 2 * r + c])\n                if key >= n_keys or (causal and key > row):\n"
       "                    s[n, 2 * r + c] = NEG\n")], "the max was taken before masking"),
    ("l summed across the quad every tile",
     [("        l[r] = l[r] * alpha + row_sum  # this lane's share only\n",
       "        row_sum += mma.shfl_xor(row_sum, 1)\n        row_sum += mma.shfl_xor(row_sum, 2)\n"
       "        l[r] = l[r] * alpha + row_sum\n")], "l is summed across the quad every tile"),
    ("l summed across the quad every tile, after the update",
     [("        l[r] = l[r] * alpha + row_sum  # this lane's share only\n",
       "        l[r] = l[r] * alpha + row_sum\n        l[r] += mma.shfl_xor(l[r], 1)\n"
       "        l[r] += mma.shfl_xor(l[r], 2)\n")], "l is summed across the quad every tile"),
    ("O not rescaled", [("            acc[n, 2 * r] *= alpha\n            acc[n, 2 * r + 1] *= alpha",
                         "            pass")], "O's fragments are not rescaled"),
    ("l not rescaled", [("        l[r] = l[r] * alpha + row_sum  # this lane's share only\n",
                         "        l[r] = l[r] + row_sum\n")], "l is not rescaled"),
    ("alpha inverted", [("alpha = math.exp2((m[r] - m_new) * scale_log2)",
                         "alpha = math.exp2((m_new - m[r]) * scale_log2)")], "alpha is inverted"),
    ("P against the previous max", [("                p = math.exp2((s[n, 2 * r + c] - m_new) * scale_log2)",
                                     "                p = math.exp2((s[n, 2 * r + c] - m_old) * scale_log2)"),
                                    ("        m[r] = m_new\n", "        m_old = m[r]\n        m[r] = m_new\n")],
     "P is computed with the old max"),
    ("the causal mask hides the diagonal", [("(causal and key > row)", "(causal and key >= row)")],
     "hides the diagonal"),
    ("the ragged tail not masked", [("if key >= n_keys or (causal and key > row):", "if causal and key > row:")],
     "key >= n_keys"),
]
for _label, _edits, _says in SOFTMAX_MUTANTS:
    LESSON.edit_mutant("softmax_step", _label, _edits, _says)

# -- 3: P into A registers -------------------------------------------------------------------------------------
PACK_MUTANTS = [
    ("registers 1 and 2 swapped (the +8 keys before the +8 rows)",
     [("mma.pack_f16x2(s[n, 2], s[n, 3]),  # rows", "mma.pack_f16x2(s[n + 1, 0], s[n + 1, 1]),  # rows"),
      ("            mma.pack_f16x2(s[n + 1, 0], s[n + 1, 1]), mma.pack_f16x2(s[n + 1, 2]",
       "            mma.pack_f16x2(s[n, 2], s[n, 3]), mma.pack_f16x2(s[n + 1, 2]")],
     "the A registers are in the wrong order"),
    ("n-tiles kk and kk + 1", [("    n = 2 * kk  # the k-step's", "    n = kk  # the k-step's")], "not kk and kk + 1"),
    ("halves swapped", [("(s[n, 0], s[n, 1])", "(s[n, 1], s[n, 0])"), ("(s[n, 2], s[n, 3])", "(s[n, 3], s[n, 2])"),
                        ("(s[n + 1, 0], s[n + 1, 1])", "(s[n + 1, 1], s[n + 1, 0])"),
                        ("(s[n + 1, 2], s[n + 1, 3])", "(s[n + 1, 3], s[n + 1, 2])")], "halves of each register"),
    ("a column's pair instead of a row's", [("(s[n, 0], s[n, 1])", "(s[n, 0], s[n, 2])"),
                                            ("(s[n, 2], s[n, 3])", "(s[n, 1], s[n, 3])"),
                                            ("(s[n + 1, 0], s[n + 1, 1])", "(s[n + 1, 0], s[n + 1, 2])"),
                                            ("(s[n + 1, 2], s[n + 1, 3])", "(s[n + 1, 1], s[n + 1, 3])")],
     "two neighbours of one row"),
    ("packed as bfloat16", [("mma.pack_f16x2", "mma.pack_bf16x2")], "bfloat16"),
]
for _label, _edits, _says in PACK_MUTANTS:
    LESSON.edit_mutant("pack_p", _label, _edits, _says)

# -- 4: O += P V ---------------------------------------------------------------------------------------------
PV_MUTANTS = [
    ("V read without .trans", [("mma.ldmatrix_x4_trans(sh,", "mma.ldmatrix_x4(sh,")], "V was read without .trans"),
    ("matrices 1 and 2 given to the wrong registers", [("b00, b01, b10, b11 = mma.ldmatrix_x4_trans",
                                                        "b00, b10, b01, b11 = mma.ldmatrix_x4_trans")],
     "went to the wrong registers"),
    ("keys 8-15 not offset", [("key = ((lane // 8) % 2) * 8 + lane % 8", "key = lane % 8")],
     "keys 8-15 are read as keys 0-7"),
    ("the accumulator restarted", [("acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])",
                                    "float32(0.0), float32(0.0), float32(0.0), float32(0.0))")], "restart at 0"),
    ("only the first 16 dims", [("for n2 in range(acc.shape[0] // 2):", "for n2 in range(1):")],
     "only O's first two n-tiles"),
    ("base ignored", [("mma.ldmatrix_x4_trans(sh, base + key * rs + word)",
                       "mma.ldmatrix_x4_trans(sh, key * rs + word)")],
     "outside V's rows"),
]
for _label, _edits, _says in PV_MUTANTS:
    LESSON.edit_mutant("pv_kstep", _label, _edits, _says)

# -- 5: the assembled forward -----------------------------------------------------------------------------------
FINISH = ("            total = l[r]\n"
          "            total += mma.shfl_xor(total, 1)  # the quad's 4 partial sums, once\n"
          "            total += mma.shfl_xor(total, 2)\n"
          "            row = row0 + g + 8 * r\n"
          "            if row < n_q:\n")
FORWARD_MUTANTS = [
    ("l not added over the quad at the end",
     [("            total += mma.shfl_xor(total, 1)  # the quad's 4 partial sums, once\n"
       "            total += mma.shfl_xor(total, 2)\n", "")], "divided by this lane's partial l"),
    ("one k-step of P V per tile", [("for kk in range(BLOCK_K // 16):", "for kk in range(1):")],
     "only the first 16 keys of each tile"),
    ("P times K's rows", [("VO + 16 * kk * RS, RS, lane)", "16 * kk * RS, RS, lane)")], "multiplied with K"),
    ("O not divided by l", [("acc[n, 2 * r] / total", "acc[n, 2 * r]"),
                            ("acc[n, 2 * r + 1] / total", "acc[n, 2 * r + 1]")],
     "not divided by l"),
    ("rows g + 8 written to row g", [(FINISH, FINISH.replace("row = row0 + g + 8 * r", "row = row0 + g"))],
     "never written"),
    ("causal not passed on", [("softmax_step(s, m, l, acc, k0, row0, n_k, causal, scale_log2, lane)",
                               "softmax_step(s, m, l, acc, k0, row0, n_k, False, scale_log2, lane)")],
     "keys after the row must be hidden"),
]
for _label, _edits, _says in FORWARD_MUTANTS:
    LESSON.edit_mutant("forward_warp", _label, _edits, _says)
# Right answers written differently from the solution: each must pass.
CORRECT_VARIANTS = [
    ("softmax_step", "p = exp2(s * scale - m * scale), as the library's kernel",
     [("p = math.exp2((s[n, 2 * r + c] - m_new) * scale_log2)",
       "p = math.exp2(s[n, 2 * r + c] * scale_log2 - m_new * scale_log2)")]),
    ("softmax_step", "hidden scores at -inf", [("s[n, 2 * r + c] = NEG", "s[n, 2 * r + c] = -math.inf")]),
    ("softmax_step", "the butterfly the other way round",
     [("mma.shfl_xor(mx, 1))  # the", "mma.shfl_xor(mx, 3))  # the")]),
    ("pv_kstep", "matrices numbered dims first, registers given accordingly",
     [("key = ((lane // 8) % 2) * 8 + lane % 8", "key = (lane // 16) * 8 + lane % 8"),
      ("word = 8 * n2 + (lane // 16) * 4", "word = 8 * n2 + ((lane // 8) % 2) * 4"),
      ("b00, b01, b10, b11 = mma.ldmatrix_x4_trans", "b00, b10, b01, b11 = mma.ldmatrix_x4_trans")]),
    ("forward_warp", "the quad's sum in the other order, O times 1 / l",
     [("total += mma.shfl_xor(total, 1)  # the", "total += mma.shfl_xor(total, 2)  # the"),
      ("            total += mma.shfl_xor(total, 2)\n            row =",
       "            total += mma.shfl_xor(total, 1)\n            total = 1 / total\n            row ="),
      ("acc[n, 2 * r] / total", "acc[n, 2 * r] * total"), ("acc[n, 2 * r + 1] / total", "acc[n, 2 * r + 1] * total")]),
]


globals().update(LESSON.standard_tests())


@pytest.mark.skipif(has_gpu(), reason="the simulator's check; on a GPU a skipped warp instruction is undefined")
def test_s_tile_that_skips_the_mma_on_some_lanes_fails_with_a_message():
    edits = [("        for ks in range(q.shape[1] // 8):  # k-steps of 16 dims = 8 words\n",
              "        for ks in range(q.shape[1] // 8 if lane else 0):  # k-steps of 16 dims = 8 words\n")]
    result = check("s_tile", LESSON.with_edits("s_tile", edits), seed=1, quiet=True)
    assert result.status == "failed" and "all 32 lanes" in str(result), str(result)


def test_every_edit_changes_its_own_exercise_only():
    """Each edit's text is in the code (as load_source runs it: solution markers gone) of the one cell that defines
    the exercise's function, and nowhere else: load_source replaces every occurrence in every cell."""
    cells = [strip_solutions(src, True) for kind, src in parse_cells((EXERCISE_SOURCES / f"{LESSON.stem}.py")
                                                                     .read_text()) if kind == "code"]
    for name, mutants in LESSON.mutants.items():
        if name not in LESSON.sources:  # a function mutant, not an edit
            continue
        own = [c for c in cells if f"def {LESSON.sources[name].function}(" in c]
        assert len(own) == 1, name
        for m in mutants:
            for old, _ in m.edits:
                assert own[0].count(old) >= 1 and sum(c.count(old) for c in cells) == own[0].count(old), \
                    f"{name}: mutant {m.label!r}: {old!r} is not in the exercise's cell only"


@pytest.mark.parametrize("name,label,edits", CORRECT_VARIANTS, ids=[f"{n}: {lab}" for n, lab, _ in CORRECT_VARIANTS])
def test_correct_variant_passes(name, label, edits):
    fn = LESSON.with_edits(name, edits, label)
    for seed in (1, 2, 3):
        result = check(name, fn, seed=seed, quiet=True)
        assert result.passed, f"{label}, seed {seed}:\n{result}"


def test_the_checkers_neg_is_the_kernels():
    from flashlab.kernels.common import NEG

    assert G.NEG == NEG


def test_softmax_model_is_the_online_softmax(rng):
    """Two tiles through the model: the quad agrees on m, the final m is each row's max, the quad's partial sums
    add up to the row's sum of exp2((S - m) scale_log2), the last P is against the final max, and O's fragments
    were rescaled by exp2((m_before - m_after) scale_log2) in total."""
    S = rng.standard_normal((16, 32)) * 4
    c = G.LOG2E / 4
    m, l, acc = np.full((32, 2), G.NEG), np.zeros((32, 2)), np.ones((32, 2, 4))
    m[:] = G._lane_rows(S[:, :16].max(axis=1) - 1)  # as if an earlier tile had a max 1 below this one's
    m0 = m.copy()
    for k0 in (0, 16):
        out = G.softmax_model(G._c_fragments(S[:, k0:k0 + 16]), m, l, acc, k0, 0, 32, False, c)
        m, l, acc = out["m"], out["l"], out["acc"]
    quads = m.reshape(8, 4, 2)
    assert np.array_equal(quads, np.repeat(quads[:, :1], 4, axis=1))
    per_row = lambda x: np.concatenate([x[::4, 0], x[::4, 1]])  # noqa: E731  (lane 4g holds rows g, g + 8)
    m_row = per_row(m)
    np.testing.assert_array_equal(m_row, S.max(axis=1))
    np.testing.assert_allclose(per_row(G._quad_sum(l)), np.exp2((S - m_row[:, None]) * c).sum(axis=1), rtol=1e-12)
    np.testing.assert_allclose(G._from_c(out["s"]), np.exp2((S[:, 16:] - m_row[:, None]) * c), rtol=1e-12)
    np.testing.assert_allclose(acc, np.exp2((m0 - m) * c)[:, None, [0, 0, 1, 1]] * np.ones((32, 2, 4)), rtol=1e-12)


def test_pack_model_is_the_a_fragment(rng):
    P = rng.uniform(0, 1, (16, 48)).astype(np.float32)
    regs = G.pack_model(G._c_fragments(P))
    for kk in range(3):
        want = F.to_bits16(F.to_fragments(P[:, 16 * kk:16 * kk + 16], "m16n8k16", "A"), "float16")
        np.testing.assert_array_equal(regs[:, kk], F.pack16(want[:, 0::2], want[:, 1::2]))


def test_pv_model_is_o_plus_pv(rng):
    P, V = (F.round_f16(rng.uniform(0, 1, s).astype(np.float32)) for s in ((16, 16), (16, 48)))
    O = rng.standard_normal((16, 48))
    a = G._registers(F.to_fragments(P, "m16n8k16", "A"))
    got = G._from_c(G.pv_model(a, G._c_fragments(O), V))
    np.testing.assert_allclose(got, O + P.astype(np.float64) @ V, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_model_is_the_reference(rng, causal):
    from flashlab import reference_attention

    Q, K, V = (rng.standard_normal((n, 32)) for n in (20, 45, 45))
    want, _ = reference_attention(Q, K, V, causal=causal)
    np.testing.assert_allclose(G.forward_model(Q, K, V, causal, 1 / math.sqrt(32)), want, rtol=1e-10)


@pytest.mark.skipif(has_gpu(), reason="the simulator's check")
def test_a_plain_python_function_is_refused():
    result = check("softmax_step", LESSON.solution("softmax_step").py_func, seed=1, quiet=True)
    assert result.status == "failed" and "@cuda.jit(device=True)" in result.message, str(result)


@pytest.mark.slow  # the simulator waits half a second and more for the lanes that never come
@pytest.mark.skipif(has_gpu(), reason="the simulator's check; on a GPU a shuffle some lanes skip is undefined")
def test_forward_with_the_quads_shuffles_inside_the_row_test_fails_with_a_message():
    inside = ("            row = row0 + g + 8 * r\n            if row < n_q:\n                total = l[r]\n"
              "                total += mma.shfl_xor(total, 1)\n                total += mma.shfl_xor(total, 2)\n")
    edits = [(FINISH, inside)]
    result = check("forward_warp", LESSON.with_edits("forward_warp", edits), seed=1, quiet=True)
    assert result.status == "failed" and "all 32 lanes" in str(result), str(result)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
def test_the_solutions_compile_and_pass_on_the_gpu():
    """On a GPU the device functions and the kernel are compiled (float32 registers, tuples of uint32, shared arrays
    passed to device functions) and graded against the same models, exp2 and mma being the hardware's."""
    for name in LESSON.exercises():
        for seed in (0, 1):
            result = check(name, LESSON.solution(name), seed=seed, quiet=True)
            assert result.passed, str(result)
