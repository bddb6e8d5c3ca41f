"""Every kernel's outputs on fixed inputs, hashed: run before and after a change that must not alter a bit.

    python benchmarks/experiments/kernel_bits.py new.json                      # this checkout
    PYTHONPATH=/path/to/old/checkout python benchmarks/experiments/kernel_bits.py old.json
    python benchmarks/experiments/kernel_bits.py --compare old.json new.json [old_again.json]
    python benchmarks/experiments/kernel_bits.py new_0.json --shard 0/2   # half the cases (with --shard 1/2)
    python benchmarks/experiments/kernel_bits.py --compare old_0.json,old_1.json new_0.json,new_1.json

48 cases: every variant and precision, forward and backward, the library's options, GQA, split-KV, varlen,
decoding and the paged cache, on tiny shapes (they run in the simulator too: NUMBA_ENABLE_CUDASIM=1). Each
output is hashed on its own. On a GPU the register backward adds dQ with atomics, in whatever order blocks
finish: pass a second run of the old checkout, and outputs that differ between its two runs are left out.
"""
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an old checkout there wins
import flashlab.kernels as K  # noqa: E402
from flashlab.kernels import paged as P  # noqa: E402

def h(a):
    a = np.ascontiguousarray(np.asarray(a))
    return hashlib.sha256(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes()).hexdigest()[:16]


def qkv(seed, B, H, nq, nk, d, dtype, H_kv=None):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, nq, d)).astype(dtype), rng.standard_normal((B, H_kv or H, nk, d)).astype(dtype),
            rng.standard_normal((B, H_kv or H, nk, d)).astype(dtype))


OPTIONS = {"window": dict(window_size=(5, 2)), "alibi": dict(alibi_slopes=np.array([0.5, 0.25], np.float32)),
           "softcap": dict(softcap=3.0), "dropout": dict(dropout_p=0.2, seed=7),
           "bottom_right": dict(window_size=(4, 0), align="bottom_right")}


def forward(data_seed, shape, dtype, h_kv=None, **kw):
    return lambda: K.flash_attention(*qkv(data_seed, *shape, dtype, H_kv=h_kv), **kw)


def backward(variant, dtype, options):
    q, k, v = qkv(5, 1, 2, 18, 21, 16, dtype)
    o, lse = K.flash_attention(q, k, v, causal=True, variant="register" if dtype == np.float32 else "tensor", **options)
    do = np.random.default_rng(6).standard_normal(q.shape).astype(dtype)
    return K.flash_attention_backward(q, k, v, o.astype(dtype), lse, do, causal=True, variant=variant, **options)


def varlen(variant, grads=False):
    rng = np.random.default_rng(8)
    cu = np.array([0, 7, 20, 25], np.int32)
    q, k, v = (rng.standard_normal((25, 2, 16)).astype(np.float16) for _ in range(3))
    o, lse = K.flash_attention_varlen(q, k, v, cu, cu, causal=True, variant=variant)
    if not grads:
        return o, lse
    do = rng.standard_normal(q.shape).astype(np.float16)
    return K.flash_attention_varlen_backward(q, k, v, o, lse, do, cu, cu, causal=True)


def paged(variant):
    rng = np.random.default_rng(10)
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((6, 8, 2, 16)).astype(np.float16) for _ in range(2))
    table, lengths = np.array([[0, 2, 4], [1, 3, 5]], np.int32), np.array([19, 11], np.int32)
    return P.paged_decoding(q, k_cache, v_cache, table, lengths, num_splits=2, variant=variant)


