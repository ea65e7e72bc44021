"""Where the time of lightning-cg goes: torch.profiler over one pass of a bench workload.

    python scripts/profile_host.py workloads=[packed_vit] scenarios=[photos]
    python scripts/profile_host.py workloads=[packed_vit_small] scenarios=[mixed_4] +kernels=true

Takes conf/bench.yaml and its overrides (the first workload of the first tower,
the first mode, the ``manager`` settings), warms the manager up, then profiles
one pass on the CPU side and prints the ops with the most self CPU time. Syncs
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``), pinned or device
allocations (``cudaHostAlloc``, ``cudaMalloc``) and graph launches show up by name.

``+kernels=true`` (CUDA only) also records GPU kernels and prints, for
lightning-cg and for the exact-shape graph on the same batches, the kernels
with the most device time and the device total: the GPU work lightning-cg adds
over the limit, kernel by kernel.
"""

import sys
from collections.abc import Callable
from pathlib import Path

try:
    import lightning_cg  # noqa: F401
except ImportError:  # a checkout that is not pip-installed: import it from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.profiler import ProfilerActivity, profile

from lightning_cg.bench import (
    build_tower,
    exact_method,
    graph_method,
    resolve_settings,
    tower_workloads,
)

ROWS = 25


def profile_pass(
    step: Callable[[int], object], batches: int, warmup: int, kernels: bool
) -> profile:
    """Profile one pass of ``step`` over the batches, after ``warmup`` passes."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else lambda: None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kernels else [])
    with torch.inference_mode():
        for _ in range(max(1, warmup)):
            for index in range(batches):
                step(index)
        sync()
        with profile(activities=activities) as profiler:
            for index in range(batches):
                step(index)
            sync()
    return profiler


def device_ms(profiler: profile) -> float:
    """Milliseconds of GPU kernels in the profile."""
    return sum(event.self_device_time_total for event in profiler.key_averages()) / 1e3


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def main(config: DictConfig) -> None:
    options = OmegaConf.to_container(config, resolve=True)
    kernels = bool(options.pop("kernels", False))
    settings = resolve_settings(options)
    if kernels and settings.device.type != "cuda":
        raise ValueError("kernels=true records GPU kernels and needs device=cuda")
    tower_name = settings.workloads[0]
    tower = build_tower(tower_name, settings.sizes["towers"][tower_name], settings)
    workload = tower_workloads(tower_name, tower, settings)[0]
    batches = len(workload.batches)
    runner = graph_method(tower, workload, settings, mode=settings.modes[0])
    # Warm-up passes capture and (dispatch=measured) time the decision table;
    # the reset keeps both out of the figures.
    profile_pass(runner.step, batches, settings.warmup, kernels=False)
    runner.manager.reset_stats()
    graphed = profile_pass(runner.step, batches, 0, kernels)
    host_us = runner.manager.stats.host_us_per_replay
    print(f"{workload.name}: {batches} batches, host us per replay {host_us:.0f}")
    print(graphed.key_averages().table(sort_by="self_cpu_time_total", row_limit=ROWS))
    if not kernels:
        return
    exact = profile_pass(exact_method(tower, workload, settings).step, batches, 1, kernels)
    for name, profiler in (("lightning-cg", graphed), ("exact", exact)):
        print(f"{name}: GPU kernels {device_ms(profiler):.2f} ms in {batches} batches")
        print(profiler.key_averages().table(sort_by="self_device_time_total", row_limit=ROWS))


if __name__ == "__main__":
    main()
