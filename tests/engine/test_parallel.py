import random

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from toy_encoder import ToyEncoder, ToyTower

from examples.models.packed_vit import PackedViT, PackedViTConfig, patchify
from lightning_cg.adapters.batched import BatchedEncoderAdapter
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.parallel import assign_items, execute_data_parallel

# ------------------------------------------------------------------ assign_items


def test_assign_items_example():
    assert assign_items([4, 1, 3, 2], world_size=2) == [[0, 1], [2, 3]]
    assert assign_items([5, 5, 5, 5], world_size=3) == [[0, 3], [1], [2]]
    assert assign_items([], world_size=2) == [[], []]
    assert assign_items([7], world_size=3) == [[0], [], []]


@given(
    st.lists(st.integers(min_value=0, max_value=1000), max_size=40),
    st.integers(min_value=1, max_value=8),
)
def test_assign_items_partitions_and_balances(sizes, world_size):
    shares = assign_items(sizes, world_size)
    assert len(shares) == world_size
    assert sorted(i for share in shares for i in share) == list(range(len(sizes)))
    assert all(share == sorted(share) for share in shares)
    loads = [sum(sizes[i] for i in share) for share in shares]
    # Largest-first greedy: no rank exceeds the least loaded by more than one item.
    assert max(loads) - min(loads) <= max(sizes, default=0)
    assert assign_items(list(sizes), world_size) == shares


@pytest.mark.parametrize(
    ("sizes", "world_size", "field"),
    [([1, 2], 0, "world_size"), ([1, -1], 2, r"input_sizes\[1\]"), ([1.5], 2, "input_sizes")],
)
def test_assign_items_rejects_bad_arguments(sizes, world_size, field):
    with pytest.raises(ValueError, match=field):
        assign_items(sizes, world_size)


