"""A tiny GPT-style language model whose attention can be swapped (lesson 13).

Character-level, a few layers, a tiny width: small enough to train for a few steps on a CPU in seconds,
and a real model in every part that matters here (token + position embeddings, pre-norm blocks of causal
multi-head self-attention and an MLP, a language-model head, cross-entropy on the next character).

Every attention layer calls `self.attention(q, k, v, is_causal=True)`; `model.use_attention(fn)` swaps
that function in all layers, e.g. for `flashlab.torch.scaled_dot_product_attention`.

This module imports torch; `import flashlab` does not import it.
"""
from __future__ import annotations

from dataclasses import dataclass

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
          progress: bool = True):
    """AdamW on random windows of data for `steps` steps; returns the loss of every step."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    steps_iter = range(steps)
    if progress:
        from tqdm.auto import tqdm

        steps_iter = tqdm(steps_iter, desc="training", leave=False)
    for _ in steps_iter:
        x, y = get_batch(data, model.cfg.block_size, batch_size, gen)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
