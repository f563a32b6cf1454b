"""Model types beyond the zoo: attention and transformer layers, convolutions and pools,
embeddings, in-place ops, long skips, several and non-differentiable inputs, structured outputs,
frozen, shared and keyword-named parameters, buffers and tensor constants, `torch.no_grad()`
regions, dropout, low precision. Each pipelined step must give the eager loss and gradients.

The eager reference is a forward of the whole batch, or, for models whose result depends on how
the batch is split (batch statistics, a mean over a varying number of tokens), the mean of the
per-microbatch eager losses: the contract of `step()` (see README, "mean over microbatches").
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zbcompile
from helpers.grads import FP32, assert_grads_close, grads_of
from zbcompile._torch_internals import pytree

BATCH = 8


@dataclass
class Model:
    """A model with one batch. `target_keyword`: the model computes its loss itself and takes the
    target as this keyword argument (loss_fn is None or picks the loss from its output)."""

    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple[tuple, dict, Any]]
    loss_fn: Callable | None = F.mse_loss
    per_microbatch: bool = False  # eager reference: mean of per-microbatch losses
    target_keyword: str | None = None
    tolerance: dict = field(default_factory=lambda: dict(FP32))
    reference_dtype: torch.dtype | None = None  # eager in this dtype (low-precision models)


def _batch(model: Model) -> tuple[tuple, dict, Any]:
    return model.inputs(torch.Generator().manual_seed(1))


def _eager_loss(module: nn.Module, model: Model, args: tuple, kwargs: dict, target: Any) -> torch.Tensor:
    if model.target_keyword:
        kwargs, target = {**kwargs, model.target_keyword: target}, None
    output = module(*args, **kwargs)
    return output if model.loss_fn is None else model.loss_fn(output, target)


def _chunk(tree: Any, microbatches: int) -> list[Any]:
    leaves, spec = pytree.tree_flatten(tree)
    return [
        pytree.tree_unflatten([x.chunk(microbatches)[i] if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        for i in range(microbatches)
    ]


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def check_matches_eager(
    model: Model, stages: int, microbatches: int, schedule: str, **pipeline_kwargs
) -> zbcompile.PipelinedModule:
    """One pipelined step against the eager reference (loss and every gradient)."""
    torch.manual_seed(0)
    module = model.build()
    reference = copy.deepcopy(module)
    args, kwargs, target = _batch(model)
    if model.reference_dtype is not None:
        reference = reference.to(model.reference_dtype)
    pipe = zbcompile.pipeline(
        module, stages=stages, microbatches=microbatches, loss_fn=model.loss_fn, schedule=schedule,
        solver_time_budget=0.2, **pipeline_kwargs,
    )
    if model.target_keyword:
        loss = pipe.step(*args, **{**kwargs, model.target_keyword: target})
    else:
        loss = pipe.step(*args, target=target, **kwargs)

    batch = (args, kwargs, target)
    if model.reference_dtype is not None:
        batch = _cast(batch, model.reference_dtype)
    if model.per_microbatch:
        parts = zip(*(_chunk(part, microbatches) for part in batch))
        eager = torch.stack([_eager_loss(reference, model, *part) for part in parts]).mean()
    else:
        eager = _eager_loss(reference, model, *batch)
    eager.backward()

    assert len(pipe.compiled.partition.stages) == stages
    torch.testing.assert_close(loss.to(eager.dtype), eager.detach(), **model.tolerance)
    expected, actual = grads_of(reference), grads_of(pipe)
    for fqn, grad in expected.items():
        if grad is None:  # frozen, unused or only used under no_grad: no gradient either way
            assert actual[fqn] is None, f"{fqn} has no eager gradient but got one"
    actual = {n: g if g is None else g.to(expected[n].dtype) for n, g in actual.items()}
    assert_grads_close(
        {n: g for n, g in actual.items() if expected[n] is not None},
        {n: g for n, g in expected.items() if g is not None},
        f"{schedule} S{stages} m{microbatches}",
        **model.tolerance,
    )
    return pipe


# --- models --------------------------------------------------------------------------------------


def _vector_inputs(features: int = 6, outputs: int = 3):
    def inputs(g: torch.Generator):
        return (torch.randn(BATCH, features, generator=g),), {}, torch.randn(BATCH, outputs, generator=g)

    return inputs


def _token_inputs(vocab: int, length: int = 6, extra: Callable | None = None):
    def inputs(g: torch.Generator):
        tokens = torch.randint(0, vocab, (BATCH, length), generator=g)
        kwargs = extra(g) if extra else {}
        return (tokens,), kwargs, torch.randint(0, vocab, (BATCH, length), generator=g)

    return inputs


def _token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class Encoder(nn.Module):
    """Embedding, two nn.TransformerEncoderLayers (causal mask + key padding mask), LM head."""

    def __init__(self, batch_first: bool, norm_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(
            16, 4, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first, activation="gelu"
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 20)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h if self.batch_first else h.transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=torch.bool)
        h = self.encoder(h, mask=causal, src_key_padding_mask=pad, is_causal=True)
        return self.head(h if self.batch_first else h.transpose(0, 1))


def _padding(g: torch.Generator) -> dict:
    pad = torch.zeros(BATCH, 6, dtype=torch.bool)
    pad[1::2, -2:] = True
    return {"pad": pad}


class Attention(nn.Module):
    """nn.MultiheadAttention (sequence first, boolean padding and causal masks) followed by
    F.scaled_dot_product_attention(is_causal=True) on transposed heads."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.mha = nn.MultiheadAttention(16, 4)
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).transpose(0, 1)  # (L, B, E)
        causal = torch.triu(torch.ones(h.shape[0], h.shape[0], dtype=torch.bool), 1)
        h = h + self.mha(h, h, h, key_padding_mask=pad, attn_mask=causal)[0]
        h = h.transpose(0, 1)
        b, t, c = h.shape
        q, k, v = (z.view(b, t, 4, c // 4).transpose(1, 2) for z in self.qkv(h).split(c, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(h + self.proj(y.transpose(1, 2).reshape(b, t, c)))


def _attention_inputs(g: torch.Generator):
    pad = torch.zeros(BATCH, 5, dtype=torch.bool)
    pad[::2, -1] = True
    return (torch.randn(BATCH, 5, 6, generator=g),), {"pad": pad}, torch.randn(BATCH, 5, 3, generator=g)


class Convolutions(nn.Module):
    """Conv1d (stride, groups, dilation, 'same'), Conv2d (stride, groups, reflect padding,
    depthwise), ConvTranspose2d, max/avg/adaptive pools, bilinear interpolation."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(3, 8, 5, stride=2, padding=2)
        self.c2 = nn.Conv1d(8, 8, 3, padding="same", dilation=2, groups=4)
        self.c3 = nn.Conv2d(2, 8, 3, stride=2, padding=1, groups=2, padding_mode="reflect")
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.head = nn.Linear(8 + 16, 5)

    def forward(self, signal: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        s = F.max_pool1d(F.relu(self.c2(F.relu(self.c1(signal)))), 2)
        s = F.adaptive_max_pool1d(s, 1).flatten(1)
        i = F.avg_pool2d(F.relu(self.c3(image)), 2, count_include_pad=False)
        i = F.max_pool2d(F.hardswish(self.dw(i)), 2, stride=1, padding=1)
        i = F.interpolate(self.up(i), scale_factor=0.5, mode="bilinear", align_corners=False)
        return self.head(torch.cat([s, F.adaptive_avg_pool2d(i, (2, 2)).flatten(1)], 1))


def _convolution_inputs(g: torch.Generator):
    signal, image = torch.randn(BATCH, 3, 20, generator=g), torch.randn(BATCH, 2, 12, 12, generator=g)
    return (signal, image), {}, torch.randint(0, 5, (BATCH,), generator=g)


class Embeddings(nn.Module):
    """nn.Embedding with padding_idx beside nn.EmbeddingBag (mode='max')."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8, padding_idx=0)
        self.bag = nn.EmbeddingBag(30, 8, mode="max")
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor, bag: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.emb(tokens).mean(1), self.bag(bag)], -1)
        return self.head(F.relu(self.fc(h)))


