import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_cg.core.packing import pack_items

PATHS = ("local", "global")


@st.composite
def problems(draw, max_size=30):
    """Random items over two paths, a max item count and caps."""
    caps = {path: draw(st.integers(8, 64)) for path in PATHS}
    items = draw(
        st.lists(
            st.dictionaries(st.sampled_from(PATHS), st.integers(0, 72)),
            max_size=max_size,
        )
    )
    max_items = draw(st.integers(1, 8))
    return items, max_items, caps


def pack(problem):
    items, max_items, caps = problem
    return pack_items(items, max_items, caps)


def is_oversize(item, caps):
    return any(item.get(path, 0) > cap for path, cap in caps.items())


def sums(sub_batch, items):
    return {path: sum(items[i].get(path, 0) for i in sub_batch) for path in PATHS}


def sorted_order(items):
    return sorted(range(len(items)), key=lambda i: sum(items[i].values()))


@given(problem=problems())
def test_every_item_exactly_once(problem):
    sub_batches = pack(problem)
    assert sorted(i for sub_batch in sub_batches for i in sub_batch) == list(range(len(problem[0])))
    assert all(sub_batches)


@given(problem=problems())
def test_limits_hold_and_oversize_items_are_alone(problem):
    items, max_items, caps = problem
    for sub_batch in pack(problem):
        if any(is_oversize(items[i], caps) for i in sub_batch):
            assert len(sub_batch) == 1
            continue
        assert len(sub_batch) <= max_items
        assert all(total <= caps[path] for path, total in sums(sub_batch, items).items())


@given(problem=problems())
def test_sub_batches_follow_ascending_size_with_oversize_last(problem):
    items, _, caps = problem
    flat = [i for sub_batch in pack(problem) for i in sub_batch]
    order = sorted_order(items)
    fitting = [i for i in order if not is_oversize(items[i], caps)]
    oversize = [i for i in order if is_oversize(items[i], caps)]
    assert flat == fitting + oversize


@given(problem=problems())
def test_next_fit_closes_a_sub_batch_only_when_the_next_item_does_not_fit(problem):
    items, max_items, caps = problem
    fitting = [b for b in pack(problem) if not is_oversize(items[b[0]], caps)]
    for current, following in zip(fitting, fitting[1:], strict=False):
        totals = sums(current + following[:1], items)
        full = len(current) == max_items
        assert full or any(totals[path] > cap for path, cap in caps.items())


@given(problem=problems())
def test_packing_is_deterministic(problem):
    assert pack(problem) == pack(problem)


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


def test_an_item_at_a_largest_budget_fits_beside_items_without_tokens_on_that_path():
    # 64 local tokens fill the local budget exactly: not oversize, so the item of
    # global tokens only shares its sub-batch.
    assert pack_items([{"local": 64}, {"global": 8}], 4, {"local": 64, "global": 20}) == [[1, 0]]


def test_empty_input():
    assert pack_items([], 4, {"p": 8}) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_items": 0}, "max_items"),
        ({"max_items": 1.5}, "max_items"),
        ({"max_budgets": {}}, "max_budgets"),
        ({"max_budgets": {"p": 0}}, "max_budgets"),
        ({"item_tokens": [{"q": 3}]}, "path 'q'"),
        ({"item_tokens": [{"p": -3}]}, r"item_tokens\[0\]\['p'\]"),
    ],
)
def test_errors_name_the_argument(kwargs, match):
    arguments = {
        "item_tokens": [{"p": 3}],
        "max_items": 2,
        "max_budgets": {"p": 8},
    }
    with pytest.raises(ValueError, match=match):
        pack_items(**(arguments | kwargs))


@st.composite
def equal_item_problems(draw):
    """A batch of one item size repeated (a batch-first tower's batches)."""
    items, max_items, caps = draw(problems(max_size=1))
    item = items[0] if items else {}
    return [dict(item) for _ in range(draw(st.integers(1, 40)))], max_items, caps


@given(problem=equal_item_problems())
def test_next_fit_of_equal_items_keeps_every_rule(problem):
    items, max_items, caps = problem
    sub_batches = pack(problem)
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
