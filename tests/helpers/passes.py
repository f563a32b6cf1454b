"""Small models traced for the direct tests of the compiler passes (`tests/passes`), and the
eager reference they are checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from helpers.models import MLP
from zbcompile.passes.trace import TracedModel, trace_model


@dataclass
class Traced:
    """A model, one batch (`x`, `target`), `traced` = trace_model of mse_loss(model(x), target)."""

    model: nn.Module
    x: torch.Tensor
    target: torch.Tensor
    traced: TracedModel

    def eager_loss(self) -> torch.Tensor:
        return F.mse_loss(self.model(self.x), self.target)


class TiedMLP(nn.Module):
    """Linear -> tanh -> Linear -> tanh -> Linear, the first and the last sharing one weight."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.middle = nn.Linear(width, width)
        self.head = nn.Linear(width, width)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.middle(torch.tanh(self.embed(x)))))


def traced(model: nn.Module, inputs: int, outputs: int, batch: int = 4, seed: int = 0) -> Traced:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, inputs, generator=generator)
    target = torch.randn(batch, outputs, generator=generator)
    return Traced(model, x, target, trace_model(model, F.mse_loss, (x,), {}, target))


def traced_mlp(seed: int = 0) -> Traced:
    """The zoo's four-layer MLP (6 -> 16 -> 16 -> 16 -> 4)."""
    torch.manual_seed(seed)
    return traced(MLP(), 6, 4, seed=seed)


def traced_tied(seed: int = 0) -> Traced:
    torch.manual_seed(seed)
    return traced(TiedMLP(), 6, 6, seed=seed)
