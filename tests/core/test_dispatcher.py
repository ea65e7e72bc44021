import subprocess
import sys
from pathlib import Path

import pytest

from lightning_cg.core.dispatcher import BatchDescriptor, CudagraphDispatcher, GraphMode

NONE, FULL, FULL_UNIFORM_ONLY = GraphMode.NONE, GraphMode.FULL, GraphMode.FULL_UNIFORM_ONLY
BUDGETS = [64, 256]
COUNTS = [1, 2, 4]
UNIFORM = BatchDescriptor(100, 2, uniform=True)
MIXED = BatchDescriptor(100, 2)
EXACT_KEY = BatchDescriptor(256, 2, True)
RELAXED_KEY = BatchDescriptor(256)


@pytest.mark.parametrize("mode", list(GraphMode))
def test_parse_round_trips_names_and_members(mode):
    assert GraphMode.parse(mode.value) is mode
    assert GraphMode.parse(mode) is mode


@pytest.mark.parametrize("value", ["fast", "FULL", "", None, "piecewise"])
def test_parse_rejects_unknown_names(value):
    with pytest.raises(ValueError) as info:
        GraphMode.parse(value)
    assert str(info.value) == (
        f"mode must be one of none, full, full_uniform_only; got mode={value!r}"
    )


def test_keys_of_each_mode():
    expected = {
        NONE: set(),
        FULL: {BatchDescriptor(64), BatchDescriptor(256)},
        FULL_UNIFORM_ONLY: {BatchDescriptor(b, n, True) for b in BUDGETS for n in COUNTS},
    }
    for mode, keys in expected.items():
        assert CudagraphDispatcher(mode, BUDGETS, COUNTS).keys == keys, mode


def test_exact_keys_skip_counts_above_the_budget():
    dispatcher = CudagraphDispatcher("full_uniform_only", [64, 256], [1, 64, 128])
    assert dispatcher.keys == {
        BatchDescriptor(64, 1, True),
        BatchDescriptor(64, 64, True),
        BatchDescriptor(256, 1, True),
        BatchDescriptor(256, 64, True),
        BatchDescriptor(256, 128, True),
    }


def test_mixed_item_counts_key_full_graphs_by_item_count_up_to_the_budget():
    dispatcher = CudagraphDispatcher(FULL, [2, 6, 64], mixed_item_counts=[1, 2, 4, 8])
    assert dispatcher.keys == {
        BatchDescriptor(2, 1),
        BatchDescriptor(2, 2),
        # 6 tokens hold at most 6 items: the count stops there, not at 4 or 8.
        *(BatchDescriptor(6, count) for count in (1, 2, 4, 6)),
        *(BatchDescriptor(64, count) for count in (1, 2, 4, 8)),
    }


@pytest.mark.parametrize(
    ("tokens", "items", "key"),
    [
        (1, 1, BatchDescriptor(2, 1)),
        (2, 2, BatchDescriptor(2, 2)),
        (5, 3, BatchDescriptor(6, 4)),
        (6, 5, BatchDescriptor(6, 6)),
        (10, 1, BatchDescriptor(64, 1)),
        (40, 3, BatchDescriptor(64, 4)),
        (40, 8, BatchDescriptor(64, 8)),
    ],
)
def test_mixed_batches_take_the_smallest_item_count_that_holds_them(tokens, items, key):
    dispatcher = CudagraphDispatcher(FULL, [2, 6, 64], mixed_item_counts=[1, 2, 4, 8])
    assert dispatcher.dispatch(BatchDescriptor(tokens, items)) == key
    assert dispatcher.dispatch(BatchDescriptor(tokens, items, uniform=True)) == key


def test_more_items_than_any_mixed_count_find_no_graph():
    dispatcher = CudagraphDispatcher(FULL, [64], mixed_item_counts=[1, 2])
    assert dispatcher.dispatch(BatchDescriptor(10, 3)) is None


@pytest.mark.parametrize("mode", [NONE, FULL_UNIFORM_ONLY])
def test_mixed_item_counts_change_nothing_where_mixed_batches_are_not_graphed(mode):
    plain = CudagraphDispatcher(mode, BUDGETS, COUNTS)
    counted = CudagraphDispatcher(mode, BUDGETS, COUNTS, mixed_item_counts=[1, 2])
    assert counted.keys == plain.keys
    assert counted.dispatch(MIXED) == plain.dispatch(MIXED)


def test_replace_changes_only_the_arguments_given():
    dispatcher = CudagraphDispatcher(FULL, BUDGETS, COUNTS, mixed_item_counts=[1, 2])
    smaller = dispatcher.replace(budgets=[64])
    assert (smaller.mode, smaller.budgets) == (FULL, [64])
    assert smaller.uniform_item_counts == COUNTS and smaller.mixed_item_counts == [1, 2]
    assert smaller.keys == {BatchDescriptor(64, 1), BatchDescriptor(64, 2)}
    assert dispatcher.replace(mode=NONE).keys == set()


