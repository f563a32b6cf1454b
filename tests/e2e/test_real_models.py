"""Real models as their users write them: transformers models from tiny random-init configs,
pipelined as they are (no wrapper module), give eager's loss and gradients under every
schedule; a compile never changes the user's module, whether it succeeds or fails; models built
on the meta device are filled from a state dict or an init function, in one process and on two
ranks; a model that computes its own loss may return it inside a structured output."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zbcompile
from helpers import launches
from helpers import real_model_workers as workers
from helpers.grads import FP32, assert_grads_close, grads_of
from helpers.real_models import MICROBATCHES, NAMES, VOCAB, build

SCHEDULES = ("1f1b", "zb-h1", "zbv")


# --- transformers models against eager --------------------------------------------------------------


def _eager(name: str):
    """The case, and the loss and gradients of one eager step of the whole batch on a copy."""
    case = build(name)
    reference = copy.deepcopy(case.model)
    loss = case.eager_loss(reference)
    loss.backward()
    return case, loss.detach(), grads_of(reference)


@pytest.mark.parametrize("stages", [2, 4], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("name", NAMES)
def test_pipelined_step_matches_eager_under_every_schedule(name, stages):
    """One compile, one step per schedule: the loss and every gradient equal eager's, and the
    gradients are bitwise equal across schedules."""
    case, eager_loss, eager_grads = _eager(name)
    pipe = zbcompile.pipeline(
        case.model, stages=stages, microbatches=MICROBATCHES, loss_fn=case.loss_fn, schedule=SCHEDULES[0]
    )
    grads = {}
    for schedule in SCHEDULES:
        pipe.set_schedule(schedule)
        pipe.zero_grad()
        loss = case.step(pipe)
        torch.testing.assert_close(loss, eager_loss, **FP32, msg=lambda m: f"{schedule}: {m}")
        grads[schedule] = grads_of(case.model)
        assert_grads_close(grads[schedule], eager_grads, f"{name} S{stages} {schedule}", **FP32)
    for schedule, other in grads.items():
        for fqn, grad in grads[SCHEDULES[0]].items():
            assert torch.equal(grad, other[fqn]), f"{fqn}: {SCHEDULES[0]} and {schedule} differ"


def test_causal_model_without_a_mask_keeps_sdpas_is_causal():
    """A transformers decoder called without an attention mask runs scaled_dot_product_attention
    with is_causal=True in the stage programs, as eager and torch.compile do, not with a
    materialised causal mask (twice the attention's work on a GPU); the loss and gradients are
    eager's. With a padding mask the mask is an input and stays one."""
    case = build("llama")
    tokens = case.args[0]
    reference = copy.deepcopy(case.model)
    reference(tokens, labels=tokens).loss.backward()
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=MICROBATCHES)
    loss = pipe.step(tokens, labels=tokens)
    torch.testing.assert_close(loss, reference(tokens, labels=tokens).loss.detach(), **FP32)
    assert_grads_close(grads_of(case.model), grads_of(reference), "llama without a mask", **FP32)
    attention = [
        node
        for program in pipe.compiled.programs
        for node in program.joint.forward.graph.graph.nodes
        if "scaled_dot_product" in str(node.target)
    ]
    assert len(attention) == case.model.config.num_hidden_layers
    for node in attention:
        is_causal = len(node.args) > 4 and node.args[4] is True
        assert is_causal and "attn_mask" not in node.kwargs, node.format_node()


