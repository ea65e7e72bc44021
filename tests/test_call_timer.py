"""CallTimer: runs timed by a clock or CUDA events, and with the GPU held first."""

import pytest
import torch

from lightning_cg.call_timer import CallTimer


def timed_seconds(timer: CallTimer, body, on_cuda: bool, hold: float = 0.0) -> list[float]:
    recorded: list[float] = []
    with timer.timed(recorded.append, hold_gpu_seconds=hold) as timing:
        body()
        timing.on_cuda = on_cuda
    timer.collect(wait=True)
    assert timing.host_seconds > 0
    return recorded


def test_a_host_run_is_timed_by_the_clock_at_once():
    recorded = timed_seconds(CallTimer(), lambda: sum(range(10_000)), on_cuda=False)
    assert len(recorded) == 1 and recorded[0] > 0


def test_a_held_run_whose_work_is_not_on_the_gpu_records_nothing():
    # A held run times the GPU's work alone; host work is none of it.
    assert timed_seconds(CallTimer(), lambda: sum(range(10_000)), False, hold=0.01) == []


@pytest.mark.cuda
def test_holding_the_gpu_times_its_work_without_the_launch_gaps():
    # Two hundred tiny kernels (fewer than CUDA queues while the GPU is held):
    # the host launches them more slowly than the GPU runs them, so unheld
    # events time the launches; held ones the kernels alone.
    x = torch.zeros(16, device="cuda")

    def launches() -> None:
        for _ in range(200):
            x.add_(1)

    timer = CallTimer()
    launches()
    unheld = timed_seconds(timer, launches, on_cuda=True)[0]
    held = timed_seconds(timer, launches, on_cuda=True, hold=3 * unheld)
    assert len(held) == 1
    assert held[0] < 0.6 * unheld
    torch.testing.assert_close(x, torch.full_like(x, 600.0))


@pytest.mark.cuda
def test_a_hold_shorter_than_the_launches_records_nothing():
    x = torch.zeros(16, device="cuda")

    def launches() -> None:
        for _ in range(200):
            x.add_(1)

    timer = CallTimer()
    launches()
    assert timed_seconds(timer, launches, on_cuda=True, hold=1e-6) == []
