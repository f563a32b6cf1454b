"""Buffers the forward updates in place (BatchNorm's running statistics in training, counters,
EMAs): a pipelined step equals the eager run microbatch by microbatch (forward, then
`(loss / m).backward()`, for each microbatch in order), bit for bit in one process, under every
schedule, over consecutive optimizer steps; across ranks to rtol 1e-5. Updating a parameter in
the forward stays refused."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zbcompile
from helpers import launches
from helpers.models import BATCH, BatchNormConvNet, image_batch, microbatch_by_microbatch, sgd_steps

# the second step's forwards read the statistics the first step left (the two-rank launch's too)
MICROBATCHES, STEPS = launches.BUFFER_MICROBATCHES, launches.BUFFER_STEPS
SCHEDULES = {
    2: (
        "1f1b",
        "zb-h1",
        "zb-h2",
        "zb-auto",
        "zbv",
        "interleaved-1f1b",
        "v-min",
        "v-half",
        "v-zb",
        "looped-bfs",
        "dualpipev",
    ),
    3: ("1f1b", "gpipe", "zb-h1", "zb-h2", "zb-auto"),
}


def eager_record(model: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn) -> list[dict]:
    """The reference: STEPS SGD steps of (a copy of) the eager model run microbatch by microbatch."""
    model = copy.deepcopy(model)
    return sgd_steps(model, lambda: microbatch_by_microbatch(model, x, target, loss_fn, MICROBATCHES), STEPS)


def pipelined_records(model: nn.Module, x, target, loss_fn, stages: int, schedules, **options):
    """STEPS SGD steps of `model` pipelined under each schedule, each from the model's initial
    state (one compile, shared through set_schedule); returns the pipeline and the records."""
    initial = copy.deepcopy(model.state_dict())
    pipe = zbcompile.pipeline(
        model, stages=stages, microbatches=MICROBATCHES, loss_fn=loss_fn, schedule=schedules[0], **options
    )
    records = {}
    for schedule in schedules:
        model.load_state_dict(initial)
        pipe.set_schedule(schedule)
        records[schedule] = sgd_steps(model, lambda: pipe.step(x, target=target), STEPS, pipe.parameters())
    return pipe, records


def assert_records_equal(actual: list[dict], expected: list[dict], what: str) -> None:
    """Loss, every gradient, parameter and buffer equal bit for bit, step by step."""
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a["loss"], e["loss"]), f"{what} step {step}: loss {a['loss']} != {e['loss']}"
        for field in ("grads", "params", "buffers"):
            assert a[field].keys() == e[field].keys(), f"{what} step {step}: {field}"
            for name, value in e[field].items():
                assert torch.equal(a[field][name], value), f"{what} step {step}: {field} {name} differs from eager"


def updates_by_stage(pipe) -> list[tuple[str, ...]]:
    return [p.stage.buffer_updates for p in pipe.compiled.programs]


# --- BatchNorm -----------------------------------------------------------------------------------


@functools.cache
def _convnet_reference() -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[dict]]:
    torch.manual_seed(0)
    model = BatchNormConvNet()
    x, target = image_batch()
    return model, x, target, eager_record(model, x, target, F.cross_entropy)


@pytest.mark.parametrize("stages", sorted(SCHEDULES))
def test_batchnorm_convnet_in_train_mode_equals_eager_microbatch_by_microbatch(stages):
    """Losses, gradients, running_mean/var and num_batches_tracked after each of two SGD steps,
    bit for bit, under every schedule (so gradients are bitwise equal across schedules too)."""
    model, x, target, expected = _convnet_reference()
    pipe, records = pipelined_records(copy.deepcopy(model), x, target, F.cross_entropy, stages, SCHEDULES[stages])
    for schedule, record in records.items():
        assert_records_equal(record, expected, f"{stages} stages, {schedule}")
    assert expected[-1]["buffers"]["block1.1.num_batches_tracked"] == STEPS * MICROBATCHES
    updated = [fqn for stage in updates_by_stage(pipe) for fqn in stage]
    assert sorted(updated) == sorted(expected[0]["buffers"]), "every buffer updated on exactly one stage"


def test_batchnorm_statistics_move_with_the_batch():
    """The comparison above is not vacuous: the running statistics change in every step."""
    model, _, _, expected = _convnet_reference()
    for name, before in model.named_buffers():
        assert not torch.equal(expected[0]["buffers"][name], before), name
        assert not torch.equal(expected[1]["buffers"][name], expected[0]["buffers"][name]), name


def test_two_copies_of_a_stage_that_updates_buffers_are_refused():
    """dualpipe runs each stage in two copies, each for half of the microbatches: the running
    statistics would see neither all the microbatches nor them in order. Refused, naming the stage
    and its buffers, in one process (at compile, and on set_schedule) and so on every rank."""
    model, x, target, _ = _convnet_reference()
    pipe = zbcompile.pipeline(
        copy.deepcopy(model), stages=2, microbatches=MICROBATCHES, loss_fn=F.cross_entropy, schedule="dualpipe"
    )
    with pytest.raises(
        ValueError, match=r"stage 0 updates buffers in its forward \(block1\.1\.num_batches_tracked, .*dualpipev"
    ):
        pipe.step(x, target=target)
    pipe = zbcompile.pipeline(
        copy.deepcopy(model), stages=2, microbatches=MICROBATCHES, loss_fn=F.cross_entropy, schedule="1f1b"
    )
    pipe.step(x, target=target)
    with pytest.raises(ValueError, match="two copies of the pipeline"):
        pipe.set_schedule("dualpipe")


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: two 3x3 conv + BatchNorm, the shortcut a strided 1x1
    conv + BatchNorm where the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.downsample = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(4, 4)
        self.layer2 = BasicBlock(4, 8, stride=2)
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


def test_resnet_blocks_with_downsample_equal_eager_microbatch_by_microbatch():
    torch.manual_seed(0)
    model = TinyResNet()
    x, target = image_batch(seed=2)
    expected = eager_record(model, x, target, F.cross_entropy)
    _, records = pipelined_records(model, x, target, F.cross_entropy, 2, ("zb-h1", "zbv"))
    for schedule, record in records.items():
        assert_records_equal(record, expected, schedule)


def test_batchnorm_in_eval_mode_updates_nothing():
    torch.manual_seed(0)
    model = BatchNormConvNet().eval()
    before = copy.deepcopy(model.state_dict())
    x, target = image_batch()
    pipe = zbcompile.pipeline(model, stages=2, microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
    pipe.step(x, target=target)
    assert updates_by_stage(pipe) == [()] * len(pipe.compiled.programs)  # zb-auto may cut 2 stages or a V of 4
    for name, value in model.named_buffers():
        assert torch.equal(value, before[name]), name


def test_forwards_out_of_microbatch_order_are_refused_where_buffers_update():
    torch.manual_seed(0)
    x, target = image_batch()
    # one stage per rank, so that stage 0 holds the first BatchNorm
    pipe = zbcompile.pipeline(
        BatchNormConvNet(), stages=2, microbatches=MICROBATCHES, loss_fn=F.cross_entropy, schedule="1f1b"
    )
    pipe.compile(x, target=target)
    first = pipe.executors[0]
    first.forward(0, {"input_0": x[:2]})
    with pytest.raises(RuntimeError, match=r"stage 0: F of microbatch 2 follows F of microbatch 0.*microbatch order"):
        first.forward(2, {"input_0": x[4:6]})


# --- buffers of the model's own --------------------------------------------------------------------


class RunningState(nn.Module):
    """Buffers updated in the forward without BatchNorm: a call counter read after its update
    (it scales the activations), an EMA of a batch mean under no_grad whose new value the
    forward reads, and a count of samples nothing reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("samples", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.fc1(x)) / self.calls
        h = torch.tanh(self.fc2(h))
        with torch.no_grad():
            self.ema.lerp_(h.mean(0), 0.1)
        self.samples += x.shape[0]
        return self.fc3(h - self.ema)