def test_blooms_custom_gelu_is_refused_naming_the_module():
    """A transformers Bloom in training mode runs its GELU through a custom autograd.Function,
    whose backward a traced stage cannot reproduce: refused, naming the module and the line."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM(config)
    tokens = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    pipe = zbcompile.pipeline(model.train(), stages=2, microbatches=2)
    with pytest.raises(ValueError, match=r"module 'transformer\.h\.0\.mlp\.gelu_impl' \(BloomGelu\) at .*GeLUFunction"):
        pipe.step(tokens, labels=tokens)


@launches.READS_TWO_RANK_MODELS
def test_meta_models_loaded_from_a_full_state_dict_train_on_two_ranks():
    """Every library family (GPT-2 and Llama under three schedules, the others under zb-h1) built
    on the meta device on each of 2 ranks (gloo), filled from the eager model's full state dict:
    the first step's loss and gradients equal eager's (bitwise across schedules), and after 2 AdamW
    steps the gathered state dict equals eager's. Then `evaluate()`: its loss equals eager
    torch.no_grad() in eval mode over the microbatches of the trained model, gradients are
    untouched, and each rank's measured peak activation bytes stay within what the forward-only
    schedule predicts; `return_outputs=True` gives eager's eval-mode logits for the whole batch."""
    runs = workers.RUNS
    per_rank = launches.two_rank_results("real_models")  # the shared two-rank launch
    for name, stages, schedule in runs:
        case, eager_loss, eager_grads = _eager(name)
        key = (name, stages, schedule)
        losses = [r[key]["loss"] for r in per_rank if r[key]["loss"] is not None]
        assert len(losses) == 1, key
        torch.testing.assert_close(losses[0], eager_loss, **FP32, msg=lambda m: f"{key}: {m}")
        grads = {k: v for r in per_rank for k, v in r[key]["grads"].items()}
        assert_grads_close({n: grads.get(n) for n in eager_grads}, eager_grads, str(key), **FP32)
        state = {k: v for r in per_rank for k, v in r[key]["state"].items()}
        expected = workers.eager_training(name)
        assert state.keys() == expected.keys(), key
        for k, v in expected.items():
            torch.testing.assert_close(state[k], v, **FP32, msg=lambda m, k=k: f"{key} {k}: {m}")
        evaluations = [r[key]["evaluation"] for r in per_rank]
        assert all(e["grads_kept"] for e in evaluations), key
        assert all(0 < e["peak"] <= e["predicted"] for e in evaluations), (key, evaluations)
        eval_losses = [e["loss"] for e in evaluations if e["loss"] is not None]
        assert len(eval_losses) == 1, key
        torch.testing.assert_close(eval_losses[0], workers.eager_evaluation(name, state), rtol=1e-6, atol=0.0)
        logits = [e["logits"] for e in evaluations if e.get("logits") is not None]
        if key[2] == "zb-h1":
            assert len(logits) == 1, key
            torch.testing.assert_close(logits[0], workers.eager_logits(name, state), rtol=1e-6, atol=1e-6)
    for name in {name for name, _, _ in runs}:
        keys = [k for k in runs if k[0] == name and k[1] == 2]
        first = {k: v for r in per_rank for k, v in r[keys[0]]["grads"].items()}
        for key in keys[1:]:
            other = {k: v for r in per_rank for k, v in r[key]["grads"].items()}
            assert all(torch.equal(first[k], other[k]) for k in first), key


# --- meta-device models in one process -----------------------------------------------------------------


