"""End to end: a pipelined step computes the same loss and gradients as the eager model.

Every zoo model (tests/helpers/models.py) runs under several schedules, stage counts and microbatch
counts; the reference is an eager forward of the whole batch and `loss.backward()` on a deep copy.
Pipelines are built once per (model, dtype, stages, microbatches) and test process; schedules
share them, and the tests that read one pipeline share an xdist group (`compile_group`), so that
`pytest -n` builds each in one worker only.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zbcompile
from helpers.grads import FP32, assert_grads_close, grads_of
from helpers.models import BATCH, MLP, NAMES, build
from zbcompile.schedules import make_schedule

FP64 = dict(rtol=1e-12, atol=1e-12)
TOLERANCE = {torch.float32: FP32, torch.float64: FP64}
DTYPE_ID = {torch.float32: "fp32", torch.float64: "fp64"}

BASE_SCHEDULES = ("gpipe", "1f1b", "zb-h1")
ALL_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto")
STAGES = (1, 2, 4)
MICROBATCHES = (1, 4)
FLOAT64_MODELS = ("mlp", "gpt")


def schedules_for(name: str, dtype: torch.dtype) -> tuple[str, ...]:
    """Every schedule for the fp32 GPT; the three base ones elsewhere (compiles are the cost)."""
    return ALL_SCHEDULES if name == "gpt" and dtype == torch.float32 else BASE_SCHEDULES


def compile_group(name: str, dtype: torch.dtype, stages: int, microbatches: int) -> pytest.MarkDecorator:
    """The xdist group of the tests that read `_pipeline(name, dtype, stages, microbatches)`."""
    return pytest.mark.xdist_group(f"equivalence-{name}-{DTYPE_ID[dtype]}-S{stages}-m{microbatches}")


# --- cached runs ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def eager_run(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Loss and gradients of one eager forward + backward over the whole batch, on a deep copy."""
    case = build(name, dtype=dtype)
    model = copy.deepcopy(case.model)
    loss = case.eager_loss(model)
    loss.backward()
    return loss.detach(), grads_of(model)


@functools.lru_cache(maxsize=None)
def _pipeline(name: str, dtype: torch.dtype, stages: int, microbatches: int):
    """(case, pipeline) built once per model, dtype, stage and microbatch count: schedules share
    its compile (`set_schedule`); the zoo's forwards update no buffers, so a step leaves nothing
    but `.grad` behind, which each run clears."""
    case = build(name, dtype=dtype)
    pipe = zbcompile.pipeline(
        case.model, stages=stages, microbatches=microbatches, loss_fn=case.loss_fn, schedule="1f1b"
    )
    return case, pipe


@functools.lru_cache(maxsize=None)
def pipelined_run(name: str, dtype: torch.dtype, stages: int, microbatches: int, schedule: str):
    """(loss, gradients, pipeline) of one pipelined step from zero gradients."""
    case, pipe = _pipeline(name, dtype, stages, microbatches)
    pipe.set_schedule(schedule)
    pipe.zero_grad()
    loss = case.step(pipe)
    assert pipe.schedule.name == schedule
    return loss, grads_of(pipe), pipe


# --- the equivalence matrix ----------------------------------------------------------------------


def _matrix():
    for name in NAMES:
        dtypes = (torch.float32, torch.float64) if name in FLOAT64_MODELS else (torch.float32,)
        for dtype in dtypes:
            for stages in STAGES:
                for microbatches in MICROBATCHES:
                    for schedule in schedules_for(name, dtype):
                        if schedule == "gpipe" and microbatches == 1:
                            continue  # 1F1B's schedule (test_one_microbatch_gpipe_is_1f1b)
                        yield pytest.param(
                            name,
                            dtype,
                            stages,
                            microbatches,
                            schedule,
                            id=f"{name}-{DTYPE_ID[dtype]}-S{stages}-m{microbatches}-{schedule}",
                            marks=compile_group(name, dtype, stages, microbatches),
                        )


