"""A zoo of tiny models for end-to-end tests. `build(name, seed, dtype, batch)` returns a `Case`:
the model, one batch of `batch` rows of inputs (positional and keyword), the target and the loss
function, all made deterministically from `seed`; floating-point parameters and inputs are cast to
`dtype`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss

BATCH = 8  # divisible by most microbatch counts the tests use (1, 2, 4; `batch_for` the others)


def batch_for(microbatches: int) -> int:
    """`BATCH` rows where they split into `microbatches`, else the fewest whole microbatches above it."""
    return BATCH if BATCH % microbatches == 0 else microbatches * -(-BATCH // microbatches)


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
        """The unpipelined loss of the whole batch (on `model`, default the case's own); for a
        loss_fn returning (loss_sum, count), sum / count."""
        loss = self.loss_fn((model or self.model)(*self.args, **self.kwargs), self.target)
        return loss[0] / loss[1] if isinstance(loss, tuple) else loss

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


class RMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * weight`, written out (no fused op)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaBlock(nn.Module):
    """Pre-norm attention with rotary embeddings computed in the forward from `arange`, and a
    SwiGLU MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.mlp_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        head_dim = hidden // self.heads
        inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=x.device) / head_dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=x.device), inverse)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(batch, seq, self.heads, head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        causal = torch.triu(torch.full((seq, seq), float("-inf"), dtype=x.dtype, device=x.device), 1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / head_dim**0.5 + causal, dim=-1)
        x = x + self.o((weights @ v).transpose(1, 2).reshape(batch, seq, hidden))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaStyle(nn.Module):
    """A plain nn.Module Llama: embedding, `LlamaBlock`s, a final RMSNorm and an untied head."""

    def __init__(self, vocab: int = 64, hidden: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaBlock(hidden, heads) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


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


def _mlp(generator: torch.Generator, batch: int) -> Case:
    model = MLP()
    x = torch.randn(batch, 6, generator=generator)
    target = torch.randn(batch, 4, generator=generator)
    return Case("mlp", model, (x,), {}, target, F.mse_loss)


def _gpt(generator: torch.Generator, batch: int) -> Case:
    config = GPT_CONFIG
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=generator)
    target = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=generator)
    return Case("gpt", model, (tokens,), {}, target, lm_loss)


def summed_lm_loss(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token losses, count of tokens) over the targets other than -100."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"), (target != -100).sum()


def _padded_gpt(generator: torch.Generator, batch: int) -> Case:
    """The GPT with targets padded (-100) to a different length in every row: each half and each
    quarter of the batch holds a different number of tokens."""
    case = _gpt(generator, batch)
    for row, valid in enumerate((1, 8, 2, 7, 3, 3, 5, 0)):
        case.target[row, valid:] = -100
    return Case("padded-gpt", case.model, case.args, {}, case.target, summed_lm_loss)


def _convnet(generator: torch.Generator, batch: int) -> Case:
    model = ResidualConvNet()
    x = torch.randn(batch, 3, 8, 8, generator=generator)
    target = torch.randint(0, 5, (batch,), generator=generator)
    return Case("convnet", model, (x,), {}, target, F.cross_entropy)


def _masked(generator: torch.Generator, batch: int) -> Case:
    model = MaskedSharedMLP()
    x = torch.randn(batch, 6, generator=generator)
    mask = (torch.rand(batch, 12, generator=generator) > 0.3).float()
    target = torch.randn(batch, 3, generator=generator)
    return Case("masked", model, (x,), {"mask": mask, "scale": 0.5}, target, F.mse_loss)


def _llama(generator: torch.Generator, batch: int) -> Case:
    model = LlamaStyle()
    tokens = torch.randint(0, 64, (batch, 8), generator=generator)
    target = torch.randint(0, 64, (batch, 8), generator=generator)
    return Case("llama", model, (tokens,), {}, target, lm_loss)


BUILDERS: dict[str, Callable[[torch.Generator, int], Case]] = {
    "mlp": _mlp,
    "gpt": _gpt,
    "convnet": _convnet,
    "masked": _masked,
}
NAMES = tuple(BUILDERS)
# models outside the zoo (built by `build` too, not run by every zoo test); padded-gpt: a
# (loss_sum, count) loss over padded targets
EXTRA_BUILDERS: dict[str, Callable[[torch.Generator, int], Case]] = {"llama": _llama, "padded-gpt": _padded_gpt}


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, batch: int = BATCH) -> Case:
    """The zoo entry `name` (one of `NAMES`, or of `EXTRA_BUILDERS`) with `batch` rows, the same
    for the same seed and dtype."""
    torch.manual_seed(seed)  # parameter initialisation
    generator = torch.Generator().manual_seed(seed + 1)  # data
    return _finish({**BUILDERS, **EXTRA_BUILDERS}[name](generator, batch), dtype)


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


def microbatch_by_microbatch(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn, microbatches: int
) -> torch.Tensor:
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

