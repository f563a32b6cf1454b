"""The CUDA path's pieces, on CPU with the CUDA calls substituted: one device per rank chosen
and checked before the first collective, one flat buffer per message, per-action times from
events read at the step's end, peaks from the allocator's statistics, sent buffers released
when their send completes, no device-wide synchronize in a step."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from helpers import nccl_model
from zbcompile.runtime.parallel import cuda_device
from zbcompile.runtime.step import flat_message
from zbcompile.runtime.step import transport as transport_module
from zbcompile.runtime.step.action_clock import EventClock, HostClock
from zbcompile.runtime.step.live_memory import AllocatorPeak, peak_inside
from zbcompile.runtime.step.transport import Transport
from zbcompile.schedules import make_schedule

# --- one CUDA device per rank ---------------------------------------------------------------


class FakeCuda:
    """Stands in for `torch.cuda` on a machine with `count` GPUs."""

    def __init__(self, count: int, current: int = 0) -> None:
        self.count, self.current = count, current

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        self.current = index

    def get_device_properties(self, index: int):
        return SimpleNamespace(uuid=f"GPU-{index}")


class FakeStore(dict):
    def set(self, key, value):
        self[key] = value

    def get(self, key):
        return self[key].encode()


def test_the_device_is_local_ranks_unless_bound_or_chosen():
    cuda = FakeCuda(4)
    assert cuda_device.choose_device(None, cuda, {"LOCAL_RANK": "2"}) == 2 and cuda.current == 2
    cuda = FakeCuda(4, current=3)  # the user chose one: kept
    assert cuda_device.choose_device(None, cuda, {"LOCAL_RANK": "1"}) == 3
    cuda = FakeCuda(4)  # init_process_group(device_id=...) wins
    assert cuda_device.choose_device(torch.device("cuda", 1), cuda, {"LOCAL_RANK": "3"}) == 1 and cuda.current == 1
    cuda = FakeCuda(1)  # one visible device per process (CUDA_VISIBLE_DEVICES): that one
    assert cuda_device.choose_device(None, cuda, {"LOCAL_RANK": "5"}) == 0


def test_two_ranks_on_one_device_fail_naming_both():
    store = FakeStore()
    store.set(cuda_device.KEY.format(rank=0), "node7/GPU-0")
    cuda_device.check_distinct(1, [0, 1], "node7/GPU-1", store)  # distinct: fine
    with pytest.raises(ValueError, match=r"ranks 0 and 1 both use the CUDA device GPU-0 on host node7.*LOCAL_RANK"):
        cuda_device.check_distinct(1, [0, 1], "node7/GPU-0", store)
    store.set(cuda_device.KEY.format(rank=0), "node8/GPU-0")  # the same index on another host: fine
    cuda_device.check_distinct(1, [0, 1], "node7/GPU-0", store)


def test_claim_device_sets_local_ranks_device_and_publishes_it():
    store, cuda = FakeStore(), FakeCuda(2)
    store.set(cuda_device.KEY.format(rank=0), "elsewhere/GPU-0")
    import os

    previous = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "1"
    try:
        device = cuda_device.claim_device([0, 1], 1, None, store, cuda)
    finally:
        os.environ.pop("LOCAL_RANK") if previous is None else os.environ.__setitem__("LOCAL_RANK", previous)
    assert device == torch.device("cuda", 1) and cuda.current == 1
    assert store[cuda_device.KEY.format(rank=1)].endswith("/GPU-1")


# --- one flat buffer per message --------------------------------------------------------------


def test_a_message_of_several_tensors_is_one_buffer_with_their_bits():
    tensors = [
        torch.randn(3, 5).t(),
        torch.tensor([True, False, True]),
        torch.randn(2, dtype=torch.bfloat16),
        torch.arange(7),
    ]
    flat = flat_message.pack(tensors)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    layouts = [(t.shape, t.dtype) for t in tensors]
    assert flat.numel() == flat_message.offsets(layouts)[1]
    for sent, got in zip(tensors, flat_message.unpack(flat.clone(), layouts)):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))  # the same bits
    one = torch.randn(4)
    assert flat_message.pack([one]) is one  # one tensor travels as itself


class RecordingWork:
    def __init__(self, log, op, tensor):
        self.log, self.op, self.tensor, self.completed = log, op, tensor, False

    def wait(self, timeout=None):
        self.log.append(("wait", self.op, timeout is not None))
        return True

    def is_completed(self):
        return self.completed


def _nccl_transport(monkeypatch, group="the pipeline's group"):
    """A Transport over a stand-in NCCL backend that records its calls."""
    log, works = [], []

    def post(op):
        def call(tensor, peer, group=None, tag=0):
            log.append((op, peer, group, tensor.numel() * tensor.element_size()))
            works.append(RecordingWork(log, op, tensor))
            return works[-1]

        return call

    monkeypatch.setattr(
        transport_module,
        "dist",
        SimpleNamespace(get_backend=lambda group=None: "nccl", isend=post("isend"), irecv=post("irecv")),
    )
    transport = Transport(0, timedelta(seconds=5), group)
    transport.device = torch.device("cpu")
    return transport, log, works


def test_a_message_is_one_isend_and_one_irecv_on_the_pipelines_group(monkeypatch):
    transport, log, _ = _nccl_transport(monkeypatch)
    transport.send([torch.zeros(3), torch.ones(2, dtype=torch.int64)], 1, 7, "0SEND_F0")
    layouts = [torch.empty(3, device="meta"), torch.empty(2, dtype=torch.int64, device="meta")]
    pending = transport.post_recv(layouts, 1, 8, "0RECV_B0")
    assert [entry[:3] for entry in log] == [("isend", 1, "the pipeline's group"), ("irecv", 1, "the pipeline's group")]
    assert log[0][3] == log[1][3] == flat_message.offsets([(l.shape, l.dtype) for l in layouts])[1]
    received = transport.wait(pending, "0I0")
    assert [t.shape for t in received] == [torch.Size([3]), torch.Size([2])] and received[1].dtype == torch.int64
    assert log[-1] == ("wait", "irecv", False)  # the stream waits, the host does not
    transport.complete_messages()
    assert log[-2:] == [
        ("wait", "isend", True),
        ("wait", "irecv", True),
    ]  # confirmed at the step's end, with the timeout


def test_a_sent_buffer_is_counted_until_its_send_completes(monkeypatch):
    transport, _, works = _nccl_transport(monkeypatch)
    transport.send([torch.zeros(4)], 1, 1, "a")
    transport.send([torch.zeros(8)], 1, 2, "b")
    assert transport.sending_bytes == 48 and transport.peak_sending_bytes == 48
    works[0].completed = True
    transport.send([torch.zeros(2)], 1, 3, "c")  # posting the next one releases the first
    assert transport.sending_bytes == 40 and len(transport._sends) == 2
    transport.complete_messages()
    assert transport.sending_bytes == 0 and transport.peak_sending_bytes == 48


# --- timing and memory --------------------------------------------------------------------


class FakeEvent:
    """A CUDA event on a device whose clock is `now[0]` milliseconds when it is recorded."""

    queried = 0

    def __init__(self, now) -> None:
        self.now, self.at = now, None

    def record(self) -> None:
        self.at = self.now[0]

    def query(self) -> bool:
        FakeEvent.queried += 1
        return True

    def elapsed_time(self, other) -> float:
        return other.at - self.at


def test_event_clock_reads_device_times_at_the_end_of_the_step():
    now = [100.0]
    clock = EventClock(lambda: FakeEvent(now))
    clock.start_step()
    started = clock.mark()
    now[0] += 30.0  # the device ran the action for 30 ms
    clock.record("compute", "0F0", started)
    assert clock.seconds_since(started) == 0.0 and not clock.on_host
    queried = FakeEvent.queried
    intervals = clock.end_step(timeout_s=1)
    assert FakeEvent.queried == queried + 1  # waited for the last event only
    ((label, start, end),) = intervals["compute"]
    assert label == "0F0" and end - start == pytest.approx(0.030)


def test_host_clock_is_perf_counter():
    clock = HostClock()
    clock.start_step()
    started = clock.mark()
    clock.record("comm", "0SEND_F0", started)
    ((label, start, end),) = clock.end_step(timeout_s=1)["comm"]
    assert label == "0SEND_F0" and end >= start == started


def test_allocator_peak_on_cuda_counts_what_the_action_took_and_allocated():
    stats = SimpleNamespace(allocated=1000, peak=1000)
    cuda = SimpleNamespace(
        memory_allocated=lambda device: stats.allocated,
        reset_peak_memory_stats=lambda device: setattr(stats, "peak", stats.allocated),
        max_memory_allocated=lambda device: stats.peak,
    )

    def action():
        stats.peak, stats.allocated = 1000 + 4096, 1000 + 512  # 4 KiB at its peak, 512 B left

    with AllocatorPeak(torch.device("cuda", 0), cuda) as allocator:
        action()
    assert allocator.peak == 4096
    taken = {"x": torch.zeros(25)}
    stats.allocated = 1000
    assert peak_inside(action, taken.values(), torch.device("cuda", 0), cuda) == 100 + 4096
    assert peak_inside(lambda: torch.zeros(50), taken.values(), torch.device("cpu")) == 100 + 200  # the tracker on CPU


def test_no_device_wide_synchronize_inside_a_step(monkeypatch):
    """A CUDA-typed interpreter (events, NCCL transport) runs a schedule with
    `torch.cuda.synchronize` made to raise: nothing calls it."""

    def forbidden(self, device=None):
        raise AssertionError("torch.cuda.synchronize called inside a step")

    monkeypatch.setattr(nccl_model.Model, "synchronize", forbidden)  # what run_step puts in torch.cuda's place
    for name in ("zb-h1", "interleaved-1f1b"):
        schedule = make_schedule(name, 4, 4)
        model = nccl_model.run_step(schedule, True, True, monkeypatch)
        assert torch.cuda.synchronize.__func__ is forbidden
        assert sum(item[0] == "compute" for log in model.logs for item in log) == sum(map(len, schedule.actions))
