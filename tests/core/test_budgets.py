import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_cg.core.budgets import (
    check_geometric_rungs,
    generate_budgets,
    resolve_budgets,
    smallest_fitting_budget,
)


@pytest.mark.parametrize(
    ("min_budget", "max_budget", "expected"),
    [
        (64, 1024, [64, 128, 256, 512, 1024]),
        (64, 1000, [64, 128, 256, 512, 1000]),
        (64, 64, [64]),
        (64, 100, [64, 100]),
        (1, 5, [1, 2, 4, 5]),
    ],
)
def test_pow2_ladder(min_budget, max_budget, expected):
    assert generate_budgets(min_budget, max_budget) == expected


def test_geometric_ladder_by_hand():
    # 64 * 1.25 = 80; 80 * 1.25 = 100 -> 112; 112 * 1.25 = 140 -> 144; then max.
    assert generate_budgets(64, 150, "geometric", ratio=1.25, align=16) == [64, 80, 112, 144, 150]


def test_geometric_ladder_ignores_float_noise():
    # 100 * 1.1 is 110.00000000000001 in floating point; the rung is still 110.
    assert generate_budgets(100, 120, "geometric", ratio=1.1, align=1) == [100, 110, 120]


def test_a_ratio_past_the_range_gives_its_two_ends():
    # 64 * 1e308 overflows to inf: the ladder must not round it.
    assert generate_budgets(64, 1024, "geometric", ratio=1e308, align=16) == [64, 1024]


# (id, min_budget, max_budget, ratio, align, the refusal)
LADDERS_LEFT_TWO_ENDS = [
    (
        "a ratio that overflows",
        64,
        1024,
        1e308,
        16,
        "ratio=1e+308 leaves the geometric ladder from 64 to 1024 only its two ends (its "
        "first step passes 1024): choose a ratio below 16, or list the ends alone as "
        "budgets=[64, 1024]",
    ),
    (
        "a ratio of the whole range",
        64,
        1024,
        16,
        16,
        "ratio=16 leaves the geometric ladder from 64 to 1024 only its two ends",
    ),
    (
        "an align past the range",
        64,
        1024,
        1.25,
        10**9,
        "align=1000000000 rounds the first rung of the geometric ladder from 64 to 1024, 80, "
        "up to 1000000000, past 1024, leaving the ladder only its two ends: choose an align "
        "of at most 944, or list the ends alone as budgets=[64, 1024]",
    ),
    (
        "the default align on batch sizes",
        1,
        8,
        1.25,
        16,
        "align=16 rounds the first rung of the geometric ladder from 1 to 8, 2, up to 16",
    ),
]


@pytest.mark.parametrize(
    ("min_budget", "max_budget", "ratio", "align", "refusal"),
    [row[1:] for row in LADDERS_LEFT_TWO_ENDS],
    ids=[row[0] for row in LADDERS_LEFT_TWO_ENDS],
)
def test_a_geometric_ladder_left_its_two_ends_is_refused_naming_the_value(
    min_budget, max_budget, ratio, align, refusal
):
    assert generate_budgets(min_budget, max_budget, "geometric", ratio, align) == [
        min_budget,
        max_budget,
    ]
    with pytest.raises(ValueError, match=re.escape(refusal)):
        check_geometric_rungs(min_budget, max_budget, ratio, align)


@given(
    min_budget=st.integers(1, 2000),
    span=st.integers(0, 20000),
    ratio=st.floats(1.01, 3.0),
    align=st.integers(1, 64),
)
def test_only_a_geometric_ladder_of_its_two_ends_where_doubling_has_rungs_is_refused(
    min_budget, span, ratio, align
):
    max_budget = min_budget + span
    collapsed = len(generate_budgets(min_budget, max_budget, "geometric", ratio, align)) == 2
    refused = collapsed and len(generate_budgets(min_budget, max_budget)) > 2
    try:
        check_geometric_rungs(min_budget, max_budget, ratio, align)
    except ValueError as error:
        assert refused and "only its two ends" in str(error)
    else:
        assert not refused


@pytest.mark.parametrize("ratio", [float("inf"), float("nan")])
def test_a_ratio_that_is_not_finite_is_refused(ratio):
    with pytest.raises(ValueError, match=r"ratio must be a finite number > 1"):
        generate_budgets(64, 1024, "geometric", ratio=ratio, align=16)


@given(
    min_budget=st.integers(1, 2000),
    span=st.integers(0, 20000),
    ratio=st.floats(1.01, 3.0),
    align=st.integers(1, 64),
)
def test_geometric_ladder_properties(min_budget, span, ratio, align):
    max_budget = min_budget + span
    budgets = generate_budgets(min_budget, max_budget, "geometric", ratio=ratio, align=align)
    assert budgets[0] == min_budget
    assert budgets[-1] == max_budget
    assert all(a < b for a, b in zip(budgets, budgets[1:], strict=False))
    assert all(budget % align == 0 for budget in budgets[1:-1])
    # Each rung grows by at least the ratio, and by no more than one alignment
    # step past it; only the max may come sooner.
    for smaller, larger in zip(budgets[:-2], budgets[1:-1], strict=True):
        assert larger >= smaller * ratio - 1e-6
        assert larger <= smaller * ratio + align + 1


