"""CallTimer: a run costs the longer of its GPU time and its host launch time."""

import time

import pytest
import torch

from lightning_cg.engine import call_timer
from lightning_cg.engine.call_timer import CallTimer


class FakeEvent:
    """A CUDA event whose pair reads a scripted GPU time."""

    gpu_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        return FakeEvent.gpu_ms


@pytest.fixture
def fake_cuda_timer(monkeypatch) -> CallTimer:
    monkeypatch.setattr(call_timer.torch.cuda, "Event", FakeEvent)
    timer = CallTimer()
    timer._cuda = True
    return timer


def timed_run(timer: CallTimer, host_seconds: float, on_cuda: bool = True) -> list[float]:
    recorded: list[float] = []
    with timer.timed(recorded.append) as timing:
        time.sleep(host_seconds)
        timing.on_cuda = on_cuda
    timer.collect()
    return recorded


def test_a_gpu_bound_run_costs_its_gpu_time(fake_cuda_timer):
    FakeEvent.gpu_ms = 200.0
    assert timed_run(fake_cuda_timer, host_seconds=0.001) == [pytest.approx(0.2)]


def test_a_launch_bound_run_costs_its_host_time_whatever_the_events_say(fake_cuda_timer):
    # Kernels that queued behind earlier work ran back to back: the events saw
    # 1 ms, but launching them held the host for 30 ms.
    FakeEvent.gpu_ms = 1.0
    (seconds,) = timed_run(fake_cuda_timer, host_seconds=0.03)
    assert 0.03 <= seconds < 0.2


def test_a_run_without_gpu_work_is_clocked_at_once(fake_cuda_timer):
    FakeEvent.gpu_ms = 500.0
    (seconds,) = timed_run(fake_cuda_timer, host_seconds=0.01, on_cuda=False)
    assert 0.01 <= seconds < 0.4


def test_the_cpu_path_reads_a_clock():
    timer = CallTimer()
    if timer._cuda:
        pytest.skip("checks the timer without a GPU")
    (seconds,) = timed_run(timer, host_seconds=0.01)
    assert 0.01 <= seconds < 0.5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_queued_behind_earlier_work_cost_their_launch_time():
    # Earlier matmuls keep the stream busy while the host spends 30 ms launching
    # a few tiny kernels: they run back to back once the stream is free, so the
    # events between them see almost nothing.
    timer = CallTimer()
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(30):
        big @ big
    recorded: list[float] = []
    with timer.timed(recorded.append) as timing:
        for _ in range(3):
            big[0, 0].add_(1.0)
            time.sleep(0.01)
        timing.on_cuda = True
    torch.cuda.synchronize()
    timer.collect()
    assert recorded[0] >= 0.03