@pytest.mark.parametrize("name, dtype, stages, microbatches, schedule", list(_matrix()))
def test_step_matches_eager(name, dtype, stages, microbatches, schedule):
    """Loss and every gradient match eager; the gradients are bitwise those of 1F1B (so all
    schedules agree bit for bit on a given model, stage count and microbatch count)."""
    loss, grads, pipe = pipelined_run(name, dtype, stages, microbatches, schedule)
    eager_loss, eager_grads = eager_run(name, dtype)
    assert len(pipe.compiled.partition.stages) == stages
    assert loss.dtype == dtype
    torch.testing.assert_close(loss, eager_loss, **TOLERANCE[dtype])
    assert_grads_close(grads, eager_grads, f"{schedule} vs eager", **TOLERANCE[dtype])

    reference_loss, reference_grads, _ = pipelined_run(name, dtype, stages, microbatches, "1f1b")
    assert torch.equal(loss, reference_loss), f"{schedule} loss {loss} != 1f1b loss {reference_loss}"
    for fqn, grad in reference_grads.items():
        assert torch.equal(grads[fqn], grad), (
            f"{fqn}: {schedule} gradient is not bitwise equal to 1f1b's "
            f"(max difference {(grads[fqn] - grad).abs().max().item():.3g})"
        )


def test_one_microbatch_gpipe_is_1f1b():
    """Why the matrix leaves GPipe out at m=1: it is the same action list as 1F1B's."""
    for stages in STAGES:
        assert make_schedule("gpipe", stages, 1).actions == make_schedule("1f1b", stages, 1).actions


@compile_group("convnet", torch.float32, 8, 4)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_stage_whose_output_is_a_view_of_its_input_passes_the_gradient_on(schedule):
    """Cut into 8 stages, the ConvNet has a stage that only flattens (its output is a view of its
    input); the gradient must still reach every earlier stage."""
    loss, grads, pipe = pipelined_run("convnet", torch.float32, 8, 4, schedule)
    view_only = [
        s.index for s in pipe.compiled.partition.stages
        if all(n.op != "call_function" or "view" in str(n.target) for n in s.module.graph.nodes)
    ]
    assert view_only, "no stage of the 8 is a view only: the case this test is for is gone"
    eager_loss, eager_grads = eager_run("convnet", torch.float32)
    torch.testing.assert_close(loss, eager_loss, **FP32)
    assert_grads_close(grads, eager_grads, f"{schedule} on 8 stages vs eager", **FP32)


