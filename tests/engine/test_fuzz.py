"""Fuzz: replay equals eager on thousands of random batch compositions.

On the CPU the toy tower runs through managers of every mode, packing and
ladder kind; on a GPU the packed tower (packed_vit_small) is captured in bf16
and fp32. A failure names the batch that broke it.
"""

import random

import pytest
import torch
from toy_encoder import ToyEncoder, ToyTower

from examples.models.packed_vit import PackedViT, packed_vit_small_config
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.replay import relative_error

LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 100]
MANAGERS = {
    "full": dict(mode="full"),
    "full/max_items_per_batch=3": dict(mode="full", max_items_per_batch=3),
    "full/geometric/frames=4": dict(
        mode="full",
        budgets=BudgetConfig(ladder="geometric", min_budget=8, max_budget=64, ratio=1.5, align=4),
        max_frames_per_batch=4,
    ),
    "full/explicit": dict(mode="full", budgets=BudgetConfig(budgets=[8, 24, 64])),
    "full_uniform_only": dict(mode="full_uniform_only"),
    "none": dict(mode="none"),
}


def composition(rng: random.Random) -> list[int]:
    """Item lengths: empty, one item, uniform or mixed batches, some items above every budget."""
    count = rng.choice([0, 1, 1, 2, 3, 4, 5, 8, 13, 21])
    if rng.random() < 0.3:
        return [rng.choice(LENGTHS)] * count
    return [rng.choice(LENGTHS) for _ in range(count)]


def tokens_for(rng: random.Random, rows: int, width: int, **options) -> torch.Tensor:
    """Random rows, one batch in five laid out non-contiguously."""
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    layout = rng.choice(["contiguous"] * 8 + ["transposed", "strided"])
    if layout == "transposed":
        return torch.randn(width, rows, generator=generator).to(**options).t()
    if layout == "strided":
        return torch.randn(rows, 2 * width, generator=generator).to(**options)[:, ::2]
    return torch.randn(rows, width, generator=generator).to(**options)


@pytest.mark.parametrize("batches", [1_000, pytest.param(10_000, marks=pytest.mark.slow)])
def test_replay_equals_eager_on_random_compositions(batches):
    torch.manual_seed(0)
    towers = {tokens: ToyTower(global_tokens=tokens).eval() for tokens in (0, 4)}
    managers = {
        (name, tokens): EncoderGraphManager(
            ToyEncoder(tower, max_budget=64), **options, capture="first_use"
        )
        for name, options in MANAGERS.items()
        for tokens, tower in towers.items()
    }
    keys = list(managers)
    rng = random.Random(batches)
    with torch.no_grad():
        for index in range(batches):
            key = rng.choice(keys)
            lengths = composition(rng)
            tokens = tokens_for(rng, sum(lengths), 8)
            expected = towers[key[1]](tokens, torch.tensor(lengths))
            actual = managers[key].execute(
                managers[key].encoder.inputs_from_call((tokens, torch.tensor(lengths)), {})
            )
            assert actual.shape == expected.shape, (index, key, lengths)
            assert relative_error(actual, expected) < 1e-5, (index, key, lengths)
    for key, manager in managers.items():
        graphed = key[0] != "none" and manager.stats.items > 0
        assert (manager.stats.hits > 0) == graphed, key


# ------------------------------------------------------------------ CUDA


def packed_batch(
    rng: random.Random, patch_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """0 to 16 items of 32 to 768 px sides; a few two-frame videos, a few above every budget."""
    count = rng.choice([0, 1, 1, 2, 3, 4, 6, 8, 12, 16])
    grid = []
    for _ in range(count):
        frames = 2 if rng.random() < 0.1 else 1
        large = rng.random() < 0.03  # 576 tokens: above the 512 budget, runs eagerly
        h, w = (48, 48) if large else (rng.choice(range(2, 34, 2)), rng.choice(range(2, 34, 2)))
        grid.append((frames, h, w))
    rows = sum(t * h * w for t, h, w in grid)
    patches = tokens_for(rng, rows, patch_dim, device="cuda", dtype=dtype)
    return patches, torch.tensor(grid, dtype=torch.long).reshape(-1, 3)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
def test_cuda_packed_replay_equals_eager_on_random_compositions(dtype, tolerance, monkeypatch):
    # fp32 compares at 1e-5: no TF32 in the matmuls, whatever an earlier test set.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    config = packed_vit_small_config(global_view=True, global_grid=8)
    tower = PackedViT(config).cuda().to(dtype).eval()
    adapter = PackedEncoderAdapter(tower, max_frames_per_item=2, max_token_budget=512)
    manager = EncoderGraphManager(adapter, mode="full", capture="first_use")
    rng = random.Random(str(dtype))
    with torch.no_grad():
        for index in range(500):
            patches, grid_thw = packed_batch(rng, config.patch_dim, dtype)
            expected = tower(patches, grid_thw)
            actual = manager.execute(adapter.inputs_from_call((patches, grid_thw), {}))
            assert actual.shape == expected.shape, (index, grid_thw.tolist())
            assert torch.isfinite(actual).all(), (index, grid_thw.tolist())
            error = relative_error(actual, expected)
            assert error < tolerance, (index, error, grid_thw.tolist())
    stats = manager.stats
    assert stats.hits > 0 and stats.misses > 0 and stats.graphs == len(manager.cache)
    assert all(graph.cuda_graph is not None for graph in manager.cache.graphs())
