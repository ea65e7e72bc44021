"""The benchmark's timing: one method on one workload, timed, as one row."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.methods import Method
from bench.settings import BenchSettings
from bench.workloads import Workload

#: Keys every row carries, in table order.
ROW_KEYS = (
    "workload",
    "method",
    "ms_per_batch",
    "images_per_s",
    "vs_eager",
    "vs_exact",
    "padding_waste",
    "capture_s",
    "pool_bytes",
    "peak_mem_bytes",
    "total_s",
    "hit_rate",
    "host_us_per_replay",
    "launch_us_per_replay",
    "images",
    "batches",
    "device",
    "dtype",
    "status",
    "note",
)
NEEDS_CUDA = "unavailable: needs CUDA"
#: Status of manager rows without CUDA: the same pack/pad/scatter path, no capture.
CPU_PATH = "ok: cpu path, no CUDA graphs"


def measure(
    method: Method, tower: nn.Module, workload: Workload, settings: BenchSettings
) -> dict[str, Any]:
    """Time one method on one workload; returns its row (ratios come later)."""
    row = empty_row(workload, method.name, settings)
    if method.family in settings.skip_methods:
        row["status"] = f"skipped: skip_methods of the {settings.profile} profile"
        return row
    if method.needs_cuda and settings.device.type != "cuda":
        row["status"] = NEEDS_CUDA
        return row
    cuda = settings.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else _no_sync
    warmup, repeats = settings.warmup, settings.repeats
    if workload.stream:
        warmup, repeats = settings.stream["warmup"], settings.stream["repeats"]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    reserved_before = _reserved()
    batches = len(workload.batches)
    with torch.inference_mode():
        started = time.perf_counter()
        runner = method.build(tower, workload, settings)
        try:
            first_pass = _timed_pass(runner.step, batches, sync)
            total_s = time.perf_counter() - started
            reserved_after_first = _reserved()
            for _ in range(warmup):
                _timed_pass(runner.step, batches, sync)
            if runner.manager is not None:
                runner.manager.stats.reset_run()
            passes = [_timed_pass(runner.step, batches, sync) for _ in range(repeats)]
        finally:
            if runner.close is not None:
                runner.close()
    pass_s = statistics.median(passes)
    row.update(
        ms_per_batch=1e3 * pass_s / batches,
        images_per_s=workload.images / pass_s,
        padding_waste=0.0,
        capture_s=runner.capture_s,
        pool_bytes=runner.pool_bytes,
        peak_mem_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        total_s=total_s,
        status="ok",
        note=runner.note,
    )
    if runner.setup_in_first_pass:
        row.update(
            capture_s=max(0.0, first_pass - pass_s),
            pool_bytes=max(0, reserved_after_first - reserved_before),
        )
    if runner.manager is not None:
        stats = runner.manager.stats
        row.update(
            padding_waste=stats.padding_waste,
            hit_rate=stats.hit_rate,
            host_us_per_replay=stats.host_us_per_replay,
            launch_us_per_replay=stats.launch_us_per_replay,
            capture_s=stats.capture_seconds,
            pool_bytes=stats.pool_bytes if cuda else None,
            status="ok" if cuda else CPU_PATH,
        )
    return row


def _timed_pass(step: Callable[[int], object], batches: int, sync: Callable[[], None]) -> float:
    sync()
    started = time.perf_counter()
    for index in range(batches):
        step(index)
    sync()
    return time.perf_counter() - started


def _no_sync() -> None:
    pass


def _reserved() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def empty_row(workload: Workload, method: str, settings: BenchSettings) -> dict[str, Any]:
    """A row of ``workload`` and ``method`` with no timing yet: every key of :data:`ROW_KEYS`."""
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    device = settings.device
    row.update(
        workload=workload.name,
        method=method,
        images=workload.images,
        batches=len(workload.batches),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        dtype=str(settings.dtype).removeprefix("torch."),
        note="",
    )
    return row


def time_ms(run: Callable[[], object], repeats: int = 10, warmup: int = 3) -> float:
    """Mean milliseconds of ``run()`` back to back on the current CUDA stream (CUDA events)."""
    for _ in range(warmup):
        run()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats
