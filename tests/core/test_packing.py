from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_cg.core.packing import PACKING_STRATEGIES, pack_items, padded_tokens

PATHS = ("local", "global")


@st.composite
def problems(draw, max_size=30):
    """Random items over two paths, a max item count, caps and ladders ending at them."""
    caps = {path: draw(st.integers(8, 64)) for path in PATHS}
    items = draw(
        st.lists(
            st.dictionaries(st.sampled_from(PATHS), st.integers(0, 72)),
            max_size=max_size,
        )
    )
    max_items = draw(st.integers(1, 8))
    ladders = {
        path: sorted(set(draw(st.lists(st.integers(1, cap), max_size=5))) | {cap})
        for path, cap in caps.items()
    }
    return items, max_items, caps, ladders


def pack(problem, strategy):
    items, max_items, caps, ladders = problem
    return pack_items(items, max_items, caps, strategy, budgets=ladders)


def is_oversize(item, caps):
    return any(item.get(path, 0) > cap for path, cap in caps.items())


def sums(sub_batch, items):
    return {path: sum(items[i].get(path, 0) for i in sub_batch) for path in PATHS}


def sorted_order(items):
    return sorted(range(len(items)), key=lambda i: sum(items[i].values()))


@pytest.mark.parametrize("strategy", PACKING_STRATEGIES)
@given(problem=problems())
def test_every_item_exactly_once(strategy, problem):
    sub_batches = pack(problem, strategy)
    assert sorted(i for sub_batch in sub_batches for i in sub_batch) == list(range(len(problem[0])))
    assert all(sub_batches)


@pytest.mark.parametrize("strategy", PACKING_STRATEGIES)
@given(problem=problems())
def test_limits_hold_and_oversize_items_are_alone(strategy, problem):
    items, max_items, caps, _ = problem
    for sub_batch in pack(problem, strategy):
        if any(is_oversize(items[i], caps) for i in sub_batch):
            assert len(sub_batch) == 1
            continue
        assert len(sub_batch) <= max_items
        assert all(total <= caps[path] for path, total in sums(sub_batch, items).items())


@pytest.mark.parametrize("strategy", PACKING_STRATEGIES)
@given(problem=problems())
def test_sub_batches_follow_ascending_size_with_oversize_last(strategy, problem):
    items, _, caps, _ = problem
    flat = [i for sub_batch in pack(problem, strategy) for i in sub_batch]
    order = sorted_order(items)
    fitting = [i for i in order if not is_oversize(items[i], caps)]
    oversize = [i for i in order if is_oversize(items[i], caps)]
    assert flat == fitting + oversize


@given(problem=problems())
def test_next_fit_closes_a_sub_batch_only_when_the_next_item_does_not_fit(problem):
    items, max_items, caps, _ = problem
    fitting = [b for b in pack(problem, "next_fit") if not is_oversize(items[b[0]], caps)]
    for current, following in zip(fitting, fitting[1:], strict=False):
        totals = sums(current + following[:1], items)
        full = len(current) == max_items
        assert full or any(totals[path] > cap for path, cap in caps.items())


@given(problem=problems())
def test_min_padding_never_pads_more_than_next_fit(problem):
    items, _, _, ladders = problem
    greedy = padded_tokens(pack(problem, "next_fit"), items, ladders)
    optimal = padded_tokens(pack(problem, "min_padding"), items, ladders)
    assert optimal <= greedy
    if optimal == greedy:
        assert len(pack(problem, "min_padding")) <= len(pack(problem, "next_fit"))


