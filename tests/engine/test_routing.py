"""SubBatch gathers its items' inputs only when read; eager sub-batches of a call are
gathered once, together."""

import random

import pytest
import torch
from toy_encoder import ToyEncoder, ToyInputs, ToyTower

from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.routing import SubBatch


class GatherCountingEncoder(ToyEncoder):
    """The toy encoder, recording the indices of every ``select_items`` call."""

    def __init__(self, tower: ToyTower) -> None:
        super().__init__(tower, max_budget=64)
        self.gathered: list[list[int]] = []

    def select_items(self, inputs: ToyInputs, indices) -> ToyInputs:
        self.gathered.append(list(indices))
        return super().select_items(inputs, indices)


def toy_call(lengths: list[int], seed: int = 0) -> ToyInputs:
    generator = torch.Generator().manual_seed(seed)
    return ToyInputs(torch.randn(sum(lengths), 8, generator=generator), lengths)


def sub_batch_of(encoder: ToyEncoder, inputs: ToyInputs, positions: list[int]) -> SubBatch:
    specs = encoder.item_specs(inputs)
    return SubBatch(encoder, inputs, len(specs), positions, [specs[i] for i in positions])


def item_tokens(inputs: ToyInputs, index: int) -> torch.Tensor:
    return inputs.tokens.split(inputs.lengths)[index]


def test_inputs_are_gathered_once_and_only_when_read():
    encoder = GatherCountingEncoder(ToyTower(global_tokens=2))
    inputs = toy_call([3, 5, 2, 4])

    sub_batch = sub_batch_of(encoder, inputs, [2, 0])

    assert encoder.gathered == []
    assert sub_batch.indices == [2, 0]
    assert sub_batch.tokens("local") == [2, 3] and sub_batch.tokens("global") == [2, 2]
    assert encoder.gathered == []
    gathered = sub_batch.inputs
    assert sub_batch.inputs is gathered
    assert encoder.gathered == [[2, 0]]
    assert gathered.lengths == [2, 3]
    torch.testing.assert_close(
        gathered.tokens, torch.cat([item_tokens(inputs, 2), item_tokens(inputs, 0)])
    )


def test_every_item_of_the_source_in_order_is_the_source_itself():
    encoder = GatherCountingEncoder(ToyTower())
    inputs = toy_call([3, 5, 2])

    assert sub_batch_of(encoder, inputs, [0, 1, 2]).inputs is inputs
    assert encoder.gathered == []
    # Items in another order, or only some of them, are gathered.
    assert sub_batch_of(encoder, inputs, [1, 0, 2]).inputs is not inputs
    assert sub_batch_of(encoder, inputs, [0, 1]).inputs is not inputs
    assert encoder.gathered == [[1, 0, 2], [0, 1]]


def manager_for(encoder: ToyEncoder, **options) -> EncoderGraphManager:
    return EncoderGraphManager(
        encoder, budgets=BudgetConfig(budgets=[16, 64]), max_items_per_batch=2, **options
    )


def execute(manager: EncoderGraphManager, inputs: ToyInputs) -> torch.Tensor:
    with torch.no_grad():
        return manager.execute(inputs)


def eager(tower: ToyTower, inputs: ToyInputs) -> torch.Tensor:
    with torch.no_grad():
        return tower(inputs.tokens, torch.tensor(inputs.lengths))


#: Items of 100 and 90 tokens are above every budget: sub-batches of their own.
LENGTHS = [5, 100, 7, 3, 90, 12]


@pytest.mark.parametrize("global_tokens", [0, 4])
@pytest.mark.parametrize(
    "options",
    [{"mode": "none"}, {"capture": "paid_back"}],
    ids=["mode_none", "paid_back_first_call"],
)
def test_a_call_of_eager_sub_batches_is_one_eager_call_of_the_whole_call(global_tokens, options):
    torch.manual_seed(0)
    encoder = GatherCountingEncoder(ToyTower(global_tokens=global_tokens).eval())
    manager = manager_for(encoder, **options)
    inputs = toy_call(LENGTHS, seed=1)

    output = execute(manager, inputs)

    torch.testing.assert_close(output, eager(encoder.tower, inputs), rtol=0, atol=0)
    assert manager.stats.sub_batches >= 3 and manager.stats.hits == 0
    assert not manager.is_captured()
    # The merged eager call holds every item in order: the call's inputs, not gathered.
    assert encoder.gathered == []