def test_counters_and_ema_buffers_equal_eager_microbatch_by_microbatch():
    torch.manual_seed(0)
    model = RunningState()
    generator = torch.Generator().manual_seed(3)
    x, target = torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)
    expected = eager_record(model, x, target, F.mse_loss)
    pipe, records = pipelined_records(model, x, target, F.mse_loss, 3, ("1f1b", "zb-h2"))
    for schedule, record in records.items():
        assert_records_equal(record, expected, schedule)
    assert expected[-1]["buffers"]["samples"] == STEPS * BATCH
    assert updates_by_stage(pipe)[0] == ("calls",)  # with its reader, fc1's output


class DecayedScale(nn.Module):
    """Scales its activations by a buffer that autograd saves, then decays the buffer through
    `.data` (which autograd does not track, like BatchNorm's own update of its statistics): an
    eager backward reads the buffer with its own microbatch's update applied."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x)) * self.scale
        self.scale.data.mul_(0.5)
        return self.fc2(h)


def test_backward_reads_an_updated_buffer_as_its_own_microbatch_left_it():
    """Under gpipe every forward of stage 0 runs before its first backward, so the buffer holds the
    last microbatch's value by then; each backward still computes with its own."""
    torch.manual_seed(0)
    model = DecayedScale()
    generator = torch.Generator().manual_seed(5)
    x, target = torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)
    expected = eager_record(model, x, target, F.mse_loss)
    _, records = pipelined_records(model, x, target, F.mse_loss, 2, ("gpipe", "zb-h2"), split_points=["fc2"])
    for schedule, record in records.items():
        assert_records_equal(record, expected, schedule)