def paged_ragged(causal, nq, h, h_kv, dtype):
    """The register paged kernel on sequences of 13, 1 and 0 keys in pages of 4 (pages out of order), 3 splits."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((3, h, nq, 16)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((10, 4, h_kv, 16)).astype(dtype) for _ in range(2))
    table = np.array([[7, 2, 9, 0], [4, 1, 1, 1], [3, 3, 3, 3]], np.int32)
    lengths = np.array([13, 1, 0], np.int32)
    return P.paged_decoding(q, k_cache, v_cache, table, lengths, causal=causal, num_splits=3, variant="register")


def cases():
    """(name, function returning the outputs) for each case."""
    for variant, dtype in [("shared", np.float32), ("register", np.float32), ("register", np.float16),
                           ("tensor", np.float16), ("tensor", np.float32)]:
        for causal in (False, True):
            yield (f"fwd {variant} {np.dtype(dtype).name} causal={causal}",
                   forward(1, (1, 2, 19, 23, 16), dtype, causal=causal, variant=variant))
    for variant in ("register", "tensor"):
        for name, options in OPTIONS.items():
            yield f"fwd {variant} f16 {name}", forward(2, (1, 2, 21, 17, 16), np.float16, causal=True, variant=variant,
                                                       **options)
    yield "fwd register gqa", forward(3, (1, 4, 9, 13, 16), np.float32, h_kv=2, causal=True)
    yield "fwd register split", forward(4, (1, 1, 9, 70, 16), np.float32, splits=3)
    for variant, dtype in [("register", np.float32), ("register", np.float16), ("tensor", np.float16),
                           ("tensor", np.float32)]:
        for name in ("plain", "alibi", "dropout", "window"):
            yield (f"bwd {variant} {np.dtype(dtype).name} {name}",
                   lambda v=variant, dt=dtype, n=name: backward(v, dt, OPTIONS.get(n, {})))
    yield "varlen register", lambda: varlen("register")
    yield "varlen tensor", lambda: varlen("tensor")
    yield "varlen backward", lambda: varlen("register", grads=True)
    yield "decoding", lambda: K.flash_decoding(*qkv(9, 1, 2, 1, 50, 16, np.float32), num_splits=3)
    yield "paged register", lambda: paged("register")
    yield "paged tensor", lambda: paged("tensor")
    yield "decoding nq=3 f16 d32", lambda: K.flash_decoding(*qkv(12, 2, 1, 3, 37, 32, np.float16), num_splits=2)
    yield "paged register gqa causal nq=3", lambda: paged_ragged(True, 3, 4, 2, np.float32)
    yield "paged register gqa nq=2 f16", lambda: paged_ragged(False, 2, 6, 2, np.float16)
    yield "paged register mha causal nq=1", lambda: paged_ragged(True, 1, 2, 2, np.float32)


def compare(before, after, again=None):
    """The (case, output) pairs that differ, leaving out those that differ between two runs of `before`."""
    differ = []
    for case, hashes in before.items():
        for i, x in enumerate(hashes):
            if again is not None and again[case][i] != x:
                continue  # not repeatable on this machine (atomics)
            if after.get(case, [None] * len(hashes))[i] != x:
                differ.append(f"{case} [output {i}]")
    return differ


def load(paths: str) -> dict:
    """One run's hashes from its JSON files (comma-separated: the shards of one run)."""
    got = {}
    for p in paths.split(","):
        got.update(json.loads(Path(p).read_text()))
    return got


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        runs = [load(p) for p in sys.argv[2:]]
        errors = {case: v for run in runs for case, v in run.items() if isinstance(v, str)}
        runs = [{c: v for c, v in run.items() if c not in errors} for run in runs]
        differ = compare(runs[0], runs[1], runs[2] if len(runs) > 2 else None)
        n = sum(len(v) for v in runs[0].values())
        print(f"{len(runs[0])} cases, {n} outputs: " + ("identical" if not differ else f"DIFFERENT: {differ}"))
        for case, message in sorted(errors.items()):
            print(f"not compared, {case}: {message}")
        sys.exit(1 if differ else 0)
    # out.json [--shard i/n]: the cases i, i + n, i + 2n, ... (0-based), so that n processes share the work. The
    # file is rewritten after every case, so a run stopped at a time limit keeps what it finished; a case that
    # raises (one an old checkout lacks) is recorded as its error and left out of the comparison.
    shard, shards = (int(x) for x in sys.argv[3].split("/")) if sys.argv[2:3] == ["--shard"] else (0, 1)
    got = {}
    for i, (name, run) in enumerate(cases()):
        if i % shards != shard:
            continue
        t = time.time()
        try:
            res = run()
            got[name] = [h(x) for x in (res if isinstance(res, tuple) else (res,))]
        except Exception as exc:  # noqa: BLE001 - recorded, not hidden: --compare lists it
            got[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        print(f"{time.time() - t:6.1f} s  {' '.join(got[name]) if isinstance(got[name], list) else got[name]}  {name}",
              flush=True)
        Path(sys.argv[1]).write_text(json.dumps(got, indent=1))
