"""Long runs: thousands of validation batches of varied composition hold the graphs,
their buffers and device memory flat after warm-up, and the stats stay exact.

The CUDA test prints the allocated and reserved bytes at batch 100 and at the
last batch, and writes them to the JSON file ``$LCG_MEMORY_REPORT`` names.
"""

import gc
import json
import os
import random
import time
from pathlib import Path

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

from examples.models.packed_vit import PackedViT, packed_vit_small_config
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.engine.manager import EncoderGraphManager

WARM_UP = 100
LENGTHS = [1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100]
MiB = 2**20


class CountingEncoder(ToyEncoder):
    """Counts every run the manager makes: graph forwards (replays without CUDA) and eager."""

    def __init__(self, tower: ToyTower) -> None:
        super().__init__(tower, max_budget=64)
        self.graph_runs = 0
        self.eager_runs = 0
        self.eager_rows = 0

    def graph_forward(self, path, buffers):
        self.graph_runs += 1
        return super().graph_forward(path, buffers)

    def eager_forward(self, path, inputs):
        rows = super().eager_forward(path, inputs)
        self.eager_runs += 1
        self.eager_rows += rows.shape[0]
        return rows


def composition(rng: random.Random) -> list[int]:
    """Item lengths of one batch: empty, uniform, mixed, some above every budget."""
    count = rng.choice([0, 1, 1, 2, 3, 4, 5, 8, 13, 21])
    if rng.random() < 0.25:
        return [rng.choice(LENGTHS)] * count
    return [rng.choice(LENGTHS) for _ in range(count)]


def held(manager: EncoderGraphManager) -> dict:
    """What the manager keeps between batches: graphs, their buffers, live tensors."""
    buffers = [buffer for graph in manager.cache.graphs() for buffer in graph.buffers.values()]
    gc.collect()
    return {
        "graphs": len(manager.cache),
        "buffer_bytes": sum(buffer.nbytes for buffer in buffers),
        "buffer_addresses": sorted(buffer.data_ptr() for buffer in buffers),
        "live_tensors": sum(issubclass(type(obj), torch.Tensor) for obj in gc.get_objects()),
    }


@pytest.mark.parametrize("batches", [1_000, pytest.param(10_000, marks=pytest.mark.slow)])
def test_graphs_and_buffers_hold_flat_and_stats_stay_exact(batches):
    torch.manual_seed(0)
    rng = random.Random(batches)
    tower = ToyTower(global_tokens=4).eval()
    encoder = CountingEncoder(tower)
    manager = EncoderGraphManager(encoder, mode="full", capture="first_use")
    items = tokens = 0
    with torch.no_grad():
        for index in range(1, batches + 1):
            lengths = composition(rng) if index > 1 else [5, 7]
            x = torch.randn(sum(lengths), 8)
            manager.execute(encoder.inputs_from_call((x, torch.tensor(lengths)), {}))
            items += len(lengths)
            tokens += sum(lengths) + 4 * len(lengths)
            if index == WARM_UP:
                warm = held(manager)
    assert held(manager) == warm
    stats = manager.stats
    assert warm["graphs"] == len(manager.paths["local"].budgets) + len(
        manager.paths["global"].budgets
    )
    assert (stats.items, stats.tokens) == (items, tokens)
    assert (stats.hits, stats.misses + stats.checked_replays) == (
        encoder.graph_runs,
        encoder.eager_runs,
    )
    assert stats.real_tokens + encoder.eager_rows == tokens + stats.checked_tokens
    assert stats.checked_replays > 0
    assert stats.hits > 0 and stats.misses > 0 and stats.padded_tokens > 0


# ------------------------------------------------------------------ CUDA


def packed_batch(
    rng: random.Random, patch_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """1 to 16 images of 32 to 512 px sides, as random patches on the GPU."""
    sides = [rng.choice([2, 4, 6, 8, 10, 12, 16, 24, 32]) for _ in range(2 * rng.randint(1, 16))]
    grid = [(1, h, w) for h, w in zip(sides[::2], sides[1::2], strict=True)]
    rows = sum(t * h * w for t, h, w in grid)
    patches = torch.randn(rows, patch_dim, device="cuda", dtype=dtype)
    return patches, torch.tensor(grid)


def write_report(name: str, report: dict) -> None:
    print(json.dumps({name: report}, indent=2))
    path = os.environ.get("LCG_MEMORY_REPORT")
    if not path:
        return
    reports = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    reports[name] = report
    Path(path).write_text(json.dumps(reports, indent=2) + "\n")


@pytest.mark.cuda
@pytest.mark.parametrize("batches", [1_000, pytest.param(10_000, marks=pytest.mark.slow)])
def test_cuda_memory_holds_flat_over_a_long_validation(batches):
    # What an earlier test left would be freed during the loop, a fall that could hide growth.
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    config = packed_vit_small_config(global_view=True, global_grid=8)
    tower = PackedViT(config).cuda().to(dtype).eval()
    adapter = PackedEncoderAdapter(tower, max_token_budget=1024)
    # compile=False (the default), spelled out: compiled graphs would plan a finer
    # ladder, with many more graphs to capture below.
    manager = EncoderGraphManager(adapter, mode="full", capture="first_use", compile=False)
    rng = random.Random(batches)
    # The whole ladder up front: keys captured on demand would add graphs (and
    # memory) whenever a batch first needs one, long after the warm-up.
    patches, grid_thw = packed_batch(rng, config.patch_dim, dtype)
    manager.capture(adapter.graph_signature(adapter.inputs_from_call((patches, grid_thw), {})))
    marks = {}
    started = time.perf_counter()
    with torch.no_grad():
        for index in range(1, batches + 1):
            patches, grid_thw = packed_batch(rng, config.patch_dim, dtype)
            manager.execute(adapter.inputs_from_call((patches, grid_thw), {}))
            if index in (WARM_UP, batches):
                del patches, grid_thw
                torch.cuda.synchronize()
                marks[index] = {
                    "allocated_bytes": torch.cuda.memory_allocated(),
                    "reserved_bytes": torch.cuda.memory_reserved(),
                    "graphs": len(manager.cache),
                }
    seconds = time.perf_counter() - started
    warm, last = marks[WARM_UP], marks[batches]
    stats = manager.stats
    write_report(
        f"packed_vit_small_bf16_{batches}_batches",
        {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "tower": "packed_vit_small (d=768, 12 layers), global view 8x8, bf16",
            "budgets": {path: plan.budgets for path, plan in manager.paths.items()},
            "batches": batches,
            f"batch_{WARM_UP}": warm,
            f"batch_{batches}": last,
            "allocated_growth_bytes": last["allocated_bytes"] - warm["allocated_bytes"],
            "reserved_growth_bytes": last["reserved_bytes"] - warm["reserved_bytes"],
            "pool_bytes": stats.pool_bytes,
            "items": stats.items,
            "hits": stats.hits,
            "misses": stats.misses,
            "padding_waste": stats.padding_waste,
            "ms_per_batch": 1e3 * seconds / batches,
        },
    )
    assert last["graphs"] == warm["graphs"] == stats.graphs
    assert last["allocated_bytes"] - warm["allocated_bytes"] <= 1 * MiB
    assert last["reserved_bytes"] - warm["reserved_bytes"] <= 64 * MiB
    assert stats.misses == 0 and stats.hits == stats.sub_batches * 2  # local and global