def _embedding_inputs(g: torch.Generator):
    tokens = torch.randint(0, 30, (BATCH, 5), generator=g)
    tokens[:, -1] = 0
    return (tokens, torch.randint(0, 30, (BATCH, 4), generator=g)), {}, torch.randint(0, 4, (BATCH,), generator=g)


class InPlace(nn.Module):
    """nn.ReLU(inplace=True), add_, mul_, +=, sigmoid_ and a slice assignment."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        h2 = self.fc2(h)
        h2.add_(h)
        h2.mul_(0.5)
        h2 += h
        h2[:, :2] = h2[:, 2:4] * 2
        return self.fc3(h2.sigmoid_())


class LongSkip(nn.Module):
    """The first layer's output and the input are read again by the last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(5)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.layers[0](x)
        h = first
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return self.head(h + first * x)


class ManyInputs(nn.Module):
    """Positional float and int inputs, a keyword float mask, a keyword bool flag, a non-tensor
    keyword and a dict of tensors; an output dict of which the loss reads two entries."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(4, 8)
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 2)

    def forward(self, x, y, idx, *, mask, flag, scale=1.0, extra=None):
        h = self.a(x) + self.b(y) + self.emb(idx).sum(1)
        h = torch.tanh(self.mid(h)).masked_fill(~flag[:, None], 0.0) * mask + extra["bias"]
        return {"logits": self.out(h) * scale, "aux": self.aux(h), "hidden": h}


def _many_inputs(g: torch.Generator):
    x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 4, generator=g)
    kwargs = {
        "mask": (torch.rand(BATCH, 8, generator=g) > 0.2).float(),
        "flag": torch.rand(BATCH, generator=g) > 0.3,
        "scale": 0.5,
        "extra": {"bias": torch.randn(BATCH, 8, generator=g)},
    }
    return (x, y, torch.randint(0, 10, (BATCH, 3), generator=g)), kwargs, torch.randn(BATCH, 3, generator=g)


def _dict_loss(output: dict, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output["logits"], target) + 0.1 * output["aux"].pow(2).mean()


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 12)
        self.fc = nn.Linear(12, 12)
        self.head = nn.Linear(12, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(tokens))))


def _ignored_tokens(g: torch.Generator):
    (tokens,), _, target = _token_inputs(16)(g)
    target[0, :4] = -100
    target[5, 1:] = -100
    return (tokens,), {}, target


class Parameters(nn.Module):
    """A weight shared by the first and the fourth layer, frozen layers and parameters, an
    unused layer, persistent and non-persistent buffers (one an index), weight_norm."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.mid = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))
        self.tied = nn.Linear(8, 8)
        self.tied.weight = self.shared.weight
        self.scale = nn.Parameter(torch.full((8,), 0.5), requires_grad=False)
        self.unused = nn.Linear(3, 3)
        self.head = nn.Linear(8, 3)
        self.register_buffer("shift", torch.linspace(-1, 1, 8))
        self.register_buffer("order", torch.tensor([2, 0, 1, 3, 7, 6, 5, 4]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x) + self.shift)
        h = torch.tanh(self.frozen(h)) * self.scale
        h = torch.tanh(self.mid(h))[:, self.order]
        h = torch.tanh(self.tied(h))
        return self.head(h)


