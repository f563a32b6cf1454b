"""Bad input raises a clear ValueError/TypeError that names the culprit (module, buffer, split
point, numbers) instead of failing deep inside a pass."""

from __future__ import annotations

import copy
import inspect
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zbcompile
from helpers.models import BATCH, build

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto", "interleaved-1f1b", "zbv")


def numbers_in(message: str) -> set[int]:
    return {int(n) for n in re.findall(r"(?<![\w.])-?\d+(?![\w.])", message)}


def mlp_pipe(**options):
    """The zoo MLP pipelined with `options`, and a function that runs one step."""
    case = build("mlp")
    options.setdefault("loss_fn", case.loss_fn)
    pipe = zbcompile.pipeline(case.model, **options)
    return pipe, lambda: case.step(pipe)


# --- data-dependent forward ----------------------------------------------------------------------


class DataDependentBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


class BooleanMaskIndex(nn.Module):
    """Output shape depends on the values (`x[x > 0]`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x[x > 0].sum()


class ItemScalar(nn.Module):
    """A Python number read out of a tensor (`.item()`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.max().item()


class Encoder(nn.Module):
    def __init__(self, gate: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.tanh(self.fc(x)))


class GatedNet(nn.Module):
    def __init__(self, gate: nn.Module) -> None:
        super().__init__()
        self.encoder = Encoder(gate)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder(x))


def _step_gated(gate: nn.Module, stages: int) -> None:
    torch.manual_seed(0)
    pipe = zbcompile.pipeline(GatedNet(gate), stages=stages, microbatches=2, loss_fn=F.mse_loss)
    pipe.step(torch.randn(BATCH, 4), target=torch.randn(BATCH, 2))


def _source_line(function, text: str) -> tuple[int, str]:
    lines, first = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return first + offset, lines[offset].strip()


@pytest.mark.parametrize("stages", [1, 2], ids=lambda s: f"S{s}")
@pytest.mark.parametrize(
    "gate, code",
    [
        pytest.param(DataDependentBranch, "x.sum() > 0", id="branch"),
        pytest.param(BooleanMaskIndex, "x[x > 0]", id="boolean-mask"),
        pytest.param(ItemScalar, ".item()", id="item"),
    ],
)
def test_data_dependent_forward_names_module_and_source_line(gate, code, stages):
    """A branch on tensor values, a value-dependent shape or a tensor read into Python is
    refused while tracing, with the module's FQN and the offending line of this file."""
    lineno, line = _source_line(gate.forward, code)
    with pytest.raises(ValueError) as info:
        _step_gated(gate(), stages)
    message = str(info.value)
    assert "'encoder.gate'" in message, message
    assert f"{__file__}:{lineno}" in message, message
    assert line in message, message


class FakeKernelRefuses(nn.Module):
    """`grouped_mm` runs eagerly in float32 on the CPU, but torch's shape-only kernel, which
    tracing uses, accepts bfloat16 only."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        return F.grouped_mm(x, self.experts, offs=offsets)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("debug", [False, True], ids=["quiet", "ZBCOMPILE_DEBUG"])
def test_error_inside_a_torch_kernel_names_module_and_line_without_torch_log(debug, monkeypatch):
    """torch logs a traceback before raising from a fake kernel: not logged unless
    ZBCOMPILE_DEBUG=1; the error names the module and the user's line either way."""
    monkeypatch.setenv("ZBCOMPILE_DEBUG", "1" if debug else "0")
    lineno, line = _source_line(FakeKernelRefuses.forward, "F.grouped_mm")
    records = _Records()
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(records)
    try:
        with pytest.raises(RuntimeError) as info:
            _step_gated(FakeKernelRefuses(), 2)
    finally:
        logger.removeHandler(records)
    message = str(info.value)
    assert "'encoder.gate'" in message and f"{__file__}:{lineno}" in message and line in message, message
    assert "BF16" in message and "ZBCOMPILE_DEBUG=1" in message, message
    assert any(r.exc_info for r in records.records) == debug, [r.getMessage() for r in records.records]


def test_error_in_loss_fn_names_it_and_its_line():
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output @ target).mean()  # (batch, 2) @ (batch, 2)

    lineno, line = _source_line(loss_fn, "output @ target")
    pipe = zbcompile.pipeline(GatedNet(nn.Identity()), stages=2, microbatches=2, loss_fn=loss_fn)
    with pytest.raises(RuntimeError) as info:
        pipe.step(torch.randn(BATCH, 4), target=torch.randn(BATCH, 2))
    message = str(info.value)
    assert "could not trace loss_fn" in message and f"{__file__}:{lineno}" in message and line in message, message