def contiguous_partitions(order):
    if not order:
        yield []
    for cut_count in range(len(order)):
        for cuts in combinations(range(1, len(order)), cut_count):
            bounds = [0, *cuts, len(order)]
            yield [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@given(problem=problems(max_size=7))
def test_min_padding_is_optimal_over_runs_of_the_sorted_order(problem):
    items, max_items, caps, ladders = problem
    fitting = [i for i in sorted_order(items) if not is_oversize(items[i], caps)]
    oversize = [[i] for i in sorted_order(items) if is_oversize(items[i], caps)]
    feasible = [
        runs + oversize
        for runs in contiguous_partitions(fitting)
        if all(
            len(run) <= max_items and all(sums(run, items)[p] <= caps[p] for p in PATHS)
            for run in runs
        )
    ]
    # Least padding first, then fewest sub-batches.
    best = min((padded_tokens(option, items, ladders), len(option)) for option in feasible)
    sub_batches = pack(problem, "min_padding")
    assert (padded_tokens(sub_batches, items, ladders), len(sub_batches)) == best


@pytest.mark.parametrize("strategy", PACKING_STRATEGIES)
@given(problem=problems())
def test_packing_is_deterministic(strategy, problem):
    assert pack(problem, strategy) == pack(problem, strategy)


def test_next_fit_by_hand():
    items = [
        {"local": 30, "global": 4},  # 0: total 34
        {"local": 10, "global": 4},  # 1: total 14
        {"local": 50},  # 2: total 50
        {"local": 10, "global": 4},  # 3: total 14, ties with 1: after it
        {"local": 100},  # 4: above the local cap, runs alone and last
        {"global": 12},  # 5: total 12
    ]
    # Sorted: 5 (12), 1 (14), 3 (14), 0 (34), 2 (50).
    # [5, 1, 3]: local 20, global 20; adding 0 makes global 24 > 20.
    # [0]: adding 2 makes local 80 > 64.
    caps = {"local": 64, "global": 20}
    assert pack_items(items, 4, caps) == [[5, 1, 3], [0], [2], [4]]
    # With two items per sub-batch, the count closes sub-batches first.
    assert pack_items(items, 2, caps) == [[5, 1], [3, 0], [2], [4]]


def test_min_padding_beats_next_fit_by_hand():
    # next_fit: [3, 3] pads 6 -> 8, [5] pads 5 -> 8: 5 tokens.
    # min_padding: [3] pads 3 -> 4, [3, 5] fills 8 exactly: 1 token.
    items = [{"p": 3}, {"p": 3}, {"p": 5}]
    ladders = {"p": [4, 8]}
    greedy = pack_items(items, 3, {"p": 8}, "next_fit", ladders)
    optimal = pack_items(items, 3, {"p": 8}, "min_padding", ladders)
    assert greedy == [[0, 1], [2]]
    assert optimal == [[0], [1, 2]]
    assert padded_tokens(greedy, items, ladders) == 5
    assert padded_tokens(optimal, items, ladders) == 1


def test_min_padding_prefers_fewer_sub_batches_at_equal_padding():
    # Both pad only 5 -> 6: [1, 1, 2] [4] [5] and [1] [1] [2, 4] [5]; fewer graphs win.
    items = [{"p": 1}, {"p": 1}, {"p": 2}, {"p": 4}, {"p": 5}]
    ladders = {"p": [1, 3, 4, 6]}
    sub_batches = pack_items(items, 3, {"p": 6}, "min_padding", ladders)
    assert sub_batches == [[0, 1, 2], [3], [4]]
    assert padded_tokens(sub_batches, items, ladders) == 1


def test_padded_tokens_by_hand():
    ladders = {"local": [16, 32], "global": [8]}
    items = [{"local": 10, "global": 3}, {"local": 20}, {"local": 40, "global": 1}]
    # [0]: local 10 -> 16, global 3 -> 8: 6 + 5.
    # [1]: local 20 -> 32: 12; no global tokens, the path is skipped.
    # [2]: local 40 is above 32: the item runs eagerly and pads nothing.
    assert padded_tokens([[0], [1], [2]], items, ladders) == 23
    # [0, 1]: local 30 -> 32, global 3 -> 8.
    assert padded_tokens([[0, 1]], items, ladders) == 7


def test_zero_rung_is_accepted_for_optional_paths():
    items = [{"local": 10}, {"local": 20, "global": 3}]
    ladders = {"local": [16, 32], "global": [0, 8]}
    sub_batches = pack_items(items, 1, {"local": 32, "global": 8}, "min_padding", ladders)
    assert sub_batches == [[0], [1]]
    assert padded_tokens(sub_batches, items, ladders) == 6 + 12 + 5


@pytest.mark.parametrize("strategy", PACKING_STRATEGIES)
def test_empty_input(strategy):
    assert pack_items([], 4, {"p": 8}, strategy, {"p": [8]}) == []
    assert padded_tokens([], [], {"p": [8]}) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "first_fit"}, "strategy must be one of next_fit, min_padding"),
        ({"max_items": 0}, "max_items"),
        ({"max_items": 1.5}, "max_items"),
        ({"max_budgets": {}}, "max_budgets"),
        ({"max_budgets": {"p": 0}}, "max_budgets"),
        ({"strategy": "min_padding", "budgets": None}, "needs budgets"),
        ({"strategy": "min_padding", "budgets": {"p": [4]}}, r"budgets\['p'\] must end at"),
        ({"strategy": "min_padding", "budgets": {"p": [4, 16]}}, r"budgets\['p'\] must end at"),
        ({"strategy": "min_padding", "budgets": {"p": [8], "q": [8]}}, "same paths"),
        ({"strategy": "min_padding", "budgets": {"p": []}}, r"budgets\['p'\]"),
        ({"strategy": "min_padding", "budgets": {"p": [-1, 8]}}, r"budgets\['p'\]"),
        ({"item_tokens": [{"q": 3}]}, "path 'q'"),
        ({"item_tokens": [{"p": -3}]}, r"item_tokens\[0\]\['p'\]"),
    ],
)
def test_errors_name_the_argument(kwargs, match):
    arguments = {
        "item_tokens": [{"p": 3}],
        "max_items": 2,
        "max_budgets": {"p": 8},
        "strategy": "next_fit",
        "budgets": {"p": [4, 8]},
    }
    with pytest.raises(ValueError, match=match):
        pack_items(**(arguments | kwargs))


def test_padded_tokens_rejects_items_on_unknown_paths():
    with pytest.raises(ValueError, match="path 'q'"):
        padded_tokens([[0]], [{"q": 3}], {"p": [8]})


@st.composite
def equal_item_problems(draw):
    """A batch of one item size repeated (a batch-first tower's batches)."""
    items, max_items, caps, ladders = draw(problems(max_size=1))
    item = items[0] if items else {}
    return [dict(item) for _ in range(draw(st.integers(1, 40)))], max_items, caps, ladders


@given(problem=equal_item_problems())
def test_next_fit_of_equal_items_keeps_every_rule(problem):
    items, max_items, caps, _ = problem
    sub_batches = pack(problem, "next_fit")
    assert [i for sub_batch in sub_batches for i in sub_batch] == list(range(len(items)))
    if is_oversize(items[0], caps):
        assert all(len(sub_batch) == 1 for sub_batch in sub_batches)
        return
    for sub_batch in sub_batches:
        assert len(sub_batch) <= max_items
        assert all(total <= caps[path] for path, total in sums(sub_batch, items).items())
    for current, following in zip(sub_batches, sub_batches[1:], strict=False):
        totals = sums(current + following[:1], items)
        assert len(current) == max_items or any(totals[p] > cap for p, cap in caps.items())