class Functional(nn.Module):
    """torch.where, masked_fill, cumsum, gather, scatter, scatter_add, topk, sort, einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 10)
        self.w = nn.Parameter(torch.randn(10, 4, 3) * 0.3)
        self.c = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.where(h > 0, h, 0.1 * h).masked_fill(h.abs() < 0.05, 0.0)
        h = torch.cumsum(h, dim=1) / 10
        picked = torch.gather(h, 1, idx)
        h = self.b(h + torch.zeros_like(h).scatter(1, idx, picked * 2.0).scatter_add(1, idx, picked))
        top, _ = torch.topk(h, 4, dim=1)
        ordered, _ = torch.sort(h, dim=1, descending=True)
        h2 = torch.einsum("bi,ijk->bjk", h, self.w).flatten(1) + ordered[:, :1] + top.sum(1, keepdim=True)
        return self.c(h2)


def _functional_inputs(g: torch.Generator):
    x = torch.randn(BATCH, 6, generator=g)
    return (x, torch.randint(0, 10, (BATCH, 4), generator=g)), {}, torch.randn(BATCH, 3, generator=g)


class Strided(nn.Module):
    """Values crossing stage boundaries as views: reshaped, transposed, strided slices,
    permuted, expanded."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.c = nn.Linear(7, 7)
        self.d = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x.transpose(1, 2)).transpose(1, 2))[:, ::2]
        h = self.c(h).permute(2, 0, 1).permute(1, 2, 0)
        h = torch.tanh(self.c(h + h[:, :1].expand(-1, 4, -1)))
        return self.d(h.mean(1))