class _Recurrent(nn.Module):
    """Linear -> LSTM -> GRU -> Linear on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(torch.tanh(self.embed(x)))
        hidden, _ = self.gru(hidden)
        return self.head(hidden[:, -1])


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_recurrent_layers_match_eager(schedule):
    """nn.LSTM and nn.GRU (whose oneDNN kernel cannot be traced for a split backward) train like
    eager across 3 stages."""
    torch.manual_seed(0)
    model = _Recurrent()
    reference = copy.deepcopy(model)
    x, target = torch.randn(8, 5, 4), torch.randn(8, 2)
    pipe = zbcompile.pipeline(model, stages=3, microbatches=4, loss_fn=F.mse_loss, schedule=schedule)
    loss = pipe.step(x, target=target)
    eager_loss = F.mse_loss(reference(x), target)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach(), **FP32)
    assert_grads_close(grads_of(model), grads_of(reference), f"{schedule} recurrent vs eager", **FP32)


# --- tied weights, names and state ---------------------------------------------------------------


@pytest.mark.parametrize(
    "stages", [pytest.param(s, id=f"S{s}", marks=compile_group("gpt", torch.float32, s, 4)) for s in (2, 4)]
)
def test_tied_embedding_is_one_parameter_with_summed_gradient(stages):
    """The GPT's embedding/LM-head weight is reported once, used by the first and the last
    stage, and its gradient is the sum of both uses."""
    _, grads, pipe = pipelined_run("gpt", torch.float32, stages, 4, "zb-h1")
    model = pipe.module
    fresh = build("gpt").model

    names = [n for n, _ in pipe.named_parameters()]
    assert names.count("tok_emb.weight") == 1 and "head.weight" not in names
    assert names == [n for n, _ in fresh.named_parameters()]
    assert all(a is b for a, b in zip(pipe.parameters(), model.parameters()))
    assert list(pipe.state_dict()) == list(fresh.state_dict())
    assert pipe.compiled.partition.shared_params.get("tok_emb.weight") == (0, stages - 1)

    # the two uses separately, on an untied eager copy
    case = build("gpt")
    untied = copy.deepcopy(case.model)
    untied.head.weight = nn.Parameter(untied.tok_emb.weight.detach().clone())
    case.eager_loss(untied).backward()
    embedding_part, head_part = untied.tok_emb.weight.grad, untied.head.weight.grad
    assert embedding_part.abs().sum() > 0 and head_part.abs().sum() > 0
    torch.testing.assert_close(grads["tok_emb.weight"], embedding_part + head_part, **FP32)
    torch.testing.assert_close(grads["tok_emb.weight"], eager_run("gpt", torch.float32)[1]["tok_emb.weight"], **FP32)


# --- more than one step --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_second_step_accumulates_like_two_backward_passes(name):
    """`.grad` accumulates over steps exactly as over eager backward passes."""
    case = build(name)
    other = build(name, seed=7)  # a second batch of the same shapes
    reference = copy.deepcopy(case.model)
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, schedule="zb-h1")

    losses = [case.step(pipe), pipe.step(*other.args, target=other.target, **other.kwargs)]
    eager = [case.eager_loss(reference), other.loss_fn(reference(*other.args, **other.kwargs), other.target)]
    for loss in eager:
        loss.backward()
    for got, expected in zip(losses, eager):
        torch.testing.assert_close(got, expected.detach(), **FP32)
    assert_grads_close(grads_of(pipe), grads_of(reference), "after two steps", **FP32)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize(
    "name, make_optimizer",
    [
        pytest.param("gpt", _sgd, id="gpt-sgd-momentum"),
        pytest.param("masked", _sgd, id="masked-sgd-momentum"),
        pytest.param("mlp", _adamw, id="mlp-adamw"),
        pytest.param("masked", _adamw, id="masked-adamw"),
    ],
)
def test_optimizer_on_pipeline_parameters_trains_like_eager(name, make_optimizer):
    """Three optimizer steps on `pipe.parameters()` follow the same steps on the eager model."""
    case = build(name)
    reference = copy.deepcopy(case.model)
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, schedule="zb-h1")
    optimizer, eager_optimizer = make_optimizer(pipe.parameters()), make_optimizer(reference.parameters())
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        eager_optimizer.zero_grad()
        loss = case.step(pipe)
        eager_loss = case.eager_loss(reference)
        eager_loss.backward()
        optimizer.step()
        eager_optimizer.step()
        torch.testing.assert_close(loss, eager_loss.detach(), **FP32, msg=lambda m: f"step {step}: {m}")
        for (fqn, p), q in zip(pipe.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, **FP32, msg=lambda m, fqn=fqn: f"step {step}: {fqn}: {m}")
        losses.append(loss.item())
    assert losses[-1] < losses[0], f"the loss does not go down: {losses}"


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_step_uses_weights_loaded_after_compiling(assign):
    """Loading other weights into the model between steps (copied into its parameters, or with
    `assign=True` replacing them) changes what the next step computes, as it does eagerly."""
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn)
    case.step(pipe)  # compiles
    new_weights = build("mlp", seed=5).model.state_dict()
    case.model.load_state_dict(new_weights, assign=assign)
    pipe.zero_grad()
    loss = case.step(pipe)

    reference = build("mlp").model
    reference.load_state_dict(new_weights)
    eager_loss = case.eager_loss(reference)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach(), **FP32)
    assert_grads_close(grads_of(pipe), grads_of(reference), "after load_state_dict", **FP32)


# --- recompilation -------------------------------------------------------------------------------


def test_new_batch_shape_recompiles_and_stays_correct():
    """A step with another batch size compiles anew; the earlier shape reuses its compilation."""
    case = build("mlp")
    reference = copy.deepcopy(case.model)
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn)
    (x,), y = case.args, case.target

    case.step(pipe)
    first = pipe.compiled
    pipe.zero_grad()
    loss = pipe.step(x[:4], target=y[:4])
    assert pipe.compiled is not first
    eager_loss = case.loss_fn(reference(x[:4]), y[:4])
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach(), **FP32)
    assert_grads_close(grads_of(pipe), grads_of(reference), "batch of 4", **FP32)

    case.step(pipe)
    assert pipe.compiled is first


def test_new_constant_argument_recompiles_and_stays_correct():
    """Changing a non-tensor argument (`scale`) compiles anew instead of reusing the old constant."""
    case = build("masked")
    reference = copy.deepcopy(case.model)
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn)
    (x,), mask = case.args, case.kwargs["mask"]

    pipe.step(x, target=case.target, mask=mask, scale=0.5)
    first = pipe.compiled
    pipe.zero_grad()
    loss = pipe.step(x, target=case.target, mask=mask, scale=2.0)
    assert pipe.compiled is not first
    eager_loss = case.loss_fn(reference(x, mask=mask, scale=2.0), case.target)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach(), **FP32)
    assert_grads_close(grads_of(pipe), grads_of(reference), "scale=2.0", **FP32)


# --- other ways in -------------------------------------------------------------------------------


@zbcompile.pipeline(stages=2, microbatches=2, loss_fn=F.mse_loss, schedule="zb-h1")
class DecoratedMLP(MLP):
    """The zoo's MLP, pipelined by the class decorator."""


