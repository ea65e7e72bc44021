import subprocess
import sys
from pathlib import Path

import pytest

from lightning_cg.core.dispatcher import BatchDescriptor, CudagraphDispatcher, GraphMode

NONE, PIECEWISE, FULL = GraphMode.NONE, GraphMode.PIECEWISE, GraphMode.FULL
FULL_UNIFORM_ONLY, FULL_AND_PIECEWISE = GraphMode.FULL_UNIFORM_ONLY, GraphMode.FULL_AND_PIECEWISE
BUDGETS = [64, 256]
COUNTS = [1, 2, 4]


@pytest.mark.parametrize(
    ("mode", "uniform", "mixed", "separate", "piecewise"),
    [
        (NONE, NONE, NONE, False, False),
        (PIECEWISE, PIECEWISE, PIECEWISE, False, True),
        (FULL, FULL, FULL, False, False),
        (FULL_UNIFORM_ONLY, FULL, NONE, True, False),
        (FULL_AND_PIECEWISE, FULL, PIECEWISE, True, True),
    ],
)
def test_graph_mode_runtime_modes(mode, uniform, mixed, separate, piecewise):
    assert mode.uniform_mode() is uniform
    assert mode.mixed_mode() is mixed
    assert mode.separate_routine() is separate
    assert mode.requires_piecewise() is piecewise
    for runtime in (NONE, PIECEWISE, FULL):
        assert mode.has_mode(runtime) is (runtime in (uniform, mixed))


@pytest.mark.parametrize("mode", list(GraphMode))
def test_parse_round_trips_names_and_members(mode):
    assert GraphMode.parse(mode.value) is mode
    assert GraphMode.parse(mode) is mode


@pytest.mark.parametrize("value", ["fast", "FULL", "", None])
def test_parse_rejects_unknown_names(value):
    with pytest.raises(ValueError) as info:
        GraphMode.parse(value)
    assert str(info.value) == (
        "mode must be one of none, piecewise, full, full_uniform_only, full_and_piecewise; "
        f"got mode={value!r}"
    )


def test_relaxed_keeps_only_tokens():
    assert BatchDescriptor(256, 3, True).relaxed() == BatchDescriptor(256, None, False)


def test_keys_of_each_mode():
    relaxed = {BatchDescriptor(64), BatchDescriptor(256)}
    exact = {BatchDescriptor(b, n, True) for b in BUDGETS for n in COUNTS}
    expected = {
        NONE: (set(), set()),
        PIECEWISE: (set(), relaxed),
        FULL: (relaxed, set()),
        FULL_UNIFORM_ONLY: (exact, set()),
        FULL_AND_PIECEWISE: (exact, relaxed),
    }
    for mode, (full_keys, piecewise_keys) in expected.items():
        dispatcher = CudagraphDispatcher(mode, BUDGETS, COUNTS)
        assert dispatcher.keys == {FULL: full_keys, PIECEWISE: piecewise_keys}, mode


def test_exact_keys_skip_counts_above_the_budget():
    dispatcher = CudagraphDispatcher("full_and_piecewise", [64, 256], [1, 64, 128])
    assert dispatcher.keys[FULL] == {
        BatchDescriptor(64, 1, True),
        BatchDescriptor(64, 64, True),
        BatchDescriptor(256, 1, True),
        BatchDescriptor(256, 64, True),
        BatchDescriptor(256, 128, True),
    }


def test_mixed_item_counts_key_full_graphs_by_item_count_up_to_the_budget():
    dispatcher = CudagraphDispatcher(FULL, [2, 6, 64], mixed_item_counts=[1, 2, 4, 8])
    assert dispatcher.keys[FULL] == {
        BatchDescriptor(2, 1),
        BatchDescriptor(2, 2),
        # 6 tokens hold at most 6 items: the count stops there, not at 4 or 8.
        *(BatchDescriptor(6, count) for count in (1, 2, 4, 6)),
        *(BatchDescriptor(64, count) for count in (1, 2, 4, 8)),
    }
    assert dispatcher.keys[PIECEWISE] == set()


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
    assert dispatcher.dispatch(BatchDescriptor(tokens, items)) == (FULL, key)
    assert dispatcher.dispatch(BatchDescriptor(tokens, items, uniform=True)) == (FULL, key)


def test_more_items_than_any_mixed_count_find_no_full_graph():
    dispatcher = CudagraphDispatcher(FULL, [64], mixed_item_counts=[1, 2])
    assert dispatcher.dispatch(BatchDescriptor(10, 3)) == (NONE, None)


@pytest.mark.parametrize("mode", [NONE, PIECEWISE, FULL_UNIFORM_ONLY, FULL_AND_PIECEWISE])
def test_mixed_item_counts_change_nothing_where_mixed_batches_are_not_full(mode):
    plain = CudagraphDispatcher(mode, BUDGETS, COUNTS)
    counted = CudagraphDispatcher(mode, BUDGETS, COUNTS, mixed_item_counts=[1, 2])
    assert counted.keys == plain.keys
    assert counted.dispatch(MIXED) == plain.dispatch(MIXED)


def test_replace_changes_only_the_arguments_given():
    dispatcher = CudagraphDispatcher(FULL, BUDGETS, COUNTS, mixed_item_counts=[1, 2])
    smaller = dispatcher.replace(budgets=[64])
    assert (smaller.mode, smaller.budgets) == (FULL, [64])
    assert smaller.uniform_item_counts == COUNTS and smaller.mixed_item_counts == [1, 2]
    assert smaller.keys[FULL] == {BatchDescriptor(64, 1), BatchDescriptor(64, 2)}
    assert dispatcher.replace(mode=PIECEWISE).keys[PIECEWISE] == {BatchDescriptor(64), RELAXED_KEY}


