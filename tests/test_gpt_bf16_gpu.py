"""Lesson 13's GPT trained in bf16 mixed precision on a GPU: flashlab's attention against torch's SDPA.

Same initial weights, seed and batches; the loss curves must match within flashlab.gpt.BF16_LOSS_TOLERANCE (the
tolerance lesson 13 states), both runs must learn, and the same comparison must fail an attention whose backward
forgets dQ and dK, so the test can fail. Skips without a CUDA GPU. Under a minute on an H100, most of it
flashlab's kernels compiling; benchmarks/generators/gpt_bf16.py runs the larger version lesson 13 shows.
"""
import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import flashlab  # noqa: E402
from flashlab import gpt  # noqa: E402
from flashlab.torch import scaled_dot_product_attention as flash_sdpa  # noqa: E402


def _gpu_ready():
    return torch.cuda.is_available() and flashlab.device.has_gpu() and torch.cuda.is_bf16_supported()


gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU with bf16 (torch.cuda and numba-cuda)")

# Head dim 64 as in the benchmark, smaller elsewhere. On the CPU under bf16 autocast this setup learns to copy
# (loss about 1.06) within its 200 steps, a second correct attention stays 0.0013 nats from torch's, and
# attention without dQ, dK ends 0.9 nats away.
SETUP = {**gpt.BF16_SETUP, "n_layer": 2, "n_head": 2, "n_embd": 128, "block_size": 128, "batch_size": 16,
         "steps": 200, "lr": 3e-3, "warmup": 10, "text_chars": 50_000}


def flash_without_dq_dk(q, k, v, is_causal=False):
    """flashlab's forward, exact; but only v gets a gradient, as if its backward returned dQ = dK = 0."""
    return flash_sdpa(q.detach(), k.detach(), v, is_causal=is_causal)


@pytest.mark.gpu
@gpu
def test_bf16_training_on_flashlab_matches_torch_sdpa():
    runs = gpt.compare_attention({"torch": F.scaled_dot_product_attention, "flashlab": flash_sdpa,
                                  "without dQ, dK": flash_without_dq_dk}, SETUP, device="cuda",
                                 autocast_dtype=torch.bfloat16, progress=False)["runs"]
    ref, ours, broken = (runs[n]["losses"] for n in ("torch", "flashlab", "without dQ, dK"))
    gap, broken_gap = gpt.loss_gap(ours, ref), gpt.loss_gap(broken, ref)
    assert gap <= gpt.BF16_LOSS_TOLERANCE, f"flashlab's bf16 loss curve is {gap:.4f} nats from torch's"
    assert broken_gap > gpt.BF16_LOSS_TOLERANCE, f"a backward without dQ, dK passed: gap {broken_gap:.4f} nats"
    uniform = math.log(gpt.CharTokenizer(gpt.TINY_TEXT).vocab_size)
    for name, losses in (("torch", ref), ("flashlab", ours)):
        final = sum(losses[-20:]) / 20
        assert final < uniform - 1.0, f"{name} did not learn: final loss {final:.3f}, log(vocab) = {uniform:.3f}"
    assert all(r["tokens_per_s"] > 0 for r in runs.values())