@given(min_budget=st.integers(1, 5000), span=st.integers(0, 50000))
def test_pow2_ladder_properties(min_budget, span):
    max_budget = min_budget + span
    budgets = generate_budgets(min_budget, max_budget)
    assert budgets[0] == min_budget
    assert budgets[-1] == max_budget
    on_ladder = budgets[-1] == min_budget * 2 ** (len(budgets) - 1)
    doublings = budgets if on_ladder else budgets[:-1]
    assert doublings == [min_budget * 2**k for k in range(len(doublings))]
    # The doublings stop only when the next one would pass the max.
    assert doublings[-1] * 2 > max_budget


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_budget": 0, "max_budget": 64}, "min_budget"),
        ({"min_budget": 128, "max_budget": 64}, "min_budget"),
        ({"min_budget": 16, "max_budget": -1}, "max_budget"),
        ({"min_budget": 16.0, "max_budget": 64}, "min_budget"),
        ({"min_budget": True, "max_budget": 64}, "min_budget"),
        ({"min_budget": 16, "max_budget": 64, "ladder": "linear"}, "ladder"),
        ({"min_budget": 16, "max_budget": 64, "ratio": 1.0}, "ratio"),
        ({"min_budget": 16, "max_budget": 64, "ladder": "geometric", "ratio": 0.5}, "ratio"),
        ({"min_budget": 16, "max_budget": 64, "align": 0}, "align"),
    ],
)
def test_generate_budgets_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        generate_budgets(**kwargs)


def test_generate_budgets_error_message_shows_values_and_allowed():
    with pytest.raises(ValueError) as info:
        generate_budgets(0, 64)
    assert str(info.value) == (
        "min_budget must be a positive integer <= max_budget; got min_budget=0, max_budget=64"
    )
    with pytest.raises(ValueError, match="pow2, geometric"):
        generate_budgets(16, 64, ladder="linear")


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [(0, 64), (1, 64), (64, 64), (65, 128), (200, 256), (256, 256), (257, None), (10**6, None)],
)
def test_smallest_fitting_budget(tokens, expected):
    assert smallest_fitting_budget(tokens, [64, 128, 256]) == expected


def test_smallest_fitting_budget_of_empty_ladder_is_none():
    assert smallest_fitting_budget(1, []) is None


@given(
    budgets=st.lists(st.integers(1, 10000), min_size=1, max_size=20, unique=True).map(sorted),
    tokens=st.integers(0, 12000),
)
def test_smallest_fitting_budget_is_the_smallest_that_fits(budgets, tokens):
    fitting = [budget for budget in budgets if tokens <= budget]
    assert smallest_fitting_budget(tokens, budgets) == (min(fitting) if fitting else None)


def test_resolve_both_given_sorts_the_ladder():
    assert resolve_budgets(64, 4096, [512, 128, 2048], 16) == ([128, 512, 2048], 16)


def test_a_repeated_budget_is_refused_by_name():
    with pytest.raises(ValueError, match=r"budgets must list each budget once; repeated: \[512\];"):
        resolve_budgets(64, 4096, [512, 128, 512, 2048], 16)


def test_resolve_both_given_max_items_may_equal_smallest_budget():
    assert resolve_budgets(64, 4096, [128, 512], 128) == ([128, 512], 128)


def test_resolve_both_given_rejects_more_items_than_smallest_budget():
    with pytest.raises(ValueError) as info:
        resolve_budgets(64, 4096, [128, 512], 129)
    message = str(info.value)
    assert "max_items" in message
    assert "smallest budget, 128" in message
    assert "at least one output token" in message


def test_resolve_only_max_items_starts_ladder_at_max_items():
    assert resolve_budgets(64, 1024, None, 100) == ([100, 200, 400, 800, 1024], 100)


def test_resolve_only_max_items_below_min_budget_keeps_min_budget():
    assert resolve_budgets(64, 1024, None, 8) == ([64, 128, 256, 512, 1024], 8)


def test_resolve_only_max_items_forwards_ladder_arguments():
    budgets, max_items = resolve_budgets(64, 150, None, 4, ladder="geometric", ratio=1.25, align=16)
    assert (budgets, max_items) == ([64, 80, 112, 144, 150], 4)


def test_resolve_only_max_items_rejects_more_items_than_max_budget():
    with pytest.raises(ValueError, match=r"max_items must be a positive integer <= max_budget"):
        resolve_budgets(64, 1024, None, 1025)


def test_resolve_only_budgets_derives_max_items():
    # max_budget // min_budget = 16 items, below the smallest budget.
    assert resolve_budgets(64, 1024, [256, 128], None) == ([128, 256], 16)
    # The smallest budget caps it: 4096 // 1 = 4096 items would not fit 32 tokens.
    assert resolve_budgets(1, 4096, [32, 64], None) == ([32, 64], 32)


def test_resolve_neither_given_uses_the_range():
    assert resolve_budgets(64, 1024, None, None) == ([64, 128, 256, 512, 1024], 16)
    assert resolve_budgets(64, 1000, None, None) == ([64, 128, 256, 512, 1000], 15)


def test_resolve_neither_given_forwards_ladder_arguments():
    budgets, _ = resolve_budgets(64, 150, None, None, ladder="geometric", ratio=1.25, align=16)
    assert budgets == [64, 80, 112, 144, 150]


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        ((0, 64, None, None), {}, "min_budget"),
        ((128, 64, None, None), {}, "min_budget"),
        ((16, 0, None, None), {}, "max_budget"),
        ((16, 64, [], None), {}, "budgets"),
        ((16, 64, [32, 0], None), {}, "budgets"),
        ((16, 64, [32, -8], 4), {}, "budgets"),
        ((16, 64, [32], 0), {}, "max_items"),
        ((16, 64, None, -3), {}, "max_items"),
        ((16, 64, None, 2.5), {}, "max_items"),
        ((16, 64, None, None), {"ladder": "fib"}, "ladder"),
        ((16, 64, [32], 4), {"ratio": 1}, "ratio"),
        ((16, 64, None, None), {"align": -16}, "align"),
    ],
)
def test_resolve_errors_name_the_field(args, kwargs, field):
    with pytest.raises(ValueError, match=field):
        resolve_budgets(*args, **kwargs)
