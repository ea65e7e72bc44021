"""Where the host time of lightning-cg goes: torch.profiler over one pass of a bench workload.

    python scripts/profile_host.py workloads=[packed_vit] scenarios=[photos]

Takes conf/bench.yaml and its overrides (the first packed or batched workload,
the first mode, the ``manager`` settings), warms the manager up, then profiles
one pass on the CPU side and prints the ops with the most self CPU time. Syncs
(``cudaStreamSynchronize``, ``cudaMemcpy``), pinned or device allocations
(``cudaHostAlloc``, ``cudaMalloc``) and the manager's own steps show up by name.
"""

import sys
from pathlib import Path

try:
    import lightning_cg  # noqa: F401
except ImportError:  # a checkout that is not pip-installed: import it from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.profiler import ProfilerActivity, profile

from lightning_cg.bench import build_tower, graph_method, resolve_settings, tower_workloads

ROWS = 25


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def main(config: DictConfig) -> None:
    settings = resolve_settings(OmegaConf.to_container(config, resolve=True))
    tower_name = settings.workloads[0]
    tower = build_tower(tower_name, settings.sizes["towers"][tower_name], settings)
    workload = tower_workloads(tower_name, tower, settings)[0]
    runner = graph_method(tower, workload, settings, mode=settings.modes[0])
    batches = range(len(workload.batches))
    cuda = settings.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    with torch.inference_mode():
        for _ in range(max(1, settings.warmup)):
            for index in batches:
                runner.step(index)
        sync()
        runner.manager.reset_stats()  # capture and the decision table out of the figures
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for index in batches:
                runner.step(index)
            sync()
    host_us = runner.manager.stats.host_us_per_replay
    print(f"{workload.name}: {len(batches)} batches, host us per replay {host_us:.0f}")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=ROWS))


if __name__ == "__main__":
    main()