def test_eager_sub_batches_beside_replayed_ones_are_gathered_once_together():
    torch.manual_seed(0)
    encoder = GatherCountingEncoder(ToyTower().eval())
    manager = manager_for(encoder, capture="first_use")
    inputs = toy_call(LENGTHS, seed=2)

    output = execute(manager, inputs)

    torch.testing.assert_close(output, eager(encoder.tower, inputs), rtol=1e-5, atol=1e-5)
    assert manager.stats.hits > 0
    # Each item is gathered once; the two eager items in one gather.
    assert sorted(sum(encoder.gathered, [])) == list(range(len(LENGTHS)))
    assert [1, 4] in encoder.gathered


def test_a_call_that_needs_gradients_is_not_gathered():
    encoder = GatherCountingEncoder(ToyTower().eval())
    manager = manager_for(encoder, capture="first_use")
    inputs = toy_call(LENGTHS, seed=3)
    inputs.tokens.requires_grad_(True)

    output = manager.execute(inputs)

    output.sum().backward()
    assert inputs.tokens.grad is not None
    assert encoder.gathered == []


def test_random_calls_equal_the_towers_forward_with_every_item_gathered_at_most_once():
    rng = random.Random(5)
    torch.manual_seed(0)
    encoder = GatherCountingEncoder(ToyTower(global_tokens=2).eval())
    manager = manager_for(encoder, capture="first_use")
    for seed in range(6):
        lengths = [rng.choice([1, 3, 8, 15, 30, 70]) for _ in range(rng.randint(1, 7))]
        inputs = toy_call(lengths, seed=seed)
        encoder.gathered.clear()
        torch.testing.assert_close(
            execute(manager, inputs), eager(encoder.tower, inputs), rtol=1e-5, atol=1e-5
        )
        gathered = sum(encoder.gathered, [])
        assert len(gathered) == len(set(gathered))


def test_a_sub_batch_of_every_item_the_packer_reordered_is_the_call_itself():
    torch.manual_seed(0)
    encoder = GatherCountingEncoder(ToyTower(global_tokens=2).eval())
    manager = manager_for(encoder, capture="first_use")
    # Packing goes smallest first (items 1, 0) but one sub-batch holds both.
    inputs = toy_call([9, 3], seed=6)

    output = execute(manager, inputs)

    torch.testing.assert_close(output, eager(encoder.tower, inputs), rtol=1e-5, atol=1e-5)
    assert manager.stats.sub_batches == 1 and manager.stats.hits == 2
    assert encoder.gathered == []


def recorded(manager: EncoderGraphManager, method: str) -> list[tuple]:
    """The arguments of every call of ``manager.policy.<method>`` from now on."""
    calls = []
    original = getattr(manager.policy, method)

    def record(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    setattr(manager.policy, method, record)
    return calls


def test_one_calls_eager_run_gives_each_key_one_timing():
    # Four sub-batches of one key run in one eager call: one timing of that key, of all
    # their tokens, so the key's samples come from several calls, not one (a cold one).
    torch.manual_seed(0)
    manager = manager_for(ToyEncoder(ToyTower().eval()))
    eager_timings = recorded(manager, "record_eager")
    inputs = toy_call([40, 40, 40, 40])

    torch.testing.assert_close(execute(manager, inputs), eager(manager.encoder.tower, inputs))

    assert manager.stats.sub_batches == 4 and manager.stats.hits == 0
    assert [(key.descriptor.num_tokens, tokens) for key, _, tokens in eager_timings] == [(64, 160)]