class SharedShift(nn.Module):
    """A buffer read at the start of the forward and updated after fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 3)
        self.register_buffer("shift", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x) - self.shift)))
        with torch.no_grad():
            self.shift.mul_(0.9).add_(0.1 * h.mean(0))
        return self.fc3(h)


def test_reads_and_update_of_a_buffer_stay_on_one_stage():
    """The balanced cut keeps the read (after fc1) and the update (after fc2) on one stage, and the
    step still equals eager."""
    torch.manual_seed(0)
    model = SharedShift()
    generator = torch.Generator().manual_seed(4)
    x, target = torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)
    expected = eager_record(model, x, target, F.mse_loss)
    pipe, records = pipelined_records(model, x, target, F.mse_loss, 2, ("zb-h1",))
    assert_records_equal(records["zb-h1"], expected, "zb-h1")
    readers = [s.index for s in pipe.compiled.partition.stages if "shift" in s.buffer_fqns]
    writers = [s.index for s in pipe.compiled.partition.stages if "shift" in s.buffer_updates]
    assert readers == writers and len(writers) == 1, (readers, writers)


def test_split_point_between_the_read_and_the_update_of_a_buffer_names_it():
    pipe = zbcompile.pipeline(SharedShift(), stages=2, microbatches=2, loss_fn=F.mse_loss, split_points=["fc2"])
    with pytest.raises(ValueError, match=r"split point 'fc2' .*buffer 'shift'.*'fc2'"):
        pipe.step(torch.randn(BATCH, 6), target=torch.randn(BATCH, 3))


# --- refused -------------------------------------------------------------------------------------


class DecayedGain(nn.Module):
    """Decays a frozen parameter in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gain.mul_(0.5)
        return self.fc(x) * self.gain


def test_parameter_updated_in_the_forward_is_refused_with_the_module():
    model = nn.Sequential(nn.Linear(4, 4), DecayedGain(), nn.Linear(4, 2))
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"module '1' mutates parameter '1\.gain' in place.*register_buffer"):
        pipe.step(torch.randn(BATCH, 4), target=torch.randn(BATCH, 2))


