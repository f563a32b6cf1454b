"""A GPT-style decoder: token + position embeddings, causal self-attention through
`scaled_dot_product_attention`, pre-LayerNorm blocks with a GELU MLP, residuals, and an
LM head tied to the token embedding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    checkpoint: bool = False  # each block under torch.utils.checkpoint (recomputed in the backward)


class Embedding(nn.Embedding):
    """nn.Embedding initialised with std 0.02 (GPT-2), so that the tied LM head starts with
    small logits."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class CausalSelfAttention(nn.Module):
    """Causal self-attention. `qkv`'s output holds each head's query, key and value side by side,
    so that a column-wise tensor-parallel `qkv` (torch's `ColwiseParallel`) holds whole heads and
    the module computes its heads from the width it gets."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.hidden % config.heads:
            raise ValueError(f"hidden={config.hidden} must be divisible by heads={config.heads}")
        self.head_dim = config.hidden // config.heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, 4 * config.hidden)
        self.proj = nn.Linear(4 * config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """`forward(tokens[batch, seq]) -> logits[batch, seq, vocab]`."""

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = Embedding(config.vocab_size, config.hidden)
        self.pos_emb = Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.config.checkpoint else block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