def test_meta_model_loads_a_state_dict_before_compiling():
    """Llama on the meta device: `load_state_dict` before the first compile materialises every
    entry; `init_fn` fills the rotary frequencies, which no state dict holds."""
    case, eager_loss, eager_grads = _eager("llama")
    meta = build("llama", meta=True)
    pipe = zbcompile.pipeline(
        meta.model, stages=2, microbatches=MICROBATCHES, schedule="zb-h1", init_fn=meta.model._init_weights
    )
    result = pipe.load_state_dict(case.model.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(meta.step(pipe), eager_loss, **FP32)
    assert_grads_close(grads_of(meta.model), eager_grads, "meta llama", **FP32)
    for name, buffer in case.model.named_buffers():
        assert torch.equal(meta.model.get_buffer(name), buffer), name


def test_meta_model_without_init_refuses_to_step_until_loaded():
    """GPT-2's Conv1D has no reset_parameters(): after compiling, a step refuses (naming it) until
    `load_state_dict` fills what is missing; a strict load missing an entry says which."""
    case, eager_loss, eager_grads = _eager("gpt2")
    meta = build("gpt2", meta=True)
    pipe = zbcompile.pipeline(meta.model, stages=2, microbatches=MICROBATCHES, loss_fn=meta.loss_fn, schedule="zb-h1")
    pipe.compile(*meta.args, target=meta.target, **meta.kwargs)
    assert not any(p.is_meta for p in meta.model.parameters())
    with pytest.raises(ValueError, match=r"neither initialised nor loaded.*Conv1D.*init_fn=.*load_state_dict"):
        meta.step(pipe)
    state = case.model.state_dict()
    incomplete = {k: v for k, v in state.items() if k != "transformer.h.1.mlp.c_fc.weight"}
    with pytest.raises(ValueError, match=r"lacks 1 entries .*'transformer\.h\.1\.mlp\.c_fc\.weight'"):
        pipe.load_state_dict(incomplete)
    pipe.load_state_dict(state)
    torch.testing.assert_close(meta.step(pipe), eager_loss, **FP32)
    assert_grads_close(grads_of(meta.model), eager_grads, "meta gpt2", **FP32)


class _MaskedLinear(nn.Module):
    """Its reset_parameters() fills the weights, not the mask computed in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))

    def reset_parameters(self) -> None:
        self.lin.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.mask


def test_meta_model_trains_from_init_fn_alone():
    """Llama on the meta device with `init_fn` and no state dict: every parameter and buffer is
    filled as `_init_weights` fills it (linear and embedding weights drawn with the config's
    standard deviation, norms at 1, the rotary frequencies computed), and a step gives what the
    eager model with those same weights gives."""
    meta = build("llama", meta=True)
    pipe = zbcompile.pipeline(
        meta.model, stages=2, microbatches=MICROBATCHES, schedule="zb-h1", init_fn=meta.model._init_weights
    )
    loss = meta.step(pipe)
    std = meta.model.config.initializer_range
    for name, p in meta.model.named_parameters():
        assert not p.is_meta and p.isfinite().all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.std().item() - std) < 0.25 * std, (name, p.std().item())
    reference = build("llama")
    assert torch.equal(
        meta.model.get_buffer("model.rotary_emb.inv_freq"), reference.model.get_buffer("model.rotary_emb.inv_freq")
    )
    reference.model.load_state_dict(meta.model.state_dict())
    eager = reference.eager_loss()
    eager.backward()
    torch.testing.assert_close(loss, eager.detach(), **FP32)
    assert_grads_close(grads_of(meta.model), grads_of(reference.model), "meta llama from init_fn", **FP32)


def test_reset_parameters_fills_the_buffers_it_writes():
    """BatchNorm's reset_parameters() writes its running statistics: filled. A mask buffer its
    module's reset_parameters() leaves alone is not, and the step says so until it is loaded."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), _MaskedLinear(), nn.Linear(4, 2))
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=F.mse_loss)
    x, target = torch.randn(8, 4), torch.randn(8, 2)
    with pytest.raises(
        ValueError, match=r"neither initialised nor loaded, e\.g\. \['2\.mask'\] \(owned by _MaskedLinear\)"
    ):
        pipe.step(x, target=target)
    assert torch.equal(model[1].running_var, torch.ones(4)) and int(model[1].num_batches_tracked) == 0
    pipe.load_state_dict({"2.mask": torch.tril(torch.ones(4, 4))}, strict=False)
    pipe.step(x, target=target)


def test_failing_compile_of_a_meta_model_materialises_nothing():
    meta = build("llama", meta=True)
    before = dict(meta.model.named_parameters())

    def init_fn(module: nn.Module) -> None:
        if type(module).__name__ == "LlamaRMSNorm":
            raise RuntimeError("no initialiser for norms")
        meta.model._init_weights(module)

    pipe = zbcompile.pipeline(meta.model, stages=2, microbatches=MICROBATCHES, init_fn=init_fn)
    with pytest.raises(RuntimeError, match="no initialiser for norms"):
        meta.step(pipe)
    assert dict(meta.model.named_parameters()) == before
    assert all(p.is_meta for p in meta.model.parameters()) and all(b.is_meta for b in meta.model.buffers())


# --- the user's module after a compile -------------------------------------------------------------------


class AliasedModule(nn.Module):
    """`lin1` is `lin0` registered a second time (the same module runs twice); a buffer, and an
    attribute the forward writes."""

    def __init__(self, branch_on_values: bool = False) -> None:
        super().__init__()
        self.lin0 = nn.Linear(6, 6)
        self.mid = nn.Linear(6, 6)
        self.lin1 = self.lin0
        self.out = nn.Linear(6, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.branch_on_values = branch_on_values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.lin0(x)))) * self.scale
        self.last_hidden = h.detach()
        if self.branch_on_values and h.sum() > 0:
            h = h * 2
        return self.out(torch.tanh(self.lin1(h)))


