"""Token budgets: the sizes a vision tower's CUDA graphs are captured at.

A sub-batch runs in the smallest graph its tokens fit; the rest is padding. ``pow2`` is
cheap to capture; ``geometric`` bounds padding to about ``ratio - 1`` with more graphs.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import Literal, get_args

#: Budget ladder shapes accepted by :func:`generate_budgets`.
Ladder = Literal["pow2", "geometric"]
LADDERS: tuple[str, ...] = get_args(Ladder)


def is_positive_int(value: object) -> bool:
    # bool is an int subclass; True is never a meant budget.
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that is neither infinite nor NaN."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_range(min_budget: int, max_budget: int) -> None:
    """Refuse budget bounds that are not positive integers with min <= max."""
    if not is_positive_int(max_budget):
        raise ValueError(f"max_budget must be a positive integer; got max_budget={max_budget!r}")
    if not is_positive_int(min_budget) or min_budget > max_budget:
        raise ValueError(
            "min_budget must be a positive integer <= max_budget; "
            f"got min_budget={min_budget!r}, max_budget={max_budget!r}"
        )


def check_ladder(ladder: str, ratio: float, align: int) -> None:
    """Refuse an unknown ladder, a ratio not above 1 or an align that is no positive integer."""
    if ladder not in LADDERS:
        raise ValueError(f"ladder must be one of {', '.join(LADDERS)}; got ladder={ladder!r}")
    if not is_finite_number(ratio) or not ratio > 1:
        raise ValueError(f"ratio must be a finite number > 1; got ratio={ratio!r}")
    if not is_positive_int(align):
        raise ValueError(f"align must be a positive integer; got align={align!r}")


def _pow2_ladder(min_budget: int, max_budget: int) -> list[int]:
    budgets = []
    budget = min_budget
    while budget <= max_budget:
        budgets.append(budget)
        budget *= 2
    return budgets


def _grown(budget: int, ratio: float) -> int:
    """The rung after ``budget`` before rounding to ``align``."""
    # round() drops float noise such as 100 * 1.1 = 110.00000000000001, which
    # ceil would turn into 111; the +1 keeps the ladder strictly increasing.
    return max(math.ceil(round(budget * ratio, 6)), budget + 1)


def _geometric_ladder(min_budget: int, max_budget: int, ratio: float, align: int) -> list[int]:
    budgets = []
    budget = min_budget
    while budget < max_budget:
        budgets.append(budget)
        if budget * ratio >= max_budget:
            break  # the next rung is max_budget, which the caller appends
        budget = math.ceil(_grown(budget, ratio) / align) * align
    return budgets


def check_geometric_rungs(min_budget: int, max_budget: int, ratio: float, align: int) -> None:
    """Refuse (ValueError) a ``ratio`` or ``align`` that leaves the geometric ladder from
    ``min_budget`` to ``max_budget`` only its two ends where doubling would put rungs between
    them: every sub-batch would pad to one of the ends."""
    check_range(min_budget, max_budget)
    check_ladder("geometric", ratio, align)
    if (
        2 * min_budget >= max_budget
        or len(_geometric_ladder(min_budget, max_budget, ratio, align)) > 1
    ):
        return
    ends = f"budgets=[{min_budget}, {max_budget}]"
    if min_budget * ratio >= max_budget:
        raise ValueError(
            f"ratio={ratio!r} leaves the geometric ladder from {min_budget} to {max_budget} "
            f"only its two ends (its first step passes {max_budget}): choose a ratio below "
            f"{max_budget / min_budget:g}, or list the ends alone as {ends}"
        )
    first = _grown(min_budget, ratio)
    raise ValueError(
        f"align={align!r} rounds the first rung of the geometric ladder from {min_budget} to "
        f"{max_budget}, {first}, up to {math.ceil(first / align) * align}, past {max_budget}, "
        f"leaving the ladder only its two ends: choose an align of at most "
        f"{max_budget - first}, or list the ends alone as {ends}"
    )


def generate_budgets(
    min_budget: int, max_budget: int, ladder: str = "pow2", ratio: float = 1.25, align: int = 16
) -> list[int]:
    """Strictly increasing budgets, ``min_budget`` first and ``max_budget`` last.

    ``pow2`` doubles from ``min_budget``; ``geometric`` grows by ``ratio`` (> 1) and
    rounds the inner rungs up to a multiple of ``align`` (:func:`check_geometric_rungs`
    refuses a choice of them that leaves only the two ends).

    Example:
        >>> generate_budgets(64, 1000)
        [64, 128, 256, 512, 1000]
    """
    check_range(min_budget, max_budget)
    check_ladder(ladder, ratio, align)
    if ladder == "pow2":
        budgets = _pow2_ladder(min_budget, max_budget)
    else:
        budgets = _geometric_ladder(min_budget, max_budget, ratio, align)
    if not budgets or budgets[-1] != max_budget:
        budgets.append(max_budget)
    return budgets


def smallest_fitting_budget(tokens: int, budgets: Sequence[int]) -> int | None:
    """The smallest of the ascending ``budgets`` >= ``tokens``; None above the largest."""
    index = bisect_left(budgets, tokens)
    return budgets[index] if index < len(budgets) else None


def check_budget_list(user_budgets: Sequence[int]) -> list[int]:
    """An explicit ladder, ascending; refused unless non-empty positive integers, each once."""
    if not user_budgets or not all(is_positive_int(budget) for budget in user_budgets):
        raise ValueError(
            f"budgets must be a non-empty list of positive integers; got budgets={user_budgets!r}"
        )
    repeated = sorted({budget for budget in user_budgets if user_budgets.count(budget) > 1})
    if repeated:
        # A repeat is most likely a typo for a budget left out: say so rather than drop it.
        raise ValueError(
            f"budgets must list each budget once; repeated: {repeated}; "
            f"got budgets={user_budgets!r}"
        )
    return sorted(user_budgets)


def _check_user_max_items(user_max_items: int, limit: int, limit_name: str) -> None:
    if not is_positive_int(user_max_items) or user_max_items > limit:
        raise ValueError(
            f"max_items must be a positive integer <= {limit_name}, {limit}: every item "
            "yields at least one output token, so a graph of budget B holds at most B items; "
            f"got max_items={user_max_items!r}"
        )


def _resolve_user_budgets(
    min_budget: int, max_budget: int, user_budgets: Sequence[int], user_max_items: int | None
) -> tuple[list[int], int]:
    budgets = check_budget_list(user_budgets)
    if user_max_items is None:
        return budgets, min(max_budget // min_budget, budgets[0])
    _check_user_max_items(user_max_items, budgets[0], "the smallest budget")
    return budgets, user_max_items


def resolve_budgets(
    min_budget: int,
    max_budget: int,
    user_budgets: Sequence[int] | None,
    user_max_items: int | None,
    *,
    ladder: str = "pow2",
    ratio: float = 1.25,
    align: int = 16,
) -> tuple[list[int], int]:
    """``(budgets, max_items)``: the budgets to capture, ascending, and the items a graph holds.

    What the user set wins; the rest derives from the tower's range. Every item is
    assumed to yield at least ``min_budget`` tokens, so the largest budget holds
    ``max_budget // min_budget`` items; a graph of budget ``B`` holds at most ``B`` items.

    Example:
        >>> resolve_budgets(64, 1024, None, None)
        ([64, 128, 256, 512, 1024], 16)
    """
    check_range(min_budget, max_budget)
    check_ladder(ladder, ratio, align)
    if user_budgets is not None:
        return _resolve_user_budgets(min_budget, max_budget, user_budgets, user_max_items)
    if user_max_items is None:
        return generate_budgets(min_budget, max_budget, ladder, ratio, align), (
            max_budget // min_budget
        )
    _check_user_max_items(user_max_items, max_budget, "max_budget")
    # The smallest graph must hold max_items items of at least one token each.
    budgets = generate_budgets(max(min_budget, user_max_items), max_budget, ladder, ratio, align)
    return budgets, user_max_items