def test_batchnorm_with_a_cumulative_average_is_refused_with_the_module():
    """BatchNorm(momentum=None) reads its counter as a Python number (the README says so)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None), nn.Linear(4, 2))
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"cannot trace data-dependent control flow in module '1' \(BatchNorm1d\)"):
        pipe.step(torch.randn(BATCH, 4), target=torch.randn(BATCH, 2))
    assert int(model[1].num_batches_tracked) == 0 and torch.equal(model[1].running_mean, torch.zeros(4))


def test_parameter_updated_through_data_is_refused():
    class Shrink(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc.weight.data.mul_(0.5)
            return self.fc(x)

    pipe = zbcompile.pipeline(Shrink(), stages=1, microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="in-place update of a parameter"):
        pipe.step(torch.randn(BATCH, 4), target=torch.randn(BATCH, 2))


def test_input_updated_in_place_is_refused():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(0.5)
            return self.fc(x)

    pipe = zbcompile.pipeline(Scale(), stages=1, microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"mutates input 'input_0' in place"):
        pipe.step(torch.randn(BATCH, 4), target=torch.randn(BATCH, 2))


# --- several processes -----------------------------------------------------------------------------


@launches.READS_TWO_RANKS
def test_batchnorm_convnet_on_two_ranks_equals_eager():
    """Two pipeline ranks (zb-h1, then zbv with two chunks per rank): gradients, loss and the
    gathered state dict (parameters and running statistics) after two SGD steps equal eager's
    microbatch-by-microbatch run; two data-parallel replicas of one stage each keep the running
    statistics of their own half of the batch."""
    model, x, target, expected = _convnet_reference()
    per_rank = launches.two_rank_results("buffers")  # the shared two-rank launch
    close = dict(rtol=1e-5, atol=1e-6)
    for run in ("zb-h1", "zbv"):
        for step in range(STEPS):
            losses = [r[run][step]["loss"] for r in per_rank if r[run][step]["loss"] is not None]
            assert len(losses) == 1
            torch.testing.assert_close(losses[0], expected[step]["loss"], **close)
            for field in ("grads", "state"):
                gathered = {k: v for r in per_rank for k, v in r[run][step][field].items()}
                want = (
                    expected[step]["grads"]
                    if field == "grads"
                    else {**expected[step]["buffers"], **expected[step]["params"]}
                )
                assert gathered.keys() == want.keys(), (run, field)
                for name, value in want.items():
                    torch.testing.assert_close(gathered[name], value, **close, msg=f"{run} step {step} {field} {name}")
    replicas = eager_replicas(model, x, target)
    for rank, result in enumerate(per_rank):
        for step in range(STEPS):
            for name, value in replicas[rank][step].items():
                torch.testing.assert_close(
                    result["1f1b"][step]["state"][name], value, **close, msg=f"replica {rank} {name}"
                )
    own = [r["1f1b"][-1]["state"]["block1.1.running_mean"] for r in per_rank]
    assert not torch.equal(own[0], own[1]), "each replica's statistics are those of its own half of the batch"


def eager_replicas(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> list[list[dict]]:
    """Two data-parallel replicas, eagerly: each runs its half of the batch microbatch by
    microbatch, both take the SGD step with the mean of their gradients; per replica and step,
    its state dict after the update."""
    copies = [copy.deepcopy(model) for _ in range(2)]
    optimizers = [torch.optim.SGD(c.parameters(), lr=0.1) for c in copies]
    halves = list(zip(x.chunk(2), target.chunk(2)))
    record: list[list[dict]] = [[], []]
    for _ in range(STEPS):
        for replica, optimizer, (xs, ts) in zip(copies, optimizers, halves):
            optimizer.zero_grad()
            microbatch_by_microbatch(replica, xs, ts, F.cross_entropy, MICROBATCHES)
        for params in zip(*(c.parameters() for c in copies)):
            mean = (params[0].grad + params[1].grad) / 2
            for p in params:
                p.grad = mean.clone()
        for d, (replica, optimizer) in enumerate(zip(copies, optimizers)):
            optimizer.step()
            record[d].append({k: v.clone() for k, v in replica.state_dict().items()})
    return record