def test_single_rank_group_is_plain_execute(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        manager, tokens, lengths = _toy_case(global_tokens=4, lengths=[3, 9, 1])
        inputs = manager.encoder.inputs_from_call((tokens, lengths), {})
        with torch.no_grad():
            torch.testing.assert_close(
                execute_data_parallel(manager, inputs), manager.execute(inputs)
            )
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_it_says_so():
    manager, tokens, lengths = _toy_case(global_tokens=0, lengths=[3])
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        execute_data_parallel(manager, manager.encoder.inputs_from_call((tokens, lengths), {}))


# ----------------------------------------------------------- spawned gloo ranks

TOY_BATCHES = [
    [30, 3, 17, 1, 8, 12, 5],  # uneven sizes
    [70, 2, 9],  # one item larger than every budget: eager on its rank
    [6],  # a single item: every other rank is empty
    [4, 4],  # fewer items than 3 ranks
    [],  # an empty batch
]


def _toy_case(global_tokens: int, lengths: list[int], seed: int = 0, device: str = "cpu"):
    torch.manual_seed(0)
    tower = ToyTower(global_tokens=global_tokens).eval().to(device)
    manager = EncoderGraphManager(
        ToyEncoder(tower, max_budget=64), mode="full", capture="first_use"
    )
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(sum(lengths), 8, generator=generator).to(device)
    return manager, tokens, torch.tensor(lengths)


def _check_toy(rank: int, world_size: int) -> None:
    for global_tokens in (0, 4):
        for seed, lengths in enumerate(TOY_BATCHES):
            manager, tokens, lengths_tensor = _toy_case(global_tokens, lengths, seed)
            inputs = manager.encoder.inputs_from_call((tokens, lengths_tensor), {})
            with torch.no_grad():
                gathered = execute_data_parallel(manager, inputs)
                items = torch.tensor(manager.stats.items)
                expected = manager.execute(inputs)  # the whole batch on one rank
            torch.testing.assert_close(gathered, expected, rtol=1e-5, atol=1e-6)
            # Each item is encoded on exactly one rank.
            dist.all_reduce(items)
            assert items.item() == len(lengths), (items, lengths)


def _check_autocast(rank: int, world_size: int) -> None:
    # bf16 rows from fp32 inputs: an empty rank learns the dtype from the header.
    manager, tokens, lengths = _toy_case(global_tokens=4, lengths=[20, 3])
    inputs = manager.encoder.inputs_from_call((tokens, lengths), {})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        gathered = execute_data_parallel(manager, inputs)
        expected = manager.execute(inputs)
    assert gathered.dtype == expected.dtype == torch.bfloat16
    assert ((gathered.float() - expected.float()).norm() / expected.float().norm()) < 2e-2


def _check_packed_vit(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    config = PackedViTConfig(
        hidden_size=32,
        depth=1,
        num_heads=2,
        patch_size=4,
        out_hidden_size=16,
        global_view=True,
        global_grid=4,
    )
    tower = PackedViT(config).eval()
    manager = EncoderGraphManager(
        PackedEncoderAdapter(tower, min_token_budget=8),
        budgets=BudgetConfig(min_budget=8, max_budget=128),
        capture="first_use",
    )
    generator = torch.Generator().manual_seed(1)
    sides = [(8, 16), (32, 24), (8, 8), (16, 40), (24, 8)]
    images = [torch.randn(3, h, w, generator=generator) for h, w in sides]
    for count in (len(images), 1):
        call = patchify(images[:count], patch_size=4)
        inputs = manager.encoder.inputs_from_call(call, {})
        with torch.no_grad():
            gathered = execute_data_parallel(manager, inputs)
            expected = tower(*call)
        torch.testing.assert_close(gathered, expected, rtol=1e-4, atol=1e-5)


def _check_batched_rows_of_any_shape(rank: int, world_size: int) -> None:
    # A batch-first tower knows no out_hidden_size; its rows are (2, 3) each.
    torch.manual_seed(0)
    tower = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.Unflatten(1, (2, 3))).eval()
    manager = EncoderGraphManager(
        BatchedEncoderAdapter(tower, max_batch_size=4), capture="first_use"
    )
    for batch in (5, 1):
        x = torch.randn(batch, 3, 4, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            gathered = execute_data_parallel(manager, manager.encoder.inputs_from_call((x,), {}))
            expected = tower(x)
        assert gathered.shape == (batch, 2, 3)
        torch.testing.assert_close(gathered, expected)


def _check_grad_runs_the_whole_batch_locally(rank: int, world_size: int) -> None:
    """With grad enabled every rank encodes the whole batch itself, with autograd history."""
    torch.manual_seed(0)
    tower = nn.Sequential(nn.Flatten(), nn.Linear(12, 6))
    manager = EncoderGraphManager(BatchedEncoderAdapter(tower, max_batch_size=4))
    x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(rank))  # rank's own rows
    out = execute_data_parallel(manager, manager.encoder.inputs_from_call((x,), {}))
    assert out.grad_fn is not None
    out.sum().backward()
    local = [parameter.grad.clone() for parameter in tower.parameters()]
    tower.zero_grad()
    tower(x).sum().backward()
    for got, expected in zip(local, (p.grad for p in tower.parameters()), strict=True):
        torch.testing.assert_close(got, expected)


def _gathered_equal_single_process(rank: int, world_size: int) -> None:
    _check_grad_runs_the_whole_batch_locally(rank, world_size)
    _check_toy(rank, world_size)
    _check_autocast(rank, world_size)
    _check_packed_vit(rank, world_size)
    _check_batched_rows_of_any_shape(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gathered_outputs_equal_single_process(world_size):
    run_ranks(_gathered_equal_single_process, world_size)


def _nccl_gathered_equal_single_process(rank: int, world_size: int) -> None:
    device = f"cuda:{rank}"
    for global_tokens in (0, 4):
        for seed, lengths in enumerate(TOY_BATCHES):
            manager, tokens, lengths_tensor = _toy_case(global_tokens, lengths, seed, device)
            inputs = manager.encoder.inputs_from_call((tokens, lengths_tensor), {})
            for dtype in (torch.float32, torch.bfloat16):
                with (
                    torch.no_grad(),
                    torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32),
                ):
                    gathered = execute_data_parallel(manager, inputs)
                    expected = manager.execute(inputs)
                assert gathered.dtype == expected.dtype and gathered.device == expected.device
                error = (gathered.float() - expected.float()).norm() / expected.float().norm()
                assert not lengths or error < (1e-4 if dtype == torch.float32 else 2e-2)
            assert manager.stats.graphs > 0 or not lengths


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_gathered_outputs_equal_single_process_with_captured_graphs():
    run_ranks(_nccl_gathered_equal_single_process, 2, backend="nccl", timeout=300)


class _FailingEncoder(ToyEncoder):
    def __init__(self, tower: ToyTower, failing_rank: int) -> None:
        super().__init__(tower, max_budget=64)
        self.failing_rank = failing_rank

    def eager_forward(self, path, inputs):
        if dist.get_rank() == self.failing_rank:
            raise ValueError("tower exploded")
        return super().eager_forward(path, inputs)


def _failures_reach_every_rank(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    tower = ToyTower().eval()
    manager = EncoderGraphManager(
        _FailingEncoder(tower, failing_rank=1), mode="none", capture="first_use"
    )
    tokens, lengths = torch.randn(12, 8), torch.tensor([5, 7])
    inputs = manager.encoder.inputs_from_call((tokens, lengths), {})
    expected = "tower exploded" if rank == 1 else r"rank\(s\) \[1\] failed"
    with torch.no_grad(), pytest.raises((ValueError, RuntimeError), match=expected):
        execute_data_parallel(manager, inputs)

    # Ranks that were handed different batches (a DistributedSampler) refuse alike.
    manager, tokens, lengths = _toy_case(global_tokens=0, lengths=[3, 5 + rank])
    inputs = manager.encoder.inputs_from_call((tokens, lengths), {})
    with torch.no_grad(), pytest.raises(RuntimeError, match="same batch"):
        execute_data_parallel(manager, inputs)

    # The group is still in step afterwards.
    lengths = [random.Random(0).randrange(1, 20) for _ in range(3)]
    manager, tokens, lengths_tensor = _toy_case(global_tokens=0, lengths=lengths)
    inputs = manager.encoder.inputs_from_call((tokens, lengths_tensor), {})
    with torch.no_grad():
        torch.testing.assert_close(execute_data_parallel(manager, inputs), manager.execute(inputs))


def test_a_failing_rank_or_a_different_batch_fails_every_rank_without_deadlock():
    run_ranks(_failures_reach_every_rank, 2)
