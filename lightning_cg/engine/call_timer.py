"""Time individual runs without making the GPU wait.

On CUDA, events bracket a run and are read once complete (polled, never synchronised).
A run costs the longer of GPU and host launch time: events alone under-time a run whose
kernels queued behind earlier work, so a launch-bound run would look cheap.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

Record = Callable[[float], None]


@dataclass
class Timing:
    """Set by a timed body: whether its work ran on the GPU (events time it)."""

    on_cuda: bool = False


class CallTimer:
    """Times runs and hands each duration in seconds to a callback once known."""

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, float, Record]] = deque()
        # Asked once: without a GPU, torch asks NVML anew on every call (host time).
        self._cuda = torch.cuda.is_available()

    @contextlib.contextmanager
    def timed(self, record: Record) -> Iterator[Timing]:
        """Time the body, which sets ``timing.on_cuda`` when its work ran on the GPU;
        ``record(seconds)`` is called now (CPU) or by a later :meth:`collect` (CUDA)."""
        timing = Timing()
        start = None
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        yield timing
        host_seconds = time.perf_counter() - started
        if start is None or not timing.on_cuda:
            record(host_seconds)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end, host_seconds, record))

    def collect(self) -> None:
        """Hand over the durations of completed runs."""
        while self._pending:
            start, end, host_seconds, record = self._pending[0]
            if not end.query():
                return
            self._pending.popleft()
            record(max(start.elapsed_time(end) / 1000.0, host_seconds))

    def clear(self) -> None:
        """Drop the runs not collected yet."""
        self._pending.clear()