def test_class_decorator_returns_a_working_pipelined_module():
    torch.manual_seed(0)
    pipe = DecoratedMLP(inputs=6, hidden=8, outputs=4)
    assert isinstance(pipe, zbcompile.PipelinedModule)
    assert isinstance(pipe.module, MLP) and pipe.module.fc1.out_features == 8
    reference = copy.deepcopy(pipe.module)
    x, y = torch.randn(BATCH, 6), torch.randn(BATCH, 4)

    loss = pipe.step(x, target=y)
    eager_loss = F.mse_loss(reference(x), y)
    eager_loss.backward()
    assert len(pipe.compiled.partition.stages) == 2
    torch.testing.assert_close(loss, eager_loss.detach(), **FP32)
    assert_grads_close(grads_of(pipe), grads_of(reference), "decorated", **FP32)


def test_split_point_cuts_exactly_before_the_named_block():
    """`split_points=["blocks.1"]`: stage 0 holds the embeddings and block 0, stage 1 block 1 and
    the final norm (plus the tied head weight, owned by stage 0)."""
    case = build("gpt")
    reference = copy.deepcopy(case.model)
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn, split_points=["blocks.1"])
    loss = case.step(pipe)

    fqns = [n for n, _ in case.model.named_parameters()]
    block1 = [n for n in fqns if n.startswith("blocks.1.")]
    first, second = pipe.compiled.partition.stages
    assert set(first.param_fqns) == {n for n in fqns if not n.startswith(("blocks.1.", "ln_f."))}
    own = [n for n in second.param_fqns if n not in pipe.compiled.partition.shared_params]
    assert own[: len(block1)] == block1, f"stage 1 starts with {own[:3]}, not with block 1"
    assert set(second.param_fqns) == {*block1, "ln_f.weight", "ln_f.bias", "tok_emb.weight"}

    eager_loss = case.eager_loss(reference)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach(), **FP32)
    assert_grads_close(grads_of(pipe), grads_of(reference), "split at blocks.1", **FP32)


@pytest.mark.parametrize("stages", [1, 2], ids=lambda s: f"S{s}")
def test_sequential_model_with_numeric_child_names(stages):
    """nn.Sequential names its parameters `0.weight`, `2.bias`, ...; they must compile."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 2)
    pipe = zbcompile.pipeline(model, stages=stages, microbatches=2, loss_fn=F.mse_loss)

    loss = pipe.step(x, target=y)
    eager_loss = F.mse_loss(reference(x), y)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach(), **FP32)
    assert_grads_close(grads_of(pipe), grads_of(reference), "Sequential", **FP32)