def _normalised(channels: int = 8):
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.BatchNorm2d(channels, track_running_stats=False),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.GroupNorm(2, channels),
        nn.Flatten(2),
        nn.LayerNorm(36),
        nn.Flatten(1),
        nn.Linear(channels * 36, 3),
    )


class LowPrecision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.b(self.norm(torch.tanh(self.a(x))))))


def _bf16_inputs(g: torch.Generator):
    (x,), kwargs, target = _vector_inputs()(g)
    return (x.bfloat16(),), kwargs, target.bfloat16()


MODELS = {
    "transformer-encoder-seq-first": Model(
        lambda: Encoder(False, False), _token_inputs(20, extra=_padding), _token_loss
    ),
    "transformer-encoder-norm-first": Model(
        lambda: Encoder(True, True), _token_inputs(20, extra=_padding), _token_loss
    ),
    "attention-mha-sdpa": Model(Attention, _attention_inputs),
    "convolutions-pools": Model(Convolutions, _convolution_inputs, F.cross_entropy),
    "embedding-bag": Model(Embeddings, _embedding_inputs, F.cross_entropy),
    "in-place": Model(InPlace, _vector_inputs()),
    "long-skip": Model(LongSkip, _vector_inputs(8)),
    "many-inputs-dict-output": Model(ManyInputs, _many_inputs, _dict_loss),
    "cross-entropy-ignore-index": Model(Tokens, _ignored_tokens, _token_loss, per_microbatch=True),
    "shared-frozen-buffers-weight-norm": Model(Parameters, _vector_inputs(8)),
    "functional-ops": Model(Functional, _functional_inputs),
    "strided-boundaries": Model(
        Strided, lambda g: ((torch.randn(BATCH, 5, 7, generator=g),), {}, torch.randn(BATCH, 3, generator=g))
    ),
    "batch-group-layer-norm": Model(
        _normalised,
        lambda g: ((torch.randn(BATCH, 3, 6, 6, generator=g),), {}, torch.randn(BATCH, 3, generator=g)),
        per_microbatch=True,
    ),
    "bfloat16": Model(
        lambda: LowPrecision().bfloat16(), _bf16_inputs, per_microbatch=True, tolerance=dict(rtol=0, atol=0)
    ),
}

