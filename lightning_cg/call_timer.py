"""Time individual runs without making the GPU wait.

On CUDA a run is bracketed by two events on the current stream; the elapsed
time is read once the end event has completed (:meth:`CallTimer.collect`
polls, it never synchronises unless asked to). On the CPU a clock is read
around the run. Only the few runs the capture policy asks about are timed.

A run may also be timed with the GPU held first (a spin kernel), so that its
kernels queue up and then run back to back: the events then time the GPU's
work alone, without the gaps where it waited for the host's launches (see
:mod:`lightning_cg.gpu_work`).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

Record = Callable[[float], None]
#: Clock cycles of the spin kernel that measures the GPU's clock rate (~1 ms).
CALIBRATION_CYCLES = 2_000_000


@dataclass
class Timing:
    """Set by a timed body: whether its work ran on the GPU (events time it); and,
    once it ends, its host seconds (how long it took to launch its work) and
    whether it is recorded (a held run may not be)."""

    on_cuda: bool = False
    host_seconds: float = 0.0
    recorded: bool = False


class CallTimer:
    """Times runs and hands each duration in seconds to a callback once known."""

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, Record]] = deque()
        # Asked once: without a GPU, torch asks NVML anew on every call (~0.3 ms here).
        self._cuda = torch.cuda.is_available()
        self._cycles_per_second: float | None = None

    @contextlib.contextmanager
    def timed(self, record: Record, hold_gpu_seconds: float = 0.0) -> Iterator[Timing]:
        """Time the body, which sets ``timing.on_cuda`` when its work ran on the GPU;
        ``record(seconds)`` is called now (CPU) or by a later :meth:`collect` (CUDA).

        With ``hold_gpu_seconds``, the GPU is first held that long, and the run is
        recorded only if its work ran on the GPU and its launches ended within the
        hold: the events then time the GPU's work alone.
        """
        timing = Timing()
        hold = hold_gpu_seconds > 0
        start = None
        if self._cuda:
            if hold:
                self._hold_gpu(hold_gpu_seconds)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        yield timing
        timing.host_seconds = time.perf_counter() - started
        if hold and (start is None or not timing.on_cuda or timing.host_seconds > hold_gpu_seconds):
            return
        timing.recorded = True
        if start is None or not timing.on_cuda:
            record(timing.host_seconds)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end, record))

    def collect(self, wait: bool = False) -> None:
        """Hand over the durations of completed runs (of all, waiting for them, if ``wait``)."""
        while self._pending:
            start, end, record = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            record(start.elapsed_time(end) / 1000.0)

    def clear(self) -> None:
        """Drop the runs not collected yet."""
        self._pending.clear()

    def _hold_gpu(self, seconds: float) -> None:
        """Queue a spin kernel that keeps the current stream busy about ``seconds``."""
        torch.cuda._sleep(max(int(seconds * self._gpu_cycles_per_second()), 1))

    def _gpu_cycles_per_second(self) -> float:
        """The GPU's clock rate, measured once (a spin kernel counts clock cycles)."""
        if self._cycles_per_second is None:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
            seconds = max(start.elapsed_time(end) / 1000.0, 1e-6)
            self._cycles_per_second = CALIBRATION_CYCLES / seconds
        return self._cycles_per_second
