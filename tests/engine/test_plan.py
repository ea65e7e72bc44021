"""Plans: immutable, replaced as a whole when they change, each remembering its call
plans; the ladder compiled graphs use (``COMPILED_RATIO``)."""

import dataclasses
import warnings

import pytest
import torch
from test_faults import FailingEncoder, out_of_memory
from test_manager import capture_every_key, run
from toy_encoder import ToyEncoder, ToyTower

from lightning_cg.engine import plan as plan_module
from lightning_cg.engine.cache import GraphSet
from lightning_cg.engine.config import BudgetConfig
from lightning_cg.engine.manager import EncoderGraphManager
from lightning_cg.engine.plan import compiled_choice

LADDER = {"budgets": [8, 16, 32, 64]}


def toy_call(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(sum(lengths), 8), torch.tensor(lengths)


def call_plan(manager: EncoderGraphManager, lengths: list[int]):
    inputs = manager.encoder.inputs_from_call(toy_call(lengths), {})
    graph_set = GraphSet(manager.encoder.graph_signature(inputs))
    return manager.state.plan.call_plan(graph_set, manager.encoder.item_specs(inputs))


def test_a_call_shape_is_planned_once_per_plan():
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), budgets=LADDER)
    first = call_plan(manager, [5, 7, 60])
    assert call_plan(manager, [5, 7, 60]) is first
    assert call_plan(manager, [5, 7, 61]) is not first
    # Items packed into sub-batches within the budgets, each path keyed.
    local = [route for sub_batch in first for route in sub_batch.routes if route.path == "local"]
    assert sorted(route.total for route in local) == [12, 60]
    assert sorted(route.key.descriptor.num_tokens for route in local) == [16, 64]


def test_a_plan_cannot_be_changed_in_place():
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), budgets=LADDER)
    with pytest.raises(dataclasses.FrozenInstanceError):
        manager.paths["local"].budgets = (8,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        manager.state.plan.max_items = 1


def test_a_fault_replaces_the_plan_and_the_next_call_is_planned_anew():
    tower = ToyTower().eval()
    encoder = FailingEncoder(
        tower, lambda spec: (spec.path, spec.token_budget) == ("local", 32), out_of_memory
    )
    manager = EncoderGraphManager(encoder, budgets=LADDER, capture="first_use")
    before = manager.state.plan
    planned = call_plan(manager, [30])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(manager, *toy_call([30]))  # budget 32 runs out of memory
        replanned = call_plan(manager, [30])
        tokens, lengths = toy_call([30])
        torch.testing.assert_close(run(manager, tokens, lengths), tower(tokens, lengths))
    assert list(before.paths["local"].budgets) == [8, 16, 32, 64]  # the old plan is intact
    assert list(manager.paths["local"].budgets) == [8, 16]
    assert replanned is not planned
    [local] = [route for route in replanned[0].routes if route.path == "local"]
    assert local.key is None and local.reason == "above_budget"


@pytest.mark.parametrize(
    "choice",
    [
        BudgetConfig(ladder="pow2", min_budget=64, max_budget=4096),
        BudgetConfig(ladder="geometric", ratio=1.25, align=32),
    ],
)
def test_a_coarser_generated_ladder_becomes_geometric_at_the_compiled_ratio(choice):
    refined = compiled_choice(choice)
    assert (refined.ladder, refined.ratio) == ("geometric", 1.05)
    # Everything else is the user's choice, kept.
    kept = ("min_budget", "max_budget", "align")
    assert [getattr(refined, name) for name in kept] == [getattr(choice, name) for name in kept]


@pytest.mark.parametrize(
    "choice",
    [
        BudgetConfig(ladder="geometric", ratio=1.03),  # already finer
        BudgetConfig(ladder="geometric", ratio=1.05),
        BudgetConfig(budgets=[64, 256, 1024]),  # the user's explicit ladder
    ],
)
def test_finer_and_explicit_ladders_are_kept(choice):
    assert compiled_choice(choice) is choice


def test_a_plan_remembers_a_bounded_number_of_call_shapes(monkeypatch):
    # A long run of mixed sizes meets ever new call shapes: what a plan remembers
    # of them (its call plans and sub-batch keys, private) must stay bounded.
    monkeypatch.setattr(plan_module, "MAX_CALL_PLANS", 3)
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), budgets=LADDER)
    plans = [call_plan(manager, [length]) for length in range(1, 9)]
    assert len(manager.state.plan._calls) <= 3 and len(manager.state.plan._keys) <= 3
    # Forgotten shapes are planned again, as before.
    assert call_plan(manager, [1]) == plans[0] and call_plan(manager, [8]) == plans[-1]


def test_a_sub_batch_holds_no_more_items_than_the_tightest_path_allows():
    # local at min_budget 16 holds 64 // 16 = 4 items; global (1 to 8 tokens) holds 8.
    tower = ToyTower().eval()
    manager = EncoderGraphManager(
        ToyEncoder(tower), paths={"local": {"min_budget": 16}}, capture="first_use"
    )
    lengths = [2] * 8  # 16 tokens: one budget would hold them all, the cap does not
    assert [len(sub_batch.indices) for sub_batch in call_plan(manager, lengths)] == [4, 4]
    tokens, lengths = toy_call(lengths)
    with torch.no_grad():
        torch.testing.assert_close(run(manager, tokens, lengths), tower(tokens, lengths))
    assert manager.stats.sub_batches == 2 and manager.stats.hits == 2


def test_a_max_budget_below_the_adapters_smallest_brings_the_ladder_down_with_it():
    # ToyEncoder's local path starts at 8 tokens; the user asks for at most 4.
    manager = EncoderGraphManager(ToyEncoder(ToyTower().eval()), budgets={"max_budget": 4})
    assert list(manager.paths["local"].budgets) == [4]


@pytest.mark.parametrize("max_frames", [3, 4], ids=["3-frames", "4-frames"])
def test_graphs_per_item_count_stop_where_the_most_items_graph_holds_every_frame(max_frames):
    # One frame an item: past max_frames items, a graph would hold what the 8-item one does.
    manager = EncoderGraphManager(
        ToyEncoder(ToyTower().eval(), per_item_metadata=True),
        budgets={"budgets": [32]},
        max_items_per_batch=8,
        max_frames_per_batch=max_frames,
    )
    capture_every_key(manager, *toy_call([1]))
    slots = {
        key.descriptor.num_items: graph.spec.max_frames
        for key, graph in manager.cache.items()
        if key.path == "local"
    }
    assert slots == {1: 1, 2: 2, 8: max_frames}
