"""The memory the graphs hold: their pool's segments, the weight copies, the input buffers.

CPU tests read a scripted allocator (``torch.cuda.memory_snapshot()`` segments); the
``cuda`` tests hold the stats to what the device itself reports.
"""

import gc
import random

import pytest
import torch
from test_manager import make_batch
from toy_encoder import ToyEncoder, ToyTower

import lightning_cg.engine.memory as memory
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager

MiB = 1 << 20
POOL = (0, 7)  # what torch.cuda.graph_pool_handle() returns
OTHER_POOL = (0, 9)  # another manager's, or torch.compile's
DEFAULT_POOL = (0, 0)  # ordinary allocations


def segment(pool: tuple[int, int], size: int, address: int = 0) -> dict:
    """One segment of ``torch.cuda.memory_snapshot()``, the fields read here."""
    return {
        "address": address,
        "total_size": size,
        "allocated_size": size // 2,
        "segment_pool_id": pool,
    }


@pytest.mark.parametrize(
    ("segments", "pool", "expected"),
    [
        ([segment(POOL, 2 * MiB), segment(POOL, 20 * MiB)], POOL, 22 * MiB),
        (
            [segment(DEFAULT_POOL, 64 * MiB), segment(POOL, 2 * MiB), segment(OTHER_POOL, 8 * MiB)],
            POOL,
            2 * MiB,
        ),
        ([segment(DEFAULT_POOL, 64 * MiB), segment(OTHER_POOL, 8 * MiB)], POOL, 0),
        ([segment(POOL, 2 * MiB)], None, 0),
    ],
    ids=["every-segment-of-the-pool", "only-the-pools-own", "pool-without-segments", "no-pool"],
)
def test_pool_bytes_sum_the_segments_of_the_pool(segments, pool, expected):
    assert memory.pool_bytes(pool, segments) == expected


def test_pool_bytes_count_free_blocks_the_pool_keeps():
    # The blocks freed during capture stay the pool's: the segment's whole size counts.
    half_allocated = segment(POOL, 20 * MiB)
    assert memory.pool_bytes(POOL, [half_allocated]) == 20 * MiB


def test_input_buffers_count_once_and_only_outside_the_pool():
    in_pool = segment(POOL, 4 * MiB, address=100 * MiB)
    extents = {
        10 * MiB: 3 * MiB,  # outside the pool
        101 * MiB: 1 * MiB,  # inside the pool's segment
        200 * MiB: 5 * MiB,  # outside
    }
    assert memory.bytes_outside(extents, [in_pool]) == 8 * MiB


class PoolGrowingEncoder(ToyEncoder):
    """Each capture adds a segment to the scripted graph pool, as a GPU capture allocates
    there: ``segments`` is the scripted allocator's state."""

    def __init__(self, tower, segments: list[dict]) -> None:
        super().__init__(tower, max_budget=64)
        self.segments = segments

    def capture_inputs(self, spec):
        self.segments.append(segment(POOL, 2 * MiB * spec.token_budget))
        self.segments.append(segment(DEFAULT_POOL, 64 * MiB))  # reserved elsewhere meanwhile
        return super().capture_inputs(spec)


def pool_total(segments: list[dict]) -> int:
    return sum(s["total_size"] for s in segments if s["segment_pool_id"] == POOL)


@pytest.fixture
def scripted_pool_manager(monkeypatch):
    """A CPU manager whose graph pool is read from a scripted allocator."""
    segments = [segment(OTHER_POOL, 6 * MiB)]
    tower = ToyTower(global_tokens=4).eval()
    manager = EncoderGraphManager(
        PoolGrowingEncoder(tower, segments), budgets=BudgetConfig(budgets=[8, 16])
    )
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: POOL)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(memory, "allocator_segments", lambda: list(segments))
    manager.cache.pool()  # the pool a GPU capture makes
    return manager, segments


def capture(manager: EncoderGraphManager, path: str) -> None:
    tokens, lengths = make_batch(random.Random(0), [5])
    inputs = manager.encoder.inputs_from_call((tokens, lengths), {})
    manager.capture(manager.encoder.graph_signature(inputs), paths=[path])


def test_pool_bytes_is_the_whole_pool_after_every_capture(scripted_pool_manager):
    manager, segments = scripted_pool_manager
    capture(manager, "local")
    first = manager.stats.pool_bytes
    assert first == pool_total(segments) == (8 + 16) * 2 * MiB
    capture(manager, "global")
    # Both captures' segments: neither the last capture's alone nor reserved memory growth.
    assert manager.stats.pool_bytes == pool_total(segments) == first + (8 + 16) * 2 * MiB


