"""Model factories for `zbcompile plan module:function` (tests/e2e/test_plan.py); called under
`torch.device("meta")`."""

from __future__ import annotations

import torch

from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss


def tiny_gpt() -> dict:
    """A two-layer GPT with its batch and loss, as the factory contract's dict."""
    tokens = torch.zeros(4, 16, dtype=torch.long)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=2))
    return {"model": model, "inputs": (tokens,), "target": tokens, "loss_fn": lm_loss}
