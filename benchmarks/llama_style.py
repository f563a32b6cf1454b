"""A Llama-style decoder for the CPU benchmarks, beside the zoo GPT: RMSNorm, rotary position
embeddings computed inside each attention's forward, a SwiGLU MLP, an untied LM head; and the
chunks torch.distributed.pipelining runs it in (`chunk`).

    model = llama_style(vocab=512, seq_len=128, hidden=256, heads=4, layers=8)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of `x` [batch, heads, seq, dim], the angles computed here."""
    seq, dim = x.shape[-2], x.shape[-1]
    inverse = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inverse)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)

        q, k, v = rotate(split(self.q(x))), rotate(split(self.k(x))), split(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, seq, hidden))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(hidden), Attention(hidden, heads)
        self.mlp_norm, self.mlp = RMSNorm(hidden), SwiGLU(hidden, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaStyle(nn.Module):
    """`forward(tokens[batch, seq]) -> logits[batch, seq, vocab]`."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, inner: int | None = None) -> None:
        super().__init__()
        inner = inner or 64 * round(8 * hidden / 3 / 64)  # SwiGLU's 2/3 of 4 x hidden, in 64s
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, inner) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def llama_style(settings: Any) -> LlamaStyle:
    """The model of `settings`' vocab, hidden, heads and layers, its weights from seed 0."""
    torch.manual_seed(0)
    return LlamaStyle(settings.vocab, settings.hidden, settings.heads, settings.layers)


class Chunk(nn.Module):
    """Blocks [lo, hi) of a `LlamaStyle`, with the embedding in front on the first chunk and the
    final norm and head behind on the last one (the model's own modules)."""

    def __init__(self, model: LlamaStyle, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed = model.embed
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        if last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.last else x