@pytest.mark.parametrize(
    ("mode", "uniform", "mixed"),
    [
        (NONE, None, None),
        (FULL, RELAXED_KEY, RELAXED_KEY),
        (FULL_UNIFORM_ONLY, EXACT_KEY, None),
    ],
)
def test_dispatch_in_range(mode, uniform, mixed):
    dispatcher = CudagraphDispatcher(mode.value, BUDGETS, COUNTS)
    assert dispatcher.dispatch(UNIFORM) == uniform
    assert dispatcher.dispatch(MIXED) == mixed


@pytest.mark.parametrize("mode", list(GraphMode))
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("num_tokens", [0, 257, 10**6])
def test_dispatch_out_of_range_is_eager(mode, uniform, num_tokens):
    dispatcher = CudagraphDispatcher(mode, BUDGETS, COUNTS)
    assert dispatcher.dispatch(BatchDescriptor(num_tokens, 1, uniform)) is None


@pytest.mark.parametrize(
    ("num_tokens", "budget"), [(1, 64), (63, 64), (64, 64), (65, 256), (256, 256)]
)
def test_dispatch_pads_to_the_smallest_fitting_budget(num_tokens, budget):
    exact = CudagraphDispatcher(FULL_UNIFORM_ONLY, BUDGETS, COUNTS)
    assert exact.dispatch(BatchDescriptor(num_tokens, 1, True)) == BatchDescriptor(budget, 1, True)
    relaxed = CudagraphDispatcher(FULL, BUDGETS, COUNTS)
    assert relaxed.dispatch(BatchDescriptor(num_tokens, 1)) == BatchDescriptor(budget)


def test_budgets_are_sorted_and_deduplicated():
    dispatcher = CudagraphDispatcher(FULL, [256, 64, 256])
    assert dispatcher.budgets == [64, 256]
    assert dispatcher.dispatch(BatchDescriptor(10)) == BatchDescriptor(64)


def test_a_uniform_batch_of_an_uncaptured_count_runs_eagerly_under_full_uniform_only():
    dispatcher = CudagraphDispatcher(FULL_UNIFORM_ONLY, BUDGETS, COUNTS)
    assert dispatcher.dispatch(BatchDescriptor(100, 3, True)) is None


def test_dispatch_order_exact_then_relaxed():
    dispatcher = CudagraphDispatcher(FULL_UNIFORM_ONLY, BUDGETS, COUNTS)
    # Serve both kinds of key at once so that only the lookup order decides.
    dispatcher.keys.add(RELAXED_KEY)
    assert dispatcher.dispatch(UNIFORM) == EXACT_KEY
    dispatcher.keys.remove(EXACT_KEY)
    assert dispatcher.dispatch(UNIFORM) == RELAXED_KEY
    dispatcher.keys.remove(RELAXED_KEY)
    assert dispatcher.dispatch(UNIFORM) is None


@pytest.mark.parametrize("mode", list(GraphMode))
def test_empty_budgets_dispatch_eager(mode):
    dispatcher = CudagraphDispatcher(mode, [], COUNTS)
    assert dispatcher.keys == set()
    assert dispatcher.dispatch(UNIFORM) is None
    assert dispatcher.capture_descriptors() == []


def test_capture_descriptors_largest_first_then_most_items():
    dispatcher = CudagraphDispatcher(FULL_UNIFORM_ONLY, [256, 64], [1, 2])
    assert dispatcher.capture_descriptors() == [
        BatchDescriptor(256, 2, True),
        BatchDescriptor(256, 1, True),
        BatchDescriptor(64, 2, True),
        BatchDescriptor(64, 1, True),
    ]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [(NONE, []), (FULL, [BatchDescriptor(256), BatchDescriptor(64)])],
)
def test_capture_descriptors_of_relaxed_modes(mode, expected):
    assert CudagraphDispatcher(mode, [64, 256, 64]).capture_descriptors() == expected


@pytest.mark.parametrize(
    ("budgets", "counts", "field"),
    [
        ([64, 0], (), "budgets"),
        ([-64], (), "budgets"),
        ([64.0], (), "budgets"),
        ([True], (), "budgets"),
        ([64], [0], "uniform_item_counts"),
        ([64], [2, -1], "uniform_item_counts"),
    ],
)
def test_invalid_values_name_the_field(budgets, counts, field):
    with pytest.raises(ValueError, match=f"^{field} must be positive integers"):
        CudagraphDispatcher(FULL, budgets, counts)


@pytest.mark.parametrize("counts", [[0], [1, -2], [1.5]])
def test_invalid_mixed_item_counts_name_the_field(counts):
    with pytest.raises(ValueError, match="^mixed_item_counts must be positive integers"):
        CudagraphDispatcher(FULL, BUDGETS, mixed_item_counts=counts)


def test_invalid_mode_is_rejected_at_construction():
    with pytest.raises(ValueError, match="got mode='fast'"):
        CudagraphDispatcher("fast", BUDGETS)


def test_the_core_imports_without_torch():
    code = (
        "import sys, pkgutil, importlib, lightning_cg.core as core\n"
        "for module in pkgutil.iter_modules(core.__path__):\n"
        "    importlib.import_module('lightning_cg.core.' + module.name)\n"
        "leaked = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not leaked, leaked\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
