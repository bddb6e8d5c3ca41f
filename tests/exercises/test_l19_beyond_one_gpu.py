"""Lesson 19's exercises (ring attention: merging a rank's partial results in ring order, the zigzag index map,
the bytes a rank sends, the length at which a link keeps up): each checker passes the solution, grades the
blank "not implemented", and rejects plausible wrong solutions with a message and a hint."""
import numpy as np

from exercise_harness import Lesson, _work

LESSON = Lesson("19_beyond_one_gpu", min_alternatives=1)
mutant, alternative = LESSON.mutant, LESSON.alternative


# -- ring_merge ----------------------------------------------------------------------------------------------
@mutant("ring_merge")
def merge_averages_the_outputs(o_parts, lse_parts):  # ignores how much each shard weighs
    w = np.isfinite(lse_parts).astype(_work(o_parts))
    m = lse_parts.max(0)
    return (w[..., None] * o_parts).sum(0) / w.sum(0)[..., None], m + np.log(np.exp(lse_parts - m).sum(0))


@mutant("ring_merge", hint="subtract the largest lse_t first")
def merge_without_the_max(o_parts, lse_parts):  # exp(lse) overflows once scores are large
    w = np.exp(lse_parts.astype(_work(o_parts)))
    return (w[..., None] * o_parts).sum(0) / w.sum(0)[..., None], np.log(w.sum(0))


@mutant("ring_merge")
def merge_keeps_the_largest_lse(o_parts, lse_parts):  # lse = max instead of a log-sum-exp
    m = lse_parts.max(0)
    w = np.exp(lse_parts - m)
    return (w[..., None] * o_parts).sum(0) / w.sum(0)[..., None], m


@mutant("ring_merge")
def merge_forgets_to_divide(o_parts, lse_parts):  # weighs the outputs but does not renormalise
    m = lse_parts.max(0)
    w = np.exp(lse_parts - m)
    return (w[..., None] * o_parts).sum(0), m + np.log(w.sum(0))


@mutant("ring_merge")
def merge_adds_the_outputs(o_parts, lse_parts):  # treats normalised outputs as unnormalised O
    m = lse_parts.max(0)
    return o_parts.sum(0), m + np.log(np.exp(lse_parts - m).sum(0))


@mutant("ring_merge")
def merge_only_the_own_shard(o_parts, lse_parts):  # step 0 alone
    return o_parts[0], lse_parts[0]


@alternative("ring_merge")
def merge_all_at_once(o_parts, lse_parts):
    m = lse_parts.max(0)  # step 0 always sees a key, so m is finite
    w = np.exp(lse_parts - m)
    l = w.sum(0)
    return (w[..., None] * o_parts).sum(0) / l[..., None], m + np.log(l)


# -- zigzag_indices ------------------------------------------------------------------------------------------
def _zz(N, rank, W, *, second=lambda r, W: 2 * W - 1 - r, chunks=None, order=1):
    c = N // (chunks or 2 * W)
    a, b = rank, second(rank, W)
    parts = [np.arange(a * c, (a + 1) * c), np.arange(b * c, (b + 1) * c)][::order]
    return np.concatenate(parts)


mutant("zigzag_indices")(lambda N, r, W: _zz(N, r, W, second=lambda r, W: 2 * W - r))  # off by one
mutant("zigzag_indices")(lambda N, r, W: _zz(N, r, W, order=-1))  # the late chunk first
mutant("zigzag_indices")(lambda N, r, W: np.arange(r * N // W, (r + 1) * N // W))  # contiguous layout
mutant("zigzag_indices")(lambda N, r, W: _zz(N, r, W, chunks=W)[: N // W])  # chunks of N / W
mutant("zigzag_indices")(lambda N, r, W: _zz(N, r, W).astype(float))  # positions as floats
mutant("zigzag_indices")(lambda N, r, W: _zz(N, r, W, second=lambda r, W: W + r))  # rank r and W + r: striped halves


@alternative("zigzag_indices")
def zigzag_by_mask(N, rank, world_size):
    chunk = np.arange(N) // (N // (2 * world_size))
    return np.flatnonzero((chunk == rank) | (chunk == 2 * world_size - 1 - rank))


# -- ring_bytes ----------------------------------------------------------------------------------------------
def _rb(*, fwd_sends=lambda W: W - 1, home=True, kv_again=True, grad_size=True, both=2):
    def ring_bytes(N, W, B, Hkv, d, size, gsize):
        shard = both * B * Hkv * (N // W) * d
        forward = fwd_sends(W) * shard * size
        back = ((W if home else W - 1) * shard * (gsize if grad_size else size)) if W > 1 else 0
        return forward, (forward if kv_again else 0) + back
    return ring_bytes


mutant("ring_bytes", hint="the last send brings it home")(_rb(home=False))
mutant("ring_bytes", hint="W - 1 times, not W")(_rb(fwd_sends=lambda W: W))
mutant("ring_bytes")(_rb(kv_again=False))  # the backward's K/V forgotten
mutant("ring_bytes")(_rb(grad_size=False))  # dK/dV in itemsize
mutant("ring_bytes")(_rb(both=1))  # K only


@alternative("ring_bytes")
def ring_bytes_per_step(N, world_size, batch, kv_heads, d, itemsize, grad_itemsize):
    numbers = 2 * batch * kv_heads * (N // world_size) * d  # K and V, or dK and dV, of one shard
    forward = sum(numbers * itemsize for step in range(world_size - 1))
    grads = sum(numbers * grad_itemsize for step in range(world_size)) if world_size > 1 else 0
    return forward, forward + grads


# -- hiding_length -------------------------------------------------------------------------------------------
def _hl(*, work=0.5, per_rank=False, kv=True, flops=4, sent=2):
    def hiding_length(W, H, Hkv, size, peak, bw, causal):
        w = work if causal else 1.0
        c = sent * size * peak * (Hkv if kv else H) / (flops * bw * H * w)
        return c if per_rank else W * c
    return hiding_length


mutant("hiding_length", hint="the whole sequence")(_hl(per_rank=True))
mutant("hiding_length", hint="twice the tokens")(_hl(work=1.0))  # the causal mask ignored
mutant("hiding_length", hint="GQA")(_hl(kv=False))
mutant("hiding_length", hint="Count both products")(_hl(flops=2))
mutant("hiding_length")(_hl(sent=1))  # K only
mutant("hiding_length")(lambda W, H, Hkv, size, peak, bw, causal: _hl()(W, H, Hkv, size, peak, bw, causal) * 8)  # bits


@alternative("hiding_length")
def hiding_length_by_times(world_size, heads, kv_heads, itemsize, peak_flops, bandwidth, causal):
    # the time per token of compute grows like c, of transfer stays fixed: find the c where they meet
    compute_per_c2 = 4 * 128 * heads * (0.5 if causal else 1) / peak_flops  # d = 128, any d gives the same c
    transfer_per_c = 2 * 128 * kv_heads * itemsize / bandwidth
    return world_size * transfer_per_c / compute_per_c2


globals().update(LESSON.standard_tests())
