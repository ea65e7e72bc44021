"""Where the time of lightning-cg goes: torch.profiler over one pass of a bench workload.

    python scripts/profile_host.py workloads=[packed_vit] scenarios=[photos]
    python scripts/profile_host.py workloads=[packed_vit_small] scenarios=[mixed_4] +kernels=true
    python scripts/profile_host.py workloads=[stream] +kernels=true +against=compile \
        manager.compile=true

Takes conf/bench.yaml and its overrides (the first workload: a tower's first
scenario, or ``stream``; the first mode; the ``manager`` settings), warms the
manager up, then profiles one pass on the CPU side and prints the ops with the
most self CPU time. Syncs (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``),
pinned or device allocations (``cudaHostAlloc``, ``cudaMalloc``) and graph
launches show up by name.

``+kernels=true`` (CUDA only) also records GPU work and prints, for lightning-cg
and for the method named by ``+against`` (``exact``, the default,
``compile``: torch.compile reduce-overhead, or ``eager``) on the same batches, per batch:
the wall time, the time the GPU is busy and idle, the number of kernels,
copies and memsets; then the kernels with the most device time. Idle GPU time
is host latency the GPU waits for; busy time is the GPU work itself.
``+trace_dir=DIR`` also writes each method's Chrome trace there.
"""

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# bench/ is never installed, and scripts/bench.py would shadow it: the repo root comes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.methods import (  # noqa: E402
    Runner,
    compile_method,
    eager_method,
    exact_method,
    graph_method,
)
from bench.settings import BenchSettings, resolve_settings  # noqa: E402
from bench.timing import time_ms  # noqa: E402
from bench.workloads import (  # noqa: E402
    STREAM,
    Workload,
    build_tower,
    stream_workload,
    tower_workloads,
)

ROWS = 25
AGAINST = {"exact": exact_method, "compile": compile_method, "eager": eager_method}


def profile_pass(
    step: Callable[[int], object], batches: int, warmup: int, kernels: bool
) -> profile:
    """Profile one pass of ``step`` over the batches, after ``warmup`` passes."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else lambda: None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kernels else [])
    with torch.inference_mode():
        for _ in range(max(1, warmup)):
            run_pass(step, batches)
        sync()
        with profile(activities=activities) as profiler:
            run_pass(step, batches)
            sync()
    return profiler


def run_pass(step: Callable[[int], object], batches: int) -> None:
    for index in range(batches):
        step(index)


def device_summary(profiler: profile, batches: int) -> str:
    """GPU busy and idle time, kernels, copies and memsets per batch.

    Busy is the union of the intervals of all GPU activity; idle is the rest of
    the span from the first to the last of them.
    """
    events = [event for event in profiler.events() if event.device_type == DeviceType.CUDA]
    if not events:
        return "no GPU activity recorded"
    intervals = sorted((event.time_range.start, event.time_range.end) for event in events)
    busy, end = 0.0, intervals[0][0]
    for start, stop in intervals:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - intervals[0][0]
    kinds = Counter(_kind(event.name) for event in events)
    counts = ", ".join(f"{count / batches:.1f} {kind}" for kind, count in sorted(kinds.items()))
    return (
        f"per batch: GPU busy {busy / batches:.1f} us, idle {(span - busy) / batches:.1f} us; "
        f"{counts}"
    )


def _kind(name: str) -> str:
    if name.startswith("Memcpy"):
        return f"copies {name.split()[1]}"  # "Memcpy HtoD (Pinned -> Device)"
    if name.startswith("Memset"):
        return "memsets"
    return "kernels"


def load_workload(settings: BenchSettings) -> tuple[Workload, torch.nn.Module]:
    """The first configured workload (a tower's first scenario, or the stream) and its tower."""
    name = settings.workloads[0]
    tower_name = settings.stream["tower"] if name == STREAM else name
    tower = build_tower(tower_name, settings.sizes["towers"][tower_name], settings)
    if name == STREAM:
        return stream_workload(tower_name, tower, settings), tower
    return tower_workloads(tower_name, tower, settings)[0], tower


def report(name: str, runner: Runner, batches: int, warmup: int, trace_dir: str | None) -> None:
    profiler = profile_pass(runner.step, batches, warmup, kernels=True)
    with torch.inference_mode():
        wall_us = 1e3 * time_ms(lambda: run_pass(runner.step, batches), repeats=3) / batches
    print(f"{name}: wall {wall_us:.1f} us per batch; {device_summary(profiler, batches)}")
    print(profiler.key_averages().table(sort_by="self_device_time_total", row_limit=ROWS))
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(Path(trace_dir) / f"{name}.json"))


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def main(config: DictConfig) -> None:
    options = OmegaConf.to_container(config, resolve=True)
    kernels = bool(options.pop("kernels", False))
    against = options.pop("against", "exact")
    trace_dir = options.pop("trace_dir", None)
    if against not in AGAINST:
        raise ValueError(f"against must be one of {', '.join(AGAINST)}; got {against!r}")
    settings = resolve_settings(options)
    if kernels and settings.device.type != "cuda":
        raise ValueError("kernels=true records GPU kernels and needs device=cuda")
    workload, tower = load_workload(settings)
    batches = len(workload.batches)
    runner = graph_method(tower, workload, settings, mode=settings.modes[0])
    # Warm-up passes capture; the reset keeps them out of the figures.
    profile_pass(runner.step, batches, settings.warmup, kernels=False)
    runner.manager.stats.reset_run()
    graphed = profile_pass(runner.step, batches, 0, kernels=False)
    stats = runner.manager.stats
    print(
        f"{workload.name}: {batches} batches, graphs {stats.graphs}, replays {stats.hits}, "
        f"eager sub-batches {stats.misses}, host us per replay {stats.host_us_per_replay:.0f}"
    )
    print(graphed.key_averages().table(sort_by="self_cpu_time_total", row_limit=ROWS))
    if not kernels:
        return
    report("lightning-cg", runner, batches, 0, trace_dir)
    other = AGAINST[against](tower, workload, settings)
    try:
        # The first pass records (exact) or compiles (compile); one more warms up.
        report(against, other, batches, 2, trace_dir)
    finally:
        if other.close is not None:
            other.close()


if __name__ == "__main__":
    main()