def test_held_bytes_is_the_pool_and_the_weight_copies_and_clear_zeroes_them(
    scripted_pool_manager,
):
    manager, segments = scripted_pool_manager
    with manager.weight_casts.swapped_in(torch.bfloat16):
        pass  # bfloat16 copies of the Linear weights, as a capture under autocast makes
    capture(manager, "local")
    stats = manager.stats
    assert stats.weight_copy_bytes == manager.weight_casts.nbytes > 0
    # CPU input buffers hold no device memory.
    assert stats.held_bytes == stats.pool_bytes + stats.weight_copy_bytes
    assert stats.pool_bytes == pool_total(segments) > 0
    manager.begin_run()
    assert stats.held_bytes == stats.pool_bytes + stats.weight_copy_bytes > 0  # held across runs
    manager.clear()
    assert (stats.pool_bytes, stats.weight_copy_bytes, stats.held_bytes) == (0, 0, 0)


# ------------------------------------------------------------------------- cuda


def free_cached_memory() -> None:
    """Leave the allocator nothing cached: what earlier tests freed is given back."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def device_pool_total(manager: EncoderGraphManager) -> int:
    """The device's own account of the manager's pool: its segments in a snapshot."""
    pool = tuple(manager.cache.pool_handle)
    return sum(
        s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool
    )


def toy_signature(manager: EncoderGraphManager) -> tuple:
    tokens, lengths = make_batch(random.Random(0), [5], device="cuda")
    return manager.encoder.graph_signature(manager.encoder.inputs_from_call((tokens, lengths), {}))


def cache_a_free_gibibyte() -> None:
    """Reserved memory with a free block: ``torch.cuda.graph`` gives it back before
    capturing, so the pool's segments take its place and reserved memory grows by little
    or nothing, which the stat measured before."""
    cached = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del cached


@pytest.mark.cuda
def test_cuda_pool_bytes_count_a_pool_that_took_the_place_of_cached_memory():
    free_cached_memory()
    torch.manual_seed(0)
    manager = EncoderGraphManager(ToyEncoder(ToyTower(global_tokens=4).cuda().eval()))
    signature = toy_signature(manager)
    cache_a_free_gibibyte()
    manager.capture(signature)
    assert manager.stats.graphs > 0
    assert manager.stats.pool_bytes > 0
    assert manager.stats.pool_bytes == device_pool_total(manager)


@pytest.mark.cuda
def test_cuda_pool_bytes_is_the_total_over_every_capture():
    free_cached_memory()
    torch.manual_seed(0)
    # A wide local path at one large budget: its capture must add segments to the pool
    # that the small global graphs made.
    tower = ToyTower(dim=512, global_tokens=4).cuda().eval()
    manager = EncoderGraphManager(
        ToyEncoder(tower, max_budget=1024), paths={"local": BudgetConfig(budgets=[1024])}
    )
    signature = toy_signature(manager)
    cache_a_free_gibibyte()
    manager.capture(signature, paths=["global"])
    first = manager.stats.pool_bytes
    assert first == device_pool_total(manager) > 0
    manager.capture(signature, paths=["local"])
    assert manager.stats.pool_bytes == device_pool_total(manager) > first


@pytest.mark.cuda
def test_cuda_buffers_sharing_a_storage_count_once():
    shared = torch.zeros(4, 8, device="cuda")
    other = torch.zeros(3, device="cuda")
    views = [shared, shared[:2], shared.view(8, 4), other, torch.zeros(5)]
    assert memory.cuda_storages(views) == {shared.data_ptr(): 4 * 32, other.data_ptr(): 4 * 3}


class Elementwise(torch.nn.Module):
    """A batch-first tower without matmuls (no cuBLAS workspace outside the graphs):
    several activations the size of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x) * self.scale
        z = torch.cos(y) + x
        return (z * y).sum(dim=(2, 3))


@pytest.mark.cuda
def test_cuda_held_bytes_is_the_device_memory_the_graphs_take():
    free_cached_memory()
    torch.manual_seed(0)
    tower = Elementwise().cuda().eval()
    adapter = BatchedEncoderAdapter(tower, max_batch_size=8)
    # 8 x 3 x 768 x 768 float32: a 54 MiB input buffer, outside the pool.
    signature = adapter.graph_signature(torch.empty(0, 3, 768, 768, device="cuda"))
    manager = EncoderGraphManager(adapter, budgets=BudgetConfig(budgets=[8]))
    free_cached_memory()
    allocated_before = torch.cuda.memory_allocated()
    manager.capture(signature)
    free_cached_memory()
    # What the graphs keep: their pool's whole segments (blocks freed during capture stay
    # the pool's), and what else the allocator counts as allocated since: the input
    # buffer, which may lie in a segment reserved before (so reserved memory misses it).
    pool = tuple(manager.cache.pool_handle)
    in_pool = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool]
    pool_allocated = sum(segment["allocated_size"] for segment in in_pool)
    outside_pool = torch.cuda.memory_allocated() - allocated_before - pool_allocated
    taken = sum(segment["total_size"] for segment in in_pool) + outside_pool
    stats = manager.stats
    assert stats.graphs == 1 and stats.weight_copy_bytes == 0
    assert stats.held_bytes > stats.pool_bytes > 0  # the input buffer lies outside the pool
    assert abs(stats.held_bytes - taken) <= 0.05 * taken, (stats.held_bytes, taken)
    assert outside_pool > 0.9 * 8 * 3 * 768 * 768 * 4  # the input buffer