@torch.library.custom_op("zbcompile_tests::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CustomOpWithoutAutograd(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _double(x)


def test_op_without_a_derivative_names_stage_module_and_line():
    """Tracing the forward succeeds; deriving the stage's backward fails on the op."""
    lineno, line = _source_line(CustomOpWithoutAutograd.forward, "_double(x)")
    with pytest.raises(RuntimeError) as info:
        _step_gated(CustomOpWithoutAutograd(), 2)
    message = str(info.value)
    assert "backward of stage" in message and "'encoder.gate'" in message, message
    assert f"{__file__}:{lineno}" in message and line in message and "register_autograd" in message, message


def test_integer_tokens_into_a_linear_name_the_action_module_and_line():
    """Tracing computes with fake kernels, which let a Long input into a float Linear pass; the
    real kernel's refusal on the first step names the action, the module and the user's line."""
    lineno, line = _source_line(Encoder.forward, "self.fc(x)")
    pipe = zbcompile.pipeline(GatedNet(nn.Identity()), stages=2, microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(RuntimeError) as info:
        pipe.step(torch.randint(0, 4, (BATCH, 4)), target=torch.randn(BATCH, 2))
    message = str(info.value)
    assert "action 0F0" in message and "'encoder.fc'" in message, message
    assert f"{__file__}:{lineno}" in message and line in message and "Long and Float" in message, message


@torch.library.custom_op("zbcompile_tests::picky_grad", mutates_args=())
def _picky_grad(grad: torch.Tensor) -> torch.Tensor:
    raise ValueError("picky_grad refuses every gradient")


@_picky_grad.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


@torch.library.custom_op("zbcompile_tests::triple", mutates_args=())
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_triple.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_triple.register_autograd(lambda ctx, grad: _picky_grad(grad))


class BackwardRefuses(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _triple(x)


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_an_op_failing_in_the_backward_names_the_action_module_and_line(schedule):
    """Any op's error while a stage program runs keeps its type and names where it was traced:
    here a backward op (I, W or the fused B) that only the real kernel refuses."""
    lineno, line = _source_line(BackwardRefuses.forward, "_triple(x)")
    pipe = zbcompile.pipeline(
        GatedNet(BackwardRefuses()), stages=2, microbatches=2, loss_fn=F.mse_loss, schedule=schedule
    )
    with pytest.raises(ValueError) as info:
        pipe.step(torch.randn(BATCH, 4), target=torch.randn(BATCH, 2))
    message = str(info.value)
    assert re.search(r"action \d[IWB]\d", message) and "picky_grad" in message, message
    assert "'encoder.gate'" in message and f"{__file__}:{lineno}" in message and line in message, message


# --- stages and microbatches ---------------------------------------------------------------------


def _one_linear_step(stages: int) -> None:
    torch.manual_seed(0)
    pipe = zbcompile.pipeline(nn.Linear(4, 2), stages=stages, microbatches=2, loss_fn=F.mse_loss)
    pipe.step(torch.randn(BATCH, 4), target=torch.randn(BATCH, 2))


def test_more_stages_than_cuts_says_both_numbers():
    with pytest.raises(ValueError) as info:
        _one_linear_step(50)
    # the most stages this model takes, found by asking for more until it refuses
    most = 1
    while most < 50:
        try:
            _one_linear_step(most + 1)
        except ValueError:
            break
        most += 1
    assert most < 50
    assert {50, most} <= numbers_in(str(info.value)), str(info.value)


@pytest.mark.parametrize("batch, microbatches", [(10, 4), (8, 3), (2, 4)], ids=lambda v: str(v))
def test_batch_not_divisible_by_microbatches_says_both_numbers(batch, microbatches):
    torch.manual_seed(0)
    pipe = zbcompile.pipeline(nn.Linear(4, 2), stages=1, microbatches=microbatches, loss_fn=F.mse_loss)
    with pytest.raises(ValueError) as info:
        pipe.step(torch.randn(batch, 4), target=torch.randn(batch, 2))
    assert {batch, microbatches} <= numbers_in(str(info.value)), str(info.value)


@pytest.mark.parametrize(
    "stages, microbatches, culprit",
    [(0, 2, "stages"), (1, 0, "microbatches"), (1, -2, "microbatches")],
    ids=["stages=0", "microbatches=0", "microbatches=-2"],
)
def test_nonpositive_counts_are_refused(stages, microbatches, culprit):
    """`stages` and `microbatches` below 1 raise ValueError naming the option and its value
    (at pipeline() or at the first step)."""
    value = stages if culprit == "stages" else microbatches
    with pytest.raises(ValueError) as info:
        _, step = mlp_pipe(stages=stages, microbatches=microbatches)
        step()
    assert culprit in str(info.value) and value in numbers_in(str(info.value)), str(info.value)


# --- state that changes in the forward -----------------------------------------------------------


def _batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def test_batchnorm_in_eval_mode_is_accepted():
    """In eval() no buffer changes, and the step matches the whole-batch eager step (train mode:
    tests/runtime/test_buffer_updates.py)."""
    model = _batchnorm_model().eval()
    reference = copy.deepcopy(model)
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 2)
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=F.mse_loss)
    loss = pipe.step(x, target=y)
    eager = F.mse_loss(reference(x), y)
    eager.backward()
    torch.testing.assert_close(loss, eager.detach(), rtol=1e-5, atol=1e-6)
    for (fqn, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, fqn=fqn: f"{fqn}: {m}")


# --- split points --------------------------------------------------------------------------------


def test_split_point_naming_no_module():
    _, step = mlp_pipe(stages=2, microbatches=2, split_points=["fc9"])
    with pytest.raises(ValueError, match="'fc9'"):
        step()


@pytest.mark.parametrize("split_points", [["fc2"], ["fc2", "fc3", "fc3"]], ids=["too-few", "too-many"])
def test_split_point_count_must_match_stages(split_points):
    _, step = mlp_pipe(stages=3, microbatches=2, split_points=split_points)
    with pytest.raises(ValueError) as info:
        step()
    assert {3, len(split_points)} <= numbers_in(str(info.value)), str(info.value)


@pytest.mark.parametrize("split_points", [["fc3", "fc2"], ["fc2", "fc2"]], ids=["reversed", "repeated"])
def test_split_points_out_of_order(split_points):
    _, step = mlp_pipe(stages=3, microbatches=2, split_points=split_points)
    with pytest.raises(ValueError, match="'fc2'"):
        step()


def test_split_point_at_the_first_module_says_the_first_stage_would_be_empty():
    """A cut before the model's first module leaves stage 0 with nothing to do; the error says
    that, not that the cut falls inside a multi-output op or after the loss."""
    _, step = mlp_pipe(stages=2, microbatches=2, split_points=["fc1"])
    with pytest.raises(ValueError) as info:
        step()
    message = str(info.value)
    assert "'fc1'" in message
    assert re.search(r"empty|nothing|no (work|ops|operations)", message), message


# --- schedule, loss and inputs -------------------------------------------------------------------


def test_unknown_schedule_lists_the_valid_names():
    with pytest.raises(ValueError) as info:
        _, step = mlp_pipe(stages=2, microbatches=2, schedule="zb-h3")
        step()
    message = str(info.value)
    assert "'zb-h3'" in message
    missing = [name for name in SCHEDULES if name not in message]
    assert not missing, f"{missing} not listed in: {message}"


def test_loss_fn_returning_a_tensor_per_sample_is_a_type_error():
    _, step = mlp_pipe(stages=2, microbatches=2, loss_fn=lambda output, target: (output - target) ** 2)
    with pytest.raises(TypeError, match="loss_fn") as info:
        step()
    assert "scalar" in str(info.value)


def test_target_with_another_batch_size():
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn)
    (x,) = case.args
    with pytest.raises(ValueError) as info:
        pipe.step(x, target=case.target[:4])
    message = str(info.value)
    assert str(tuple(x.shape)) in message and str(tuple(case.target[:4].shape)) in message, message


def test_keyword_tensor_with_another_batch_size():
    case = build("masked")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn)
    mask = case.kwargs["mask"][:4]
    with pytest.raises(ValueError) as info:
        pipe.step(*case.args, target=case.target, mask=mask, scale=0.5)
    message = str(info.value)
    assert str(tuple(case.args[0].shape)) in message and str(tuple(mask.shape)) in message, message


def test_pipeline_of_something_that_is_not_a_module():
    with pytest.raises(TypeError, match="int"):
        zbcompile.pipeline(42, stages=2)


def test_fewer_microbatches_than_the_schedule_needs():
    """Interleaved 1F1B runs microbatches in rounds of one per rank: 2 ranks need a multiple of 2."""
    case = build("gpt")
    pipe = zbcompile.pipeline(case.model, stages=4, microbatches=1, loss_fn=case.loss_fn, schedule="interleaved-1f1b")
    with pytest.raises(ValueError, match=r"interleaved-1f1b.*1 microbatches.*2 ranks"):
        case.step(pipe)