# (stages, microbatches, schedule) per model: every schedule and stage count appears somewhere
CONFIGS = {
    "transformer-encoder-seq-first": (3, 2, "zb-h1"),
    "transformer-encoder-norm-first": (2, 4, "zb-h2"),
    "attention-mha-sdpa": (4, 4, "zb-auto"),
    "convolutions-pools": (3, 4, "zb-h1"),
    "embedding-bag": (2, 2, "1f1b"),
    "in-place": (3, 2, "zb-h2"),
    "long-skip": (4, 2, "zb-h1"),
    "many-inputs-dict-output": (3, 4, "zb-auto"),
    "cross-entropy-ignore-index": (2, 4, "zb-h1"),
    "shared-frozen-buffers-weight-norm": (4, 4, "zb-h2"),
    "functional-ops": (3, 2, "gpipe"),
    "strided-boundaries": (4, 1, "zb-h1"),
    "batch-group-layer-norm": (3, 4, "1f1b"),
    "bfloat16": (3, 2, "zb-h1"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_matches_eager(name):
    stages, microbatches, schedule = CONFIGS[name]
    check_matches_eager(MODELS[name], stages, microbatches, schedule)


def test_the_bf16_check_fails_against_an_fp32_computation():
    """The bf16 model is checked bit for bit against eager bf16: the same check against the model
    computed in fp32 (what a path that silently upcast would give) fails."""
    fp32_reference = dataclasses.replace(MODELS["bfloat16"], reference_dtype=torch.float32)
    with pytest.raises(AssertionError, match="not equal|Mismatched elements"):
        check_matches_eager(fp32_reference, *CONFIGS["bfloat16"])


# --- regressions -----------------------------------------------------------------------------------


class LossInside(nn.Module):
    """Returns its own loss (a regulariser on a parameter included) from a `labels` keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.c(F.relu(self.b(F.relu(self.a(x)))))
        loss = F.cross_entropy(logits, labels) + 1e-3 * self.a.weight.pow(2).sum()
        return loss


def _labelled(g: torch.Generator):
    return (torch.randn(BATCH, 6, generator=g),), {}, torch.randint(0, 4, (BATCH,), generator=g)


@pytest.mark.parametrize(
    "loss_fn", [None, lambda output, target: output * 1.0], ids=["loss_fn-None", "loss_fn-without-target"]
)
def test_model_computing_its_own_loss(loss_fn):
    """Without a loss_fn (or with one that ignores the absent target) the step needs no target."""
    check_matches_eager(Model(LossInside, _labelled, loss_fn, target_keyword="labels"), 2, 2, "zb-h1")


class Constants(nn.Module):
    """Tensors made in the forward (`torch.tensor(...)`, a scalar slice assignment, a boolean
    mask assignment) are constants of the traced graph that every stage using them must hold."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * torch.tensor([1.0, 2.0, 0.5, -1.0])
        h = self.b(h)
        h[:, :1] = 0.0
        h[h > 0.5] = 0.5
        return self.c(torch.where(h < -0.2, torch.tensor(-1.0), h) + torch.tensor(3.0))


@pytest.mark.parametrize("stages", [2, 3])
def test_tensor_constants_made_in_the_forward(stages):
    check_matches_eager(Model(Constants, _vector_inputs()), stages, 2, "zb-h1")


class _Bump(nn.Module):
    def forward(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return h + F.one_hot(idx, 10).float()


class PassThrough(nn.Module):
    """`bump` adds a non-differentiable value (one-hot of an integer input) to its input: as a
    stage of its own, the gradient it passes upstream is the one it receives, unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.bump = _Bump()
        self.c = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.c(self.bump(torch.tanh(self.a(x)), idx))


def test_stage_whose_input_gradient_is_its_output_gradient():
    model = Model(
        PassThrough,
        lambda g: (
            (torch.randn(BATCH, 6, generator=g), torch.randint(0, 10, (BATCH,), generator=g)),
            {},
            torch.randn(BATCH, 3, generator=g),
        ),
    )
    pipe = check_matches_eager(model, 3, 2, "1f1b", split_points=["bump", "c"])
    joint = pipe.compiled.programs[1].joint
    assert not any(n.op == "call_function" for n in joint.backward.graph.graph.nodes), (
        "the case is gone: stage 1's backward computes"
    )


class _ViewedWeightConv(nn.Conv1d):
    """A depthwise convolution reading its weight through views (`squeeze`, `unsqueeze`), as
    transformers' Mamba does: its weight gradient and its input gradient both read the view."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.weight.squeeze(1).unsqueeze(1)
        return F.conv1d(h, weight, self.bias, padding=2, groups=self.groups)[..., : h.shape[-1]]


class ViewedWeightConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.conv = _ViewedWeightConv(8, 8, 3, groups=8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.silu(self.conv(self.a(x).transpose(1, 2)).transpose(1, 2)))


def test_weight_view_read_by_both_input_and_weight_gradients():
    """B and W each recompute the weight's views (the stage has an input gradient: not the first)."""
    model = Model(
        ViewedWeightConv,
        lambda g: ((torch.randn(BATCH, 6, 4, generator=g),), {}, torch.randn(BATCH, 6, 2, generator=g)),
    )
    check_matches_eager(model, 2, 2, "zb-h1", split_points=["conv"])


class NoGrad(nn.Module):
    """A batch statistic and a teacher's output computed under torch.no_grad() from values that
    require grad: no gradient may flow through them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.teacher = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            centre = h.mean(0, keepdim=True)
            teacher = self.teacher(x)
            best = (h * 2).argmax(-1, keepdim=True).float()
        h = torch.tanh(self.b(h - centre) + teacher + h.detach() * 0.1)
        return self.c(h + best)


@pytest.mark.parametrize("stages, microbatches", [(2, 1), (3, 2)])
def test_no_grad_regions_stop_the_gradient(stages, microbatches):
    """With one microbatch the step equals the whole-batch eager step; with more, the batch
    statistic is per microbatch (the eager reference too)."""
    check_matches_eager(Model(NoGrad, _vector_inputs(), per_microbatch=True), stages, microbatches, "zb-h1")


class InPlaceUnderNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            h.mul_(2.0)
        return self.b(h)


def test_in_place_update_under_no_grad_is_refused_with_the_module():
    pipe = zbcompile.pipeline(InPlaceUnderNoGrad(), stages=2, microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"updates a tensor that requires grad in place under torch\.no_grad\(\)"):
        pipe.step(torch.randn(BATCH, 6), target=torch.randn(BATCH, 3))


class KeywordNames(nn.Module):
    """Parameters and buffers whose FQNs contain Python keywords (`blocks.in.weight`)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"in": nn.Linear(6, 8), "class": nn.Linear(8, 8), "lambda": nn.Linear(8, 3)})
        self.blocks["class"].register_buffer("if", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks["in"](x))
        h = torch.tanh(self.blocks["class"](h)) * getattr(self.blocks["class"], "if")
        return self.blocks["lambda"](h)


def test_parameter_names_with_python_keywords():
    pipe = check_matches_eager(Model(KeywordNames, _vector_inputs()), 3, 2, "zb-h2")
    assert "blocks.in.weight" in pipe.compiled.programs[0].joint.param_grads


class _Half(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * 0.5


class Spectral(nn.Module):
    """A complex value (an rFFT) crosses a stage boundary; the stages before it need its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.mix = _Half()
        self.b = nn.Linear(10, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(self.a(x), dim=-1)
        h = self.mix(spectrum)
        h = torch.tanh(self.b(torch.cat([h.real, h.imag], -1)))
        return self.c(torch.fft.irfft(torch.fft.rfft(h) * 0.5, n=8))


def test_complex_value_crossing_a_stage_boundary_carries_its_gradient():
    check_matches_eager(Model(Spectral, _vector_inputs(8)), 2, 2, "zb-h1", split_points=["mix"])


class DataAndRequiresGrad(nn.Module):
    """`.data` reads a value outside autograd; `requires_grad` is asked as eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = self.b(h) + h.data * 0.3
        if h.requires_grad:  # true eagerly in training
            h = h * 2
        return self.c(torch.tanh(h))


def test_dot_data_and_requires_grad_behave_as_in_eager():
    check_matches_eager(Model(DataAndRequiresGrad, _vector_inputs()), 3, 2, "zb-h1")


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return -grad


class _Unsupported(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.a = nn.Linear(6, 8)
        self.emb = nn.Embedding(10, 8, max_norm=1.0)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.what == "hook":
            h.register_hook(lambda grad: grad * 0.5)
        elif self.what == "function":
            h = _Reverse.apply(h)
        elif self.what == "autograd.grad":
            h = h + torch.autograd.grad(h.sum(), h, create_graph=True)[0]
        elif self.what == "max_norm":
            h = h + self.emb(x.argmax(-1))
        return self.b(h)


@pytest.mark.parametrize(
    "what, message",
    [
        ("hook", r"module '<root>' registers a gradient hook"),
        ("function", r"cannot trace the autograd use in module '<root>' \(_Unsupported\) at .*_Reverse\.apply"),
        (
            "autograd.grad",
            r"cannot trace the autograd use in module '<root>' \(_Unsupported\) at .*torch\.autograd\.grad",
        ),
        ("max_norm", r"module 'emb' uses an embedding with max_norm"),
    ],
)
def test_autograd_a_traced_stage_cannot_reproduce_is_refused_with_the_module(what, message):
    """Silently dropped before (a hook, a custom backward) or a crash inside torch."""
    pipe = zbcompile.pipeline(_Unsupported(what), stages=2, microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=message):
        pipe.step(torch.randn(BATCH, 6), target=torch.randn(BATCH, 3))


# --- dropout -------------------------------------------------------------------------------------


class Dropout(nn.Module):
    """Dropout of `x * w` with w = 1 and loss = mean: the loss equals the sum of w's gradient
    exactly when the backward uses the mask the forward drew."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.ones(6))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + 0.0 * self.a(x)  # a first stage that leaves x as it is
        return self.drop(h * self.w).mean()


def test_dropout_masks_are_drawn_once_per_microbatch_and_step():
    torch.manual_seed(0)
    model = Dropout()
    pipe = zbcompile.pipeline(model, stages=2, microbatches=4, loss_fn=None, schedule="zb-h1")
    x = torch.rand(BATCH, 6) + 1
    losses = []
    for _ in range(2):
        pipe.zero_grad()
        loss = pipe.step(x)
        torch.testing.assert_close(loss, model.w.grad.sum(), **FP32)
        losses.append(loss)
        kept = model.w.grad * (1 - 0.5) * 6 * BATCH / x.sum(0)  # fraction kept per feature, about 1/2
        assert 0 < kept.min() and kept.max() < 1.0 + 1e-6, kept
    assert not torch.equal(losses[0], losses[1]), "the second step drew the first step's masks"


def test_dropout_with_one_microbatch_draws_what_eager_draws():
    """Random draws happen in F, in stage order: with one microbatch the same seed gives the
    eager masks, so the step equals eager."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 3)
    )
    reference = copy.deepcopy(model)
    x, y = torch.randn(BATCH, 6), torch.randn(BATCH, 3)
    pipe = zbcompile.pipeline(model, stages=2, microbatches=1, loss_fn=F.mse_loss, schedule="1f1b")
    pipe.compile(x, target=y)
    torch.manual_seed(1)
    loss = pipe.step(x, target=y)
    torch.manual_seed(1)
    eager = F.mse_loss(reference(x), y)
    eager.backward()
    torch.testing.assert_close(loss, eager.detach(), **FP32)
    assert_grads_close(grads_of(model), grads_of(reference), "dropout, one microbatch", **FP32)
    assert not math.isclose(loss.item(), F.mse_loss(reference.eval()(x), y).item()), "dropout did not drop"