UNIFORM = BatchDescriptor(100, 2, uniform=True)
MIXED = BatchDescriptor(100, 2)
EXACT_KEY = BatchDescriptor(256, 2, True)
RELAXED_KEY = BatchDescriptor(256)


@pytest.mark.parametrize(
    ("mode", "uniform", "mixed"),
    [
        (NONE, (NONE, None), (NONE, None)),
        (PIECEWISE, (PIECEWISE, RELAXED_KEY), (PIECEWISE, RELAXED_KEY)),
        (FULL, (FULL, RELAXED_KEY), (FULL, RELAXED_KEY)),
        (FULL_UNIFORM_ONLY, (FULL, EXACT_KEY), (NONE, None)),
        (FULL_AND_PIECEWISE, (FULL, EXACT_KEY), (PIECEWISE, RELAXED_KEY)),
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
    assert dispatcher.dispatch(BatchDescriptor(num_tokens, 1, uniform)) == (NONE, None)


@pytest.mark.parametrize(
    ("num_tokens", "budget"), [(1, 64), (63, 64), (64, 64), (65, 256), (256, 256)]
)
def test_dispatch_pads_to_the_smallest_fitting_budget(num_tokens, budget):
    dispatcher = CudagraphDispatcher(FULL_AND_PIECEWISE, BUDGETS, COUNTS)
    assert dispatcher.dispatch(BatchDescriptor(num_tokens, 1, True)) == (
        FULL,
        BatchDescriptor(budget, 1, True),
    )
    assert dispatcher.dispatch(BatchDescriptor(num_tokens, 1)) == (
        PIECEWISE,
        BatchDescriptor(budget),
    )


def test_budgets_are_sorted_and_deduplicated():
    dispatcher = CudagraphDispatcher(FULL, [256, 64, 256])
    assert dispatcher.budgets == [64, 256]
    assert dispatcher.dispatch(BatchDescriptor(10)) == (FULL, BatchDescriptor(64))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (FULL_AND_PIECEWISE, (PIECEWISE, RELAXED_KEY)),
        (FULL_UNIFORM_ONLY, (NONE, None)),
    ],
)
def test_uniform_batch_of_an_uncaptured_count_falls_back(mode, expected):
    dispatcher = CudagraphDispatcher(mode, BUDGETS, COUNTS)
    assert dispatcher.dispatch(BatchDescriptor(100, 3, True)) == expected


@pytest.mark.parametrize(
    ("mode", "uniform", "mixed"),
    [
        (NONE, (NONE, None), (NONE, None)),
        (PIECEWISE, (PIECEWISE, RELAXED_KEY), (PIECEWISE, RELAXED_KEY)),
        (FULL, (NONE, None), (NONE, None)),
        (FULL_UNIFORM_ONLY, (NONE, None), (NONE, None)),
        (FULL_AND_PIECEWISE, (PIECEWISE, RELAXED_KEY), (PIECEWISE, RELAXED_KEY)),
    ],
)
def test_disable_full_skips_full_graphs(mode, uniform, mixed):
    dispatcher = CudagraphDispatcher(mode, BUDGETS, COUNTS)
    assert dispatcher.dispatch(UNIFORM, disable_full=True) == uniform
    assert dispatcher.dispatch(MIXED, disable_full=True) == mixed


def test_dispatch_order_exact_then_relaxed_then_piecewise():
    dispatcher = CudagraphDispatcher(FULL_AND_PIECEWISE, BUDGETS, COUNTS)
    # Serve every kind of key at once so that only the lookup order decides.
    dispatcher.keys[FULL].add(RELAXED_KEY)
    assert dispatcher.dispatch(UNIFORM) == (FULL, EXACT_KEY)
    dispatcher.keys[FULL].remove(EXACT_KEY)
    assert dispatcher.dispatch(UNIFORM) == (FULL, RELAXED_KEY)
    dispatcher.keys[FULL].remove(RELAXED_KEY)
    assert dispatcher.dispatch(UNIFORM) == (PIECEWISE, RELAXED_KEY)
    dispatcher.keys[PIECEWISE].remove(RELAXED_KEY)
    assert dispatcher.dispatch(UNIFORM) == (NONE, None)


@pytest.mark.parametrize("mode", list(GraphMode))
def test_empty_budgets_dispatch_eager(mode):
    dispatcher = CudagraphDispatcher(mode, [], COUNTS)
    assert dispatcher.keys == {FULL: set(), PIECEWISE: set()}
    assert dispatcher.dispatch(UNIFORM) == (NONE, None)
    assert dispatcher.capture_descriptors() == []


def test_capture_descriptors_piecewise_first_largest_first():
    dispatcher = CudagraphDispatcher(FULL_AND_PIECEWISE, [256, 64], [1, 2])
    assert dispatcher.capture_descriptors() == [
        (PIECEWISE, BatchDescriptor(256)),
        (PIECEWISE, BatchDescriptor(64)),
        (FULL, BatchDescriptor(256, 2, True)),
        (FULL, BatchDescriptor(256, 1, True)),
        (FULL, BatchDescriptor(64, 2, True)),
        (FULL, BatchDescriptor(64, 1, True)),
    ]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (NONE, []),
        (PIECEWISE, [(PIECEWISE, BatchDescriptor(256)), (PIECEWISE, BatchDescriptor(64))]),
        (FULL, [(FULL, BatchDescriptor(256)), (FULL, BatchDescriptor(64))]),
    ],
)
def test_capture_descriptors_of_single_routine_modes(mode, expected):
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
