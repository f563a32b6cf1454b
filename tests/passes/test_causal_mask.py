"""fold_causal_masks: attention with a constant causal mask (boolean, or 0 / -inf, built from
nothing but `arange`-like ops) is traced as `is_causal=True` attention, and a step gives eager's
loss and gradients; masks that depend on the batch, that allow another pattern, or attention
with dropout keep their mask."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zbcompile
from helpers.grads import FP32, assert_grads_close, grads_of
from zbcompile.passes.trace import trace_model

SEQ, HIDDEN, HEADS = 8, 16, 2


def _boolean(length: int, device: torch.device, tokens: torch.Tensor) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def _additive(length: int, device: torch.device, tokens: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(length, device=device)
    blocked = rows[None, :] > rows[:, None]
    return torch.where(blocked, torch.finfo(torch.float32).min, 0.0)[None, None].expand(tokens.shape[0], 1, -1, -1)


def _sliding_window(length: int, device: torch.device, tokens: torch.Tensor) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril().triu(-2)


def _padded(length: int, device: torch.device, tokens: torch.Tensor) -> torch.Tensor:
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return causal[None, None] & (tokens != 0)[:, None, None, :]


class Attention(nn.Module):
    def __init__(self, mask_fn, dropout: float = 0.0) -> None:
        super().__init__()
        self.mask_fn, self.dropout = mask_fn, dropout
        self.embed = nn.Embedding(32, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = self.mask_fn(tokens.shape[1], tokens.device, tokens)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout)
        return self.out(y.transpose(1, 2).flatten(2))


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _attention_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if "scaled_dot_product" in str(n.target)]


def _is_causal_without_mask(node: torch.fx.Node) -> bool:
    return len(node.args) > 4 and node.args[4] is True and node.kwargs.get("attn_mask") is None


def _tokens() -> torch.Tensor:
    tokens = torch.randint(1, 32, (4, SEQ), generator=torch.Generator().manual_seed(0))
    tokens[1, 5:] = 0
    return tokens


@pytest.mark.parametrize("mask_fn", [_boolean, _additive], ids=["bool", "additive"])
def test_constant_causal_mask_runs_as_is_causal_and_matches_eager(mask_fn):
    torch.manual_seed(0)
    model = Attention(mask_fn)
    reference = copy.deepcopy(model)
    tokens = _tokens()
    traced = trace_model(model, _loss, (tokens,), {}, tokens)
    (attention,) = _attention_nodes(traced.graph_module.graph)
    assert _is_causal_without_mask(attention), attention.format_node()
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=_loss)
    loss = pipe.step(tokens, target=tokens)
    expected = sum(_loss(reference(t), t) / 2 for t in tokens.chunk(2))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **FP32)
    assert_grads_close(grads_of(model), grads_of(reference), mask_fn.__name__, **FP32)


@pytest.mark.parametrize(
    "mask_fn, dropout",
    [(_sliding_window, 0.0), (_padded, 0.0), (_boolean, 0.1)],
    ids=["another pattern", "depends on the batch", "dropout"],
)
def test_other_masks_stay_masks(mask_fn, dropout):
    """The mask is still computed (its `tril`) and no attention runs as is_causal without it (with
    dropout the CPU attention is traced as its math, the mask added to the scores)."""
    graph = trace_model(Attention(mask_fn, dropout), _loss, (_tokens(),), {}, _tokens()).graph_module.graph
    assert graph.find_nodes(op="call_function", target=torch.ops.aten.tril.default)
    assert not any(_is_causal_without_mask(node) for node in _attention_nodes(graph))


class Block(nn.Module):
    """Attention on hidden states that builds its own mask, as each of a decoder's layers does."""

    def __init__(self, mask_fn) -> None:
        super().__init__()
        self.mask_fn = mask_fn
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = self.mask_fn(tokens.shape[1], tokens.device, tokens)
        return x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2))


class Layers(nn.Module):
    def __init__(self, mask_fns) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(32, HIDDEN), nn.Linear(HIDDEN, 32)
        self.blocks = nn.ModuleList(Block(fn) for fn in mask_fns)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, tokens)
        return self.head(x)


@pytest.mark.parametrize(
    "mask_fns, folded",
    [((_additive,) * 3, (True, True, True)), ((_additive, _sliding_window, _additive), (True, False, True))],
    ids=["alike", "one of another pattern"],
)
def test_each_layers_mask_is_judged_and_masks_computed_alike_are_checked_once(monkeypatch, mask_fns, folded):
    from zbcompile.passes import causal_mask

    checks = []
    check = causal_mask._is_constant_causal
    monkeypatch.setattr(causal_mask, "_is_constant_causal", lambda *a: checks.append(a[0]) or check(*a))
    tokens = _tokens()
    graph = trace_model(Layers(mask_fns), _loss, (tokens,), {}, tokens).graph_module.graph
    assert tuple(_is_causal_without_mask(n) for n in _attention_nodes(graph)) == folded
    assert len(checks) == len(set(mask_fns))  # one check per distinct way of computing a mask
