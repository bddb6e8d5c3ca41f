"""A tiny GPT-style language model whose attention can be swapped (lesson 13).

Character-level, a few layers, a tiny width: small enough to train for a few steps on a CPU in seconds,
and a real model in every part that matters here (token + position embeddings, pre-norm blocks of causal
multi-head self-attention and an MLP, a language-model head, cross-entropy on the next character).

Every attention layer calls `self.attention(q, k, v, is_causal=True)`; `model.use_attention(fn)` swaps
that function in all layers, e.g. for `flashlab.torch.scaled_dot_product_attention`.

`compare_attention` trains one copy of a model per attention function from the same weights on the same batches,
in bf16 mixed precision on a GPU, and times each; `loss_gap` and BF16_LOSS_TOLERANCE judge whether two loss
curves match (benchmarks/generators/gpt_bf16.py, tests/test_gpt_bf16*.py, lesson 13).

This module imports torch; `import flashlab` does not import it.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# A few lines written for this course (no download needed): the model learns to continue them.
TINY_TEXT = """\
The lamp was small and the room was dark, so the girl read one line at a time.
She kept the last word in her head and the sum of what she had read in her hand.
When a new line was brighter than all before it, she let the old light fade a little
and carried on, and when the book was done she knew the whole story at once.
The slow way was to copy every page onto the floor, read them all, and sweep them up again.
The fast way was to keep only what she needed: the largest number, a running sum, and the answer.
"""


def copy_text(n_chars: int, seed: int = 0) -> str:
    """A deterministic text of n_chars characters in TINY_TEXT's alphabet, long enough for long blocks.

    Each line is a few random words of TINY_TEXT said twice ("lamp the sum read. lamp the sum read."): the first
    half is a guess at the word level, the second can be predicted only by attending back to the first, so a
    model that learns it needs its attention (and a broken attention shows in the loss).
    """
    if not (isinstance(n_chars, int) and n_chars > 0):
        raise ValueError(f"n_chars must be a positive int; got {n_chars!r}")
    words = sorted(set(re.findall(r"[a-z]+", TINY_TEXT.lower())))
    rng = random.Random(seed)  # Python's own generator: the same text on every platform and torch version
    lines, total = [], 0
    while total < n_chars:
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 7)))
        lines.append(f"{sentence}. {sentence}.\n")
        total += len(lines[-1])
    return "".join(lines)[:n_chars]


class CharTokenizer:
    """Characters <-> integers, one id per distinct character of a text."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        missing = sorted(set(text) - set(self.index))
        if missing:
            raise ValueError(f"characters not in the vocabulary: {missing!r}")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 32  # the longest context (N)
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32  # d_model; each head has d = n_embd / n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attention = F.scaled_dot_product_attention

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, N, C) -> (B, heads, N, d): the layout every attention function in the course takes
        q, k, v = (t.view(B, N, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def use_attention(self, fn):
        """Make every layer call fn(q, k, v, is_causal=True) for its attention. Returns the model."""
        for block in self.blocks:
            block.attn.attention = fn
        return self

    def forward(self, idx, targets=None):
        """Logits (B, N, vocab) for token ids idx (B, N); and the mean cross-entropy when targets are given."""
        B, N = idx.shape
        if N > self.cfg.block_size:
            raise ValueError(f"sequence length {N} exceeds block_size {self.cfg.block_size}")
        x = self.tok(idx) + self.pos(torch.arange(N, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx, n_new: int, generator=None, temperature: float = 1.0):
        """Append n_new sampled tokens to idx (B, N), one at a time."""
        for _ in range(n_new):
            logits, _ = self(idx[:, -self.cfg.block_size:])
            probs = F.softmax(logits[:, -1] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def get_batch(data: torch.Tensor, block_size: int, batch_size: int, generator=None):
    """Random windows of the text: inputs x (B, N) and the next characters y (B, N)."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + block_size] for s in starts])
    y = torch.stack([data[s + 1:s + block_size + 1] for s in starts])
    return x, y


def train(model: GPT, data: torch.Tensor, steps: int, batch_size: int = 16, lr: float = 1e-2, seed: int = 0,
          progress: bool = True, *, autocast_dtype=None, grad_clip: float | None = None, on_step=None,
          desc: str = "training"):
    """AdamW on random windows of data for `steps` steps; returns the loss of every step.

    The windows are drawn on the CPU from `seed` (the same batches for every model given the same seed) and moved
    to the model's device. autocast_dtype (e.g. torch.bfloat16) runs the forward pass and the loss under
    torch.autocast: mixed precision, with the weights, their gradients and AdamW's state in float32.
    grad_clip clips the gradients' global norm; on_step(step) is called after each optimiser step (timing).
    """
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    steps_iter = range(steps)
    if progress:
        from tqdm.auto import tqdm

        steps_iter = tqdm(steps_iter, desc=desc, leave=False)
    for step in steps_iter:
        x, y = get_batch(data, model.cfg.block_size, batch_size, gen)
        x, y = x.to(device), y.to(device)
        with (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
              else contextlib.nullcontext()):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(loss.detach())  # no .item() here: it would wait for the GPU at every step
        if on_step is not None:
            on_step(step)
    return torch.stack(losses).float().tolist() if losses else []


# ------------------------------------------------------------------ bf16 mixed precision: two attentions, one run
#: How far apart the loss curves of two correct attention implementations may drift in bf16 mixed precision:
#: the largest |moving average over BF16_LOSS_WINDOW steps of (loss_a - loss_b)|, in nats (see loss_gap).
#: Chosen on the CPU, under torch.autocast(bfloat16), on copy_text: GPTs of 2 and 4 layers (d = 64) trained
#: 150-400 steps with torch's SDPA and with two other correct attentions (a softmax in float32 between bf16
#: matmuls; torch's SDPA with relative noise of 2^-8, larger than a bf16 rounding, added to q, k, v, the output
#: and every gradient) stayed within 0.006 (2 layers) and 0.013 nats (4 layers) of it, the largest gaps where the
#: loss falls fastest. Attention whose q and k get no gradient, or that returns v, ended 0.1 to 1 nat away, the
#: more the further the model had learned to copy. 0.05 leaves correct pairs a margin of about 4x and fails
#: broken ones; tests/test_gpt_bf16.py keeps both sides of that on the CPU, tests/test_gpt_bf16_gpu.py on a GPU.
BF16_LOSS_TOLERANCE = 0.05
BF16_LOSS_WINDOW = 10

#: The comparison lesson 13 quotes (benchmarks/generators/gpt_bf16.py): model (head dim n_embd / n_head = 64), text and
#: training. About a minute for three runs on an H100, most of it flashlab's kernels compiling.
BF16_SETUP = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 1024, "batch_size": 8, "steps": 300,
              "lr": 2e-3, "grad_clip": 1.0, "warmup": 10, "text_chars": 200_000, "seed": 0}
#: A step bound by the GPU, not by the host (gpt_bf16.py --gpu-bound, profile_gpt_bf16.py --gpu-bound): head dim
#: 128 and 4096 tokens a sequence, so attention takes about 40% of the FLOPs and the kernels, not the Python around
#: them, set tokens/s. BF16_SETUP's step is host-bound: its wall time is its host time.
BF16_GPU_BOUND_SETUP = {**BF16_SETUP, "n_layer": 4, "n_head": 4, "n_embd": 512, "block_size": 4096, "batch_size": 4,
                        "steps": 100, "warmup": 10}
#: The measurement benchmarks/generators/gpt_bf16.py writes (package data, so a pip-installed flashlab finds it).
BF16_JSON = Path(__file__).resolve().parent / "data" / "gpt_bf16.json"
#: Names of the runs in that file, and how figures label them.
RUN_LABELS = {"torch": "torch SDPA", "flashlab": "flashlab", "torch_again": "torch SDPA, again"}


def moving_average(x, window: int = BF16_LOSS_WINDOW) -> list:
    """Means of every `window` consecutive values of x (len(x) - window + 1 of them)."""
    x = [float(v) for v in x]
    if not (isinstance(window, int) and 1 <= window <= len(x)):
        raise ValueError(f"window must be an int from 1 to len(x) = {len(x)}; got {window!r}")
    sums = [0.0]
    for v in x:
        sums.append(sums[-1] + v)
    return [(sums[i + window] - sums[i]) / window for i in range(len(x) - window + 1)]


def loss_gap(a, b, window: int = BF16_LOSS_WINDOW) -> float:
    """max over steps of |moving average of (a - b)|: how far apart two loss curves of the same batches drift.

    Both runs see the same batches, so the batch-to-batch noise of the loss cancels in a - b; the average over
    `window` steps removes rounding jitter but not a trend. inf when either run has a non-finite loss.
    """
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) != len(b):
        raise ValueError(f"the two loss curves must have the same length; got {len(a)} and {len(b)}")
    if not all(map(math.isfinite, a + b)):
        return math.inf
    return max(abs(v) for v in moving_average([x - y for x, y in zip(a, b)], window))


def compare_attention(attentions: dict, setup: dict | None = None, *, device="cpu", autocast_dtype=None,
                      progress: bool = True) -> dict:
    """Train one GPT per attention function (name -> fn(q, k, v, is_causal)) from the same initial weights, on
    the same batches of copy_text, and time each run.

    setup: BF16_SETUP's keys (default BF16_SETUP); autocast_dtype: e.g. torch.bfloat16 for mixed precision.
    Returns {"device", "dtype", "config", "training", "runs": {name: {"label", "losses", "tokens_per_s",
    "first_step_s"}}}. tokens/s counts the steps after setup["warmup"] (flashlab's kernels compile on their
    first call), timed with time.perf_counter after torch.cuda.synchronize(); first_step_s includes compiling.
    """
    setup = dict(BF16_SETUP if setup is None else setup)
    missing, extra = set(BF16_SETUP) - set(setup), set(setup) - set(BF16_SETUP)
    if missing or extra:
        raise ValueError(f"setup must have the keys of BF16_SETUP; missing {sorted(missing)}, unknown {sorted(extra)}")
    steps, warmup = setup["steps"], setup["warmup"]
    if not 0 <= warmup < steps:
        raise ValueError(f"setup['warmup'] must be at least 0 and below steps = {steps}; got {warmup!r}")
    tok = CharTokenizer(TINY_TEXT)
    data = tok.encode(copy_text(setup["text_chars"], setup["seed"]))
    if len(data) < setup["block_size"] + 2:
        raise ValueError(f"setup['text_chars'] = {setup['text_chars']} is too short for block_size "
                         f"{setup['block_size']}: get_batch needs at least block_size + 2 characters")
    cfg = GPTConfig(tok.vocab_size, setup["block_size"], setup["n_layer"], setup["n_head"], setup["n_embd"])
    device = torch.device(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.manual_seed(setup["seed"])
    start = GPT(cfg).state_dict()
    runs = {}
    for name, fn in attentions.items():
        model = GPT(cfg).to(device)
        model.load_state_dict(start)
        model.use_attention(fn)
        marks = {}

        def on_step(step):
            if step in (0, warmup - 1, steps - 1):
                sync()
                marks[step] = time.perf_counter()

        sync()
        marks[-1] = time.perf_counter()
        losses = train(model, data, steps, setup["batch_size"], setup["lr"], setup["seed"], progress,
                       autocast_dtype=autocast_dtype, grad_clip=setup["grad_clip"], on_step=on_step,
                       desc=RUN_LABELS.get(name, name))
        seconds = marks[steps - 1] - marks[warmup - 1]
        runs[name] = {"label": RUN_LABELS.get(name, name), "losses": [round(v, 5) for v in losses],
                      "tokens_per_s": round((steps - warmup) * setup["batch_size"] * cfg.block_size / seconds, 1),
                      "first_step_s": round(marks[0] - marks[-1], 3)}
        del model
    return {"device": str(device), "dtype": str(autocast_dtype or torch.float32).replace("torch.", ""),
            "config": {**asdict(cfg), "head_dim": cfg.n_embd // cfg.n_head},
            "training": {k: setup[k] for k in ("steps", "warmup", "batch_size", "lr", "grad_clip", "seed",
                                                "text_chars")},
            "runs": runs}


BF16_TOP = ("source", "date", "gpu", "versions", "device", "dtype", "config", "training", "tolerance", "runs")


def check_bf16_run(record: dict) -> dict:
    """Raise ValueError naming what is wrong when `record` lacks gpt_bf16.json's layout; return it."""
    if not isinstance(record, dict):
        raise ValueError(f"a bf16 run must be a JSON object; got {type(record).__name__}")
    problems = []
    if set(record) != set(BF16_TOP):
        problems.append(f"top-level keys {sorted(record)}, expected {sorted(BF16_TOP)}")
    runs = record.get("runs")
    steps = (record.get("training") or {}).get("steps")
    if not isinstance(runs, dict) or not {"torch", "flashlab"} <= set(runs):
        problems.append(f"'runs' must hold at least 'torch' and 'flashlab'; got {runs!r:.80}")
    else:
        for name, run in runs.items():
            losses = run.get("losses") if isinstance(run, dict) else None
            if not isinstance(losses, list) or len(losses) != steps:
                problems.append(f"runs[{name!r}]['losses'] must be a list of training.steps = {steps} losses")
            elif not isinstance(run.get("tokens_per_s"), (int, float)) or not run["tokens_per_s"] > 0:
                problems.append(f"runs[{name!r}]['tokens_per_s'] must be a positive number; got "
                                f"{run.get('tokens_per_s')!r}")
    if problems:
        raise ValueError("not a gpt_bf16.json record: " + "; ".join(problems))
    return record


def load_bf16_run(path=None) -> dict | None:
    """The committed bf16 comparison (benchmarks/generators/gpt_bf16.py), checked; None when it has not been measured yet."""
    path = Path(path) if path else BF16_JSON
    if not path.exists():
        return None
    with open(path) as f:
        return check_bf16_run(json.load(f))
