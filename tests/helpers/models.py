"""A zoo of tiny models for end-to-end tests. `build(name, seed, dtype)` returns a `Case`: the
model, one batch of inputs (positional and keyword), the target and the loss function, all made
deterministically from `seed`; floating-point parameters and inputs are cast to `dtype`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss

BATCH = 8  # divisible by every microbatch count the tests use (1, 2, 4)


@dataclass
class Case:
    """One model with one batch: `loss_fn(model(*args, **kwargs), target)` is the loss."""

    name: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: torch.Tensor
    loss_fn: Callable[..., torch.Tensor]

    def eager_loss(self, model: nn.Module | None = None) -> torch.Tensor:
        """The unpipelined loss of the whole batch (on `model`, default the case's own)."""
        return self.loss_fn((model or self.model)(*self.args, **self.kwargs), self.target)

    def step(self, pipe: Any) -> torch.Tensor:
        """One pipelined step on this batch."""
        return pipe.step(*self.args, target=self.target, **self.kwargs)

    def share(self, replicas: int, replica: int) -> "Case":
        """The case with data-parallel replica `replica`'s share of the batch (the `replica`-th of
        `replicas` equal slices along dim 0, as a DistributedSampler without shuffling gives)."""
        return replace(
            self, args=tuple(share(a, replicas, replica) for a in self.args),
            kwargs={k: share(v, replicas, replica) for k, v in self.kwargs.items()},
            target=share(self.target, replicas, replica),
        )


def share(value: Any, replicas: int, replica: int) -> Any:
    """A tensor's `replica`-th of `replicas` equal slices along dim 0; anything else as it is."""
    return value.chunk(replicas)[replica] if isinstance(value, torch.Tensor) else value


# --- models --------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Four Linear layers with tanh, GELU and SiLU in between (deep enough for 8 stages)."""

    def __init__(self, inputs: int = 6, hidden: int = 16, outputs: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.fc4 = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc4(F.silu(self.fc3(F.gelu(self.fc2(torch.tanh(self.fc1(x)))))))


class ResidualConvNet(nn.Module):
    """Conv -> GroupNorm -> ReLU -> max-pool, a residual conv block, global average pool, Linear."""

    def __init__(self, channels: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(2, channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.norm1(self.stem(x))), 2)
        h = h + F.relu(self.norm2(self.conv(h)))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


class MaskedSharedMLP(nn.Module):
    """Two inputs (`mask` is keyword-only), a non-tensor constant (`scale`) and one Linear
    (`mix`) applied at two places. The mask is read at the start and at the end, so a pipeline
    has to carry it through every stage."""

    def __init__(self, inputs: int = 6, hidden: int = 12, outputs: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(inputs, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = torch.tanh(self.proj(x)) * mask
        h = F.gelu(self.mix(h))
        h = F.gelu(self.mid(h))
        h = h + scale * self.mix(h)
        return self.out(h * mask)


GPT_CONFIG = GPTConfig(vocab_size=64, seq_len=8, hidden=16, heads=4, layers=2)


# --- cases ---------------------------------------------------------------------------------------


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _finish(case: Case, dtype: torch.dtype) -> Case:
    case.model = case.model.to(dtype)
    case.args = tuple(_cast(a, dtype) for a in case.args)
    case.kwargs = {k: _cast(v, dtype) for k, v in case.kwargs.items()}
    case.target = _cast(case.target, dtype)
    return case


def _mlp(generator: torch.Generator) -> Case:
    model = MLP()
    x = torch.randn(BATCH, 6, generator=generator)
    target = torch.randn(BATCH, 4, generator=generator)
    return Case("mlp", model, (x,), {}, target, F.mse_loss)


def _gpt(generator: torch.Generator) -> Case:
    config = GPT_CONFIG
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.seq_len), generator=generator)
    target = torch.randint(0, config.vocab_size, (BATCH, config.seq_len), generator=generator)
    return Case("gpt", model, (tokens,), {}, target, lm_loss)


def _convnet(generator: torch.Generator) -> Case:
    model = ResidualConvNet()
    x = torch.randn(BATCH, 3, 8, 8, generator=generator)
    target = torch.randint(0, 5, (BATCH,), generator=generator)
    return Case("convnet", model, (x,), {}, target, F.cross_entropy)


def _masked(generator: torch.Generator) -> Case:
    model = MaskedSharedMLP()
    x = torch.randn(BATCH, 6, generator=generator)
    mask = (torch.rand(BATCH, 12, generator=generator) > 0.3).float()
    target = torch.randn(BATCH, 3, generator=generator)
    return Case("masked", model, (x,), {"mask": mask, "scale": 0.5}, target, F.mse_loss)


BUILDERS: dict[str, Callable[[torch.Generator], Case]] = {
    "mlp": _mlp,
    "gpt": _gpt,
    "convnet": _convnet,
    "masked": _masked,
}
NAMES = tuple(BUILDERS)


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Case:
    """The zoo entry `name` (one of `NAMES`), the same for the same seed and dtype."""
    torch.manual_seed(seed)  # parameter initialisation
    generator = torch.Generator().manual_seed(seed + 1)  # data
    return _finish(BUILDERS[name](generator), dtype)


# --- models whose forward updates buffers (outside the zoo: eager reference runs microbatch by
# microbatch) ------------------------------------------------------------------------------------


class BatchNormConvNet(nn.Module):
    """Two Conv2d -> BatchNorm2d -> ReLU blocks and a linear head; in train mode every forward
    updates the running statistics (and num_batches_tracked)."""

    def __init__(self, channels: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.head = nn.Linear(channels * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.max_pool2d(self.block2(self.block1(x)), 2).flatten(1))


def image_batch(seed: int = 1, classes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH 3x8x8 images and class labels."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, 8, 8, generator=generator), torch.randint(0, classes, (BATCH,), generator=generator)


def snapshot(model: nn.Module, loss: torch.Tensor | None) -> dict:
    """Copies of the loss and of the gradients, parameters and buffers of `model`."""
    return {
        "loss": None if loss is None else loss.detach().clone(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def microbatch_by_microbatch(model: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn, microbatches: int) -> torch.Tensor:
    """What a pipelined step computes, eagerly: for each microbatch in order, its forward
    (updating the buffers) and `(loss / microbatches).backward()`; returns the mean loss."""
    losses = []
    for xs, ts in zip(x.chunk(microbatches), target.chunk(microbatches)):
        loss = loss_fn(model(xs), ts)
        (loss / microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def sgd_steps(model: nn.Module, step: Callable[[], torch.Tensor | None], steps: int, params=None) -> list[dict]:
    """`steps` times: zero the gradients, `step()`, SGD step (lr 0.1) on `params` (default:
    the model's), snapshot (the step's loss and gradients, the parameters after the update)."""
    optimizer = torch.optim.SGD(model.parameters() if params is None else params, lr=0.1)
    record = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = step()
        optimizer.step()
        record.append(snapshot(model, loss))
    return record