def _alias_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


@pytest.mark.parametrize("stages", [2, 3])
def test_module_registered_under_two_names_trains_exactly(stages):
    torch.manual_seed(0)
    model = AliasedModule()
    reference = copy.deepcopy(model)
    x, target = _alias_batch()
    pipe = zbcompile.pipeline(model, stages=stages, microbatches=2, loss_fn=F.mse_loss, schedule="zb-h1")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        loss = pipe.step(x, target=target)
        eager_loss = F.mse_loss(reference(x), target)
        eager_loss.backward()
        torch.testing.assert_close(loss, eager_loss.detach(), **FP32)
        assert_grads_close(grads_of(model), grads_of(reference), f"step {step}", **FP32)
        optimizer.step()
        eager_optimizer.step()
    assert model.lin1 is model.lin0 and type(model.lin0.weight) is nn.Parameter


def _snapshot(model: nn.Module) -> dict:
    """Every module's parameters, buffers and attributes (objects and values) and hooks."""
    return {
        name: {
            "attributes": dict(vars(module)),
            "parameters": dict(module._parameters),
            "buffers": dict(module._buffers),
            "values": {k: v.detach().clone() for k, v in [*module._parameters.items(), *module._buffers.items()]},
            "hooks": (list(module._forward_pre_hooks), list(module._forward_hooks)),
        }
        for name, module in model.named_modules(remove_duplicate=False)
    }


def _assert_unchanged(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for name, was in before.items():
        now = after[name]
        for part in ("attributes", "parameters", "buffers"):
            assert now[part].keys() == was[part].keys(), (name, part)
            for key, value in was[part].items():
                assert now[part][key] is value, f"{name}.{key} is another object after the compile"
        for key, value in was["values"].items():
            assert torch.equal(now["values"][key], value), f"{name}.{key} changed"
        assert now["hooks"] == was["hooks"], name


def _raise(*args):
    raise RuntimeError("this loss_fn fails")


@pytest.mark.parametrize(
    "branch_on_values, loss_fn, error",
    [
        pytest.param(True, F.mse_loss, ValueError, id="data-dependent-forward"),
        pytest.param(False, _raise, RuntimeError, id="failing-loss_fn"),
        pytest.param(False, F.mse_loss, None, id="successful"),
    ],
)
def test_compile_leaves_the_module_as_it_was(branch_on_values, loss_fn, error):
    """Parameters, buffers, attributes (the same objects with the same values) and hooks are
    what they were, and the eager forward runs and gives what it gave."""
    torch.manual_seed(0)
    model = AliasedModule(branch_on_values)
    x, target = _alias_batch()
    model.lin0.register_forward_hook(lambda module, args, output: None)
    expected = model(x)
    before = _snapshot(model)
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=loss_fn)
    if error is None:
        pipe.compile(x, target=target)
    else:
        with pytest.raises(error):
            pipe.compile(x, target=target)
    _assert_unchanged(model, before)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


# --- models that compute their own loss ---------------------------------------------------------------


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class OwnLoss(nn.Module):
    """Returns its loss in the structure `kind` names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        logits = self.b(torch.tanh(self.a(x)))
        loss = F.cross_entropy(logits, labels)
        return {"tuple": (loss, logits), "dict": {"logits": logits, "loss": loss}, "dataclass": Output(logits, loss)}[
            self.kind
        ]


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_loss_inside_the_model_output(kind):
    torch.manual_seed(0)
    model = OwnLoss(kind)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, labels = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2)
    loss = pipe.step(x, labels=labels)
    eager = F.cross_entropy(reference.b(torch.tanh(reference.a(x))), labels)
    eager.backward()
    torch.testing.assert_close(loss, eager.detach(), **FP32)
    assert_grads_close(grads_of(model), grads_of(reference), kind, **FP32)


def test_model_output_without_a_loss_says_what_it_holds():
    case = build("gpt2")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=MICROBATCHES)
    with pytest.raises(TypeError, match=r"without a loss_fn the model must return its loss.*\['logits'.*labels"):
        pipe.step(*case.args, **case.kwargs)
